"""DPO (task=dpo): the loss equals the paper's formula computed here by hand, pair rows mask exactly the prompt and
the padding, a run starts at log 2 (policy = reference) and learns to prefer the chosen responses, alone, on LoRA
(reference = adapters off), on two FSDP ranks (equal losses) and across a resume (bit-exact)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from ember.constants import IGNORE_INDEX
from ember.finetune.dpo import dpo_loss, encode_pairs, sequence_logprobs
from tests.helpers import read_records, run_ember, tiny_model

WORDS = "import os sys def main self return None if x for in range print class".split()


class WordTokenizer:
    """A fixed id per word of a small vocabulary (EOS is 1)."""
    eos_id = 1
    ids = {word: 2 + i for i, word in enumerate("a b c d e f p q r s t".split())}

    def encode(self, text: str) -> list[int]:
        return [self.ids[word] for word in text.split()]


def test_dpo_loss_equals_the_formula():
    beta = 0.5
    pc, pr, rc, rr = (torch.tensor([-3.0, -1.0]), torch.tensor([-4.0, -0.5]), torch.tensor([-3.5, -1.0]),
                      torch.tensor([-3.0, -1.5]))
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta)
    for i in range(2):
        z = beta * ((float(pc[i]) - float(rc[i])) - (float(pr[i]) - float(rr[i])))
        assert float(loss[i]) == pytest.approx(math.log(1 + math.exp(-z)), rel=1e-6)  # -log sigmoid(z)
        assert float(chosen[i]) == pytest.approx(beta * (float(pc[i]) - float(rc[i])))
        assert float(rejected[i]) == pytest.approx(beta * (float(pr[i]) - float(rr[i])))
    same = dpo_loss(pc, pr, pc, pr, beta)[0]  # policy = reference: log 2 whatever the log-probs
    assert torch.allclose(same, torch.full((2,), math.log(2)))


def test_sequence_logprobs_sum_the_targets_only_whole_or_chunked():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[3, IGNORE_INDEX, 1, 6, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 0, 0, 2]])
    expected = torch.zeros(2)
    for b in range(2):
        for t in range(5):
            if labels[b, t] != IGNORE_INDEX:
                expected[b] += torch.log_softmax(logits[b, t], -1)[labels[b, t]]
    assert torch.allclose(sequence_logprobs(logits, labels), expected, atol=1e-6)
    assert torch.allclose(sequence_logprobs(list(logits.tensor_split(2, dim=1)), labels), expected, atol=1e-6)


def test_pair_rows_train_the_response_and_its_eos_only():
    tok = WordTokenizer()
    rows = [{"prompt": "a b c", "chosen": " d e", "rejected": " f"},
            {"prompt": "p " * 10, "chosen": " q r s", "rejected": " t"}]  # the second prompt is cut from the left
    samples = encode_pairs(rows, tok, seq_len=7, prompt_field="prompt", chosen_field="chosen",
                           rejected_field="rejected")
    a, b, c, d, e, f = (tok.ids[w] for w in "abcdef")
    assert samples.chosen[0].tolist() == [a, b, c, d, e, 1, 1, 1]  # + EOS, then EOS padding
    assert samples.chosen_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]
    assert samples.rejected[0].tolist() == [a, b, c, f, 1, 1, 1, 1]
    assert samples.rejected_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    p, q, r, s = (tok.ids[w] for w in "pqrs")
    assert samples.chosen[1].tolist() == [p, p, p, p, q, r, s, 1] and samples.chosen_mask[1].sum() == 4
    rows_, mask = samples.get(torch.tensor([1, 0]).numpy())  # chosen rows of the asked pairs, then their rejected
    assert rows_.shape == (4, 8) and rows_[0].tolist() == samples.chosen[1].tolist()
    assert rows_[3].tolist() == samples.rejected[0].tolist() and mask[3].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prompts of random code words; the chosen answer is always ' return None', the rejected two random words."""
    path = tmp_path_factory.mktemp("dpo") / "pairs.jsonl"
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(80):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            f.write(json.dumps({"prompt": prompt, "chosen": " return None",
                                "rejected": " " + " ".join(rng.choice(WORDS) for _ in range(2))}) + "\n")
    return path


TINY = [*tiny_model(), "seq_len=32", "global_batch_size=8", "micro_batch_size=4", "logging_steps=1",
        "metrics.console=false", "data.val_fraction=0.1", "eval_batches=1"]


@pytest.mark.slow
def test_a_dpo_run_starts_at_log2_and_learns_the_preference(pairs: Path, tmp_path: Path):
    run = tmp_path / "run"
    proc = run_ember("train", "debug", "task=dpo", f"data.dataset={pairs}", *TINY, "max_steps=20", "optim.lr=2e-3",
                     f"output_dir={run}")
    assert proc.returncode == 0, proc.stderr
    steps = [r for r in read_records(run) if "loss" in r and "dpo/accuracy" in r]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference at step 1
    assert steps[0]["dpo/reward_margin"] == pytest.approx(0, abs=1e-6)
    assert steps[-1]["dpo/accuracy"] == 1.0 and steps[-1]["dpo/reward_margin"] > 1.0
    assert steps[-1]["loss"] < 0.3 and steps[-1]["dpo/chosen_reward"] > steps[-1]["dpo/rejected_reward"]
    # TFLOP/s and MFU count the frozen reference's forward over every row beside the policy's training step
    from ember.models.llama import LlamaArgs, flops_per_token

    saved = json.loads(next((run / "checkpoints").glob("step-*/model.json")).read_text())
    full = flops_per_token(LlamaArgs(**saved["args"]), 32)
    record = steps[-1]
    assert (record["tflops_per_device"] * 1e12 / record["tokens_per_s_per_device"]
            == pytest.approx(full * 4 / 3, rel=1e-9))


