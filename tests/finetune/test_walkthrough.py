"""Issue 15's user story end to end, on a tiny Llama: an HF folder (weights, tokenizer, chat template) ->
chat SFT with LoRA by the llama3.2-1b-sft recipe -> merged back to an HF folder that transformers loads with
ember's logits and its tokenizer -> DPO with LoRA from that folder -> a peft adapter that peft loads with
ember's logits."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.helpers import read_records, run_ember

# Five training and conversion subprocesses end to end.
pytestmark = pytest.mark.slow

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "[UNK]"]
WORDS = ["system", "user", "assistant", "what", "is", "plus", "?", ".", "good", "bad"] + [str(i) for i in range(20)]


def _hf_folder(folder: Path) -> Path:
    """A 2-layer Llama saved by transformers, with a word-level tokenizer and Llama 3's chat template."""
    import tokenizers
    from tokenizers import models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    from ember.data.chat import BUILTIN_TEMPLATES

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "chat_template": BUILTIN_TEMPLATES["llama3"]}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, rope_theta=500000.0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


SMALL = ["seq_len=64", "global_batch_size=8", "micro_batch_size=8", "max_steps=25", "logging_steps=1",
         "eval_interval=0", "checkpoint.interval=0", "eval_batches=1", "schedule.warmup_steps=2",
         "metrics.console=false", "lora.rank=8", "lora.alpha=16"]


def test_hf_folder_to_sft_lora_to_hf_to_dpo_lora_to_peft(tmp_path: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ember.model_io.load import load_model

    base = _hf_folder(tmp_path / "Llama-tiny")
    rng = random.Random(0)
    chats, prefs = tmp_path / "chat.jsonl", tmp_path / "prefs.jsonl"
    with chats.open("w") as f, prefs.open("w") as g:
        for _ in range(120):
            a, b = rng.randrange(10), rng.randrange(10)
            question = [{"role": "system", "content": "good"}, {"role": "user", "content": f"what is {a} plus {b} ?"}]
            f.write(json.dumps({"messages": question + [{"role": "assistant", "content": f"{a + b} ."}]}) + "\n")
            g.write(json.dumps({"prompt": question, "chosen": f"{a + b} .", "rejected": "bad ."}) + "\n")

    # 1. Chat SFT with LoRA, one command from the HF folder (the recipe reads its weights and tokenizer)
    sft = tmp_path / "sft"
    run_ember("train", "llama3.2-1b-sft", f"model.init_from={base}", f"data.dataset={chats}", "optim.lr=1e-2",
              f"output_dir={sft}", *SMALL, expect=0)
    losses = [r["loss"] for r in read_records(sft) if "loss" in r]
    assert losses[-1] < losses[0] - 0.5  # the assistant tokens' loss (4.2 -> 3.3 here)

    # 2. Back to Hugging Face: a whole model (W + alpha/r B A) with the tokenizer beside it
    merged = tmp_path / "sft-hf"
    run_ember("convert", str(sft), str(merged), "--merge", expect=0)
    hf = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 plus 3 ?"}], add_generation_prompt=True,
                                        return_dict=False)
    ids = torch.tensor([list(ids)])
    with torch.no_grad():
        ember_logits = load_model(sft)(ids)
        assert torch.allclose(hf(ids).logits, ember_logits, atol=1e-4)

    # 3. DPO with LoRA from the merged folder (its reference: the same folder, adapters off)
    dpo = tmp_path / "dpo"
    run_ember("train", "llama3.2-1b-sft", "task=dpo", f"model.init_from={merged}", f"data.dataset={prefs}",
              "optim.lr=5e-3", "data.val_fraction=0.1", f"output_dir={dpo}", *SMALL, expect=0)
    steps = [r for r in read_records(dpo) if "dpo/accuracy" in r]
    assert abs(steps[0]["loss"] - 0.693147) < 1e-5 and steps[0]["dpo/reward_margin"] == 0
    # the policy learns to prefer the answer over "bad" (margin 0.23 in fp32, 0.21 with the base in bf16)
    assert steps[-1]["dpo/accuracy"] == 1.0 and steps[-1]["dpo/reward_margin"] > 0.1

    # 4. The DPO adapters as peft's, on the merged SFT folder
    adapter = tmp_path / "dpo-adapter"
    run_ember("convert", str(dpo), str(adapter), "--to", "peft", expect=0)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32),
                                           str(adapter)).eval()
    with torch.no_grad():
        dpo_logits = load_model(dpo)(ids)
        assert torch.allclose(peft_model(ids).logits, dpo_logits, atol=1e-4)

    # 5. sft-hf/ is the DPO run's base. Merging into it again is refused (not empty); with --overwrite the same
    #    merge writes the same bytes, and the DPO run loads as before (its base's fingerprint is its content)
    proc = run_ember("convert", str(sft), str(merged), "--merge")
    assert (proc.returncode, proc.stderr) == (2, f"error: '{merged}' is not empty; give --overwrite to replace what "
                                                 "it holds, or write to a new directory\n")
    run_ember("convert", str(sft), str(merged), "--merge", "--overwrite", expect=0)
    with torch.no_grad():
        assert torch.equal(load_model(dpo)(ids), dpo_logits)
    # ... but other weights there (another tool's re-export) and the DPO run refuses to load, naming its base
    hf.model.norm.weight.data.mul_(1.01)
    hf.save_pretrained(str(merged))
    proc = run_ember("generate", str(dpo), "--prompt", "what")
    step = dpo / "checkpoints" / "step-25"
    assert (proc.returncode, proc.stderr) == (2, (
        f"error: '{step}' holds LoRA adapters trained on the base '{merged}', which has changed since "
        '(config.json, model.safetensors changed); put that base back there, or point "base" in its model.json '
        "at a copy of it: adapters fit only the weights they were trained on\n"))