@pytest.mark.slow
def test_dpo_on_lora_uses_the_base_as_its_reference(pairs: Path, tmp_path: Path):
    base = tmp_path / "base"
    proc = run_ember("train", "debug", *TINY, "max_steps=2", f"output_dir={base}")
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "lora"
    proc = run_ember("train", "debug", "task=dpo", f"data.dataset={pairs}", *TINY, "max_steps=20", "optim.lr=1e-2",
                     "lora.rank=4", f"model.init_from={base}", f"output_dir={run}")
    assert proc.returncode == 0, proc.stderr
    steps = [r for r in read_records(run) if "dpo/accuracy" in r]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # B = 0: adapters on equals adapters off
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.2 and steps[-1]["dpo/reward_margin"] > 0


@pytest.mark.slow
def test_dpo_on_fsdp_and_tensor_ranks_equals_one_process_and_resumes_exactly(pairs: Path, tmp_path: Path):
    common = ["task=dpo", f"data.dataset={pairs}", *TINY, "optim.lr=2e-3", "checkpoint.interval=4"]
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    assert run_ember("train", "debug", *common, "max_steps=8", f"output_dir={one}").returncode == 0
    proc = run_ember("train", "--nproc-per-node", "2", "debug", *common, "max_steps=8", "micro_batch_size=2",
                     "ici_mesh.fsdp=2", f"output_dir={two}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = lambda run: [r["loss"] for r in read_records(run) if "dpo/accuracy" in r]  # noqa: E731
    assert losses(two) == pytest.approx(losses(one), abs=1e-5)
    tensor = tmp_path / "tensor"
    proc = run_ember("train", "--nproc-per-node", "2", "debug", *common, "max_steps=8", "ici_mesh.tensor=2",
                     f"output_dir={tensor}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert losses(tensor) == pytest.approx(losses(one), abs=1e-5)
    assert run_ember("train", "debug", *common, "max_steps=4", f"output_dir={resumed}").returncode == 0
    assert run_ember("train", "debug", *common, "max_steps=8", f"output_dir={resumed}").returncode == 0
    assert losses(resumed) == losses(one)  # bit for bit: the data position, and the reference rebuilt from the start


@pytest.mark.slow
def test_dpo_mistakes_are_one_line(pairs: Path, tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "chosen": " b"}) + "\n")
    for args, message in [([f"data.dataset={bad}"], "has no 'rejected' field (DPO rows need prompt, chosen, rejected)"),
                          ([], "task=dpo reads preference pairs from data.dataset"),
                          ([f"data.dataset={pairs}", "dpo.beta=0"], "dpo.beta must be a positive number"),
                          ([f"data.dataset={pairs}", "task=ppo"], "task 'ppo' is not one of lm, dpo")]:
        proc = run_ember("train", "debug", "task=dpo", *args, *TINY, "max_steps=1", f"output_dir={tmp_path / 'x'}")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, (args, proc.stderr)
    from ember.config import ConfigError
    from ember.train import run as run_lib

    with pytest.raises(ConfigError, match="task=dpo scores whole sequences per rank; pipeline parallelism"):
        run_lib.load_config("debug", ["task=dpo", f"data.dataset={pairs}", "ici_mesh.pipeline=2", "micro_batch_size=8"],
                        world_size=2)


def test_chat_prompts_render_with_the_template_and_train_the_reply_through_its_end_of_turn(tmp_path: Path):
    """A messages prompt: the chosen row's ids equal transformers' apply_chat_template of the conversation with
    the reply, and the mask covers exactly the reply's tokens after the generation prompt (through <|eot_id|>)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ember.data import chat
    from ember.data.tokenizer import load_tokenizer

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    words = "system user assistant you add numbers what is 2 plus 3 ? 5 . 6 four".split()
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words + ["[UNK]"])},
                                                unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "chat_template": chat.BUILTIN_TEMPLATES["llama3"]}))
    prompt = [{"role": "system", "content": "you add numbers"}, {"role": "user", "content": "what is 2 plus 3 ?"}]
    rows = [{"prompt": prompt, "chosen": "5 .", "rejected": "6 ."}]
    ember_tok = load_tokenizer(str(tmp_path))
    samples = encode_pairs(rows, ember_tok, 48, "prompt", "chosen", "rejected", chat.load_template(None, ember_tok))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<|begin_of_text|>",
                                 eos_token="<|end_of_text|>")
    hf.chat_template = chat.BUILTIN_TEMPLATES["llama3"]
    for key, reply in (("chosen", "5 ."), ("rejected", "6 .")):
        whole = list(hf.apply_chat_template(prompt + [{"role": "assistant", "content": reply}], tokenize=True,
                                            return_dict=False))
        head = list(hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False))
        ids, mask = getattr(samples, key)[0], getattr(samples, f"{key}_mask")[0]
        assert ids[:len(whole)].tolist() == whole and whole[-1] == hf.convert_tokens_to_ids("<|eot_id|>")
        assert mask.tolist() == [0] * len(head) + [1] * (len(whole) - len(head)) + [0] * (49 - len(whole))
