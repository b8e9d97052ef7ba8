"""`ember eval RUN gen=FILE`: greedy completions scored by the reward functions. Each expected completion here comes
from a plain greedy loop of full-sequence forwards written out in the test (no KV cache, no batching, no padding),
and each accuracy from counting the rows whose answer that completion matches; every bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pytest
import torch
import yaml

from ember import cli
from ember.config_schema import DataConfig
from ember.errors import ConfigError, DataError
from ember.eval import generative
from ember.eval.generative import GenOptions
from ember.finetune.grpo_rewards import RewardError
from tests.helpers import TINY_RUN, IdTokenizer, run_ember, tiny_llama, write_jsonl

VOCAB = 48


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(VOCAB)


def _greedy(model: torch.nn.Module, tokenizer, ids: list[int], max_new: int, stop: Sequence[str] = ()
            ) -> tuple[str, int, str]:
    """(completion text, tokens generated, why it stopped), one full forward per token."""
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            token = int(model(torch.tensor([ids + out]))[0, -1].argmax())
        if token == tokenizer.eos_id:
            return tokenizer.decode(out), len(out), "eos"
        out.append(token)
        text = tokenizer.decode(out)
        hit = next((s for s in stop if s in text), None)
        if hit is not None:
            return text[:text.index(hit)], -1, "stop"  # (the tokens kept are generate's to trim)
    return tokenizer.decode(out), len(out), "length"


def _prompts(n: int, seed: int = 0) -> list[str]:
    """Prompts of 1-9 token ids (different lengths: batches are padded), none the EOS id 1."""
    rng = torch.Generator().manual_seed(seed)
    return [" ".join(str(int(t)) for t in torch.randint(2, VOCAB, (int(torch.randint(1, 10, (1,), generator=rng)),),
                                                          generator=rng)) for _ in range(n)]


def _run_gen(model, path: str, options: GenOptions, batch_size: int, limit=None) -> generative.GenResult:
    tok = IdTokenizer()
    rows = generative.read_rows(path, options, limit)
    prompts = generative.encode_prompts(rows, tok, DataConfig(), options, model.args.max_seq_len)
    return generative.evaluate(model, tok, prompts, options, batch_size)


def test_accuracy_is_the_fraction_of_rows_whose_greedy_completion_matches(model, tmp_path: Path):
    tok = IdTokenizer()
    texts = _prompts(11)
    expected = [_greedy(model, tok, tok.encode(t), 5) for t in texts]
    # every third row's answer is its completion (the ids, as exact normalizes them), the others a wrong one
    rows = [{"prompt": t, "answer": e[0].strip() if i % 3 == 0 else "99 99"} for i, (t, e) in
            enumerate(zip(texts, expected))]
    rows[4]["answer"] = expected[4][0].upper() + " ."  # exact is case- and final-period-blind: a match too
    right = sum(1 for i in range(11) if i % 3 == 0 or i == 4)
    result = _run_gen(model, write_jsonl(tmp_path / "g.jsonl", rows), GenOptions(max_new_tokens=5), batch_size=3)
    assert [(r["completion"], r["tokens"], r["stop_reason"]) for r in result.records] == expected
    assert result.metrics == {"exact": right / 11, "n": 11, "completion_tokens": sum(e[1] for e in expected) / 11,
                              "truncated": sum(e[2] == "length" for e in expected) / 11, "max_new_tokens": 5}
    assert [r["rewards"] for r in result.records] == [{"exact": float(i % 3 == 0 or i == 4)} for i in range(11)]
    assert [r["where"] for r in result.records] == [f"{tmp_path / 'g.jsonl'} line {i}" for i in range(1, 12)]
    # eval.limit: the first N rows
    limited = _run_gen(model, str(tmp_path / "g.jsonl"), GenOptions(max_new_tokens=5), batch_size=16, limit=4)
    assert limited.metrics["n"] == 4 and limited.metrics["exact"] == 2 / 4


def test_stop_strings_cut_the_completion(model, tmp_path: Path):
    tok = IdTokenizer()
    texts = _prompts(6, seed=1)
    free = [_greedy(model, tok, tok.encode(t), 6) for t in texts]
    stop = free[0][0].split()[1]  # a token the first row generates second: text from it on is cut
    stop = f" {stop} "[:-1]  # " N": also cuts a longer id starting with N, as generate's substring match does
    expected = [_greedy(model, tok, tok.encode(t), 6, [stop]) for t in texts]
    assert expected[0][2] == "stop"
    rows = [{"prompt": t, "answer": e[0].strip()} for t, e in zip(texts, expected)]
    result = _run_gen(model, write_jsonl(tmp_path / "g.jsonl", rows), GenOptions(max_new_tokens=6, stop=[stop]), 4)
    assert [(r["completion"], r["stop_reason"]) for r in result.records] == [(e[0], e[2]) for e in expected]
    assert result.metrics["exact"] == 1.0 and result.metrics["stop"] == [stop]


def test_several_rewards_their_weights_and_errors(model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A module:function reward beside exact: each reward's mean, and `reward` the weighted sum's; a reward that
    raises is one line naming it and the row, or with reward_errors=zero scored 0 and counted."""
    (tmp_path / "gen_eval_rewards.py").write_text(
        "def length(prompt, completion, row):\n    return len(completion.split()) / 10\n"
        "def picky(prompt, completion, row):\n    if row['answer'] == 'boom':\n        raise KeyError('x')\n"
        "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = IdTokenizer()
    texts = _prompts(5, seed=2)
    expected = [_greedy(model, tok, tok.encode(t), 4) for t in texts]
    rows = [{"prompt": t, "answer": e[0].strip() if i < 2 else "boom"} for i, (t, e) in enumerate(zip(texts, expected))]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    options = GenOptions(rewards=["exact", "gen_eval_rewards:length"], reward_weights=[1.0, 0.5], max_new_tokens=4)
    metrics = _run_gen(model, path, options, 2).metrics
    lengths = [len(e[0].split()) / 10 for e in expected]
    assert metrics["exact"] == 2 / 5 and metrics["gen_eval_rewards:length"] == pytest.approx(sum(lengths) / 5)
    assert metrics["reward"] == pytest.approx((2 + 0.5 * sum(lengths)) / 5)
    options = GenOptions(rewards=["gen_eval_rewards:picky"], max_new_tokens=4)
    with pytest.raises(RewardError) as err:
        _run_gen(model, path, options, 2)
    assert str(err.value) == (f"reward gen_eval_rewards:picky failed on {path} line 3: KeyError: 'x' "
                              "(gen.reward_errors=zero scores such a completion 0)")
    options.reward_errors = "zero"
    metrics = _run_gen(model, path, options, 2).metrics
    assert metrics["gen_eval_rewards:picky"] == 2 / 5 and metrics["reward_errors/gen_eval_rewards:picky"] == 3


def test_a_prompt_that_leaves_no_room_is_named_by_its_line(model, tmp_path: Path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "2 3", "answer": "x"}, {"prompt": " ".join(["5"] * 40),
                                                                               "answer": "y"}])
    with pytest.raises(DataError) as err:
        _run_gen(model, path, GenOptions(max_new_tokens=30), 2)
    assert str(err.value) == (f"{path} line 2: the prompt is 40 tokens, and with gen.max_new_tokens=30 that passes "
                              "the model's max_seq_len=64; lower gen.max_new_tokens or shorten the prompt")


def _error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """`ember eval ARGV`'s stderr, asserted to be one line with exit code 2 and nothing on stdout."""
    assert cli.main(["eval", *argv]) == 2, argv
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (argv, out, err)
    return err.removeprefix("error: ").removesuffix("\n")


def test_bad_input_is_one_line_before_the_model_loads(tmp_path: Path, capsys: pytest.CaptureFixture):
    """The run here is no model: each mistake is found before one would load."""
    run = str(tmp_path / "run")
    good = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "a", "answer": "1"}])
    no_prompt = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}])
    no_answer = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    (tmp_path / "g.txt").write_text("a\n")
    for args, message in (
            ([f"gen={tmp_path / 'nope.jsonl'}"], f"gen data '{tmp_path / 'nope.jsonl'}' does not exist; give a .jsonl, "
                                                 ".json or .parquet file of prompts, or reasoning_gym:NAME"),
            ([f"gen={tmp_path / 'g.txt'}"], f"gen data '{tmp_path / 'g.txt'}' is not a .jsonl, .json or .parquet "
                                            "file of prompts"),
            ([f"gen={no_prompt}"], f"{no_prompt} line 2: no 'prompt' (text or messages) or 'messages' to start a "
                                   "completion from; set gen.prompt_field to the row's prompt column"),
            ([f"gen={no_answer}"], f"{no_answer} line 2: no 'answer', which the exact reward reads"),
            ([f"gen={no_answer}", "gen.rewards=[math]"], f"{no_answer} line 2: no 'answer', which the math reward "
                                                         "reads"),
            ([f"gen={good}", "gen.rewards=exat"], "reward 'exat': choose one of exact, math, format, or give "
                                                  "module:function"),
            ([f"gen={good}", "gen.rewards=[exact,no_such_module:f]"],
             "reward 'no_such_module:f': cannot import no_such_module (ModuleNotFoundError: No module named "
             "'no_such_module'); put it on PYTHONPATH"),
            ([f"gen={good}", "gen.rewards=format"], "the format reward needs gen.format_pattern (a regular "
                                                    "expression the whole completion must match)"),
            ([f"gen={good}", "gen.reward_weights=[1,2]"], "gen.reward_weights has 2 values for 1 gen.rewards; give "
                                                          "one weight per reward"),
            ([f"gen={good}", "gen.max_new_tokens=0"], "gen.max_new_tokens must be > 0, got 0"),
            ([f"gen={good}", "gen.stop=['']"], "gen.stop holds an empty string, which would end every completion "
                                               "before its first token; give the text to stop at"),
            ([f"gen={good}", "gen.max_new_tokns=3"], "unknown config key 'gen.max_new_tokns' (did you mean "
                                                     "'gen.max_new_tokens'?) for ember eval (keys: eval.limit, "
                                                     "eval.batch_size, eval.seq_len, eval.stride, eval.max_tokens, "
                                                     "eval.split, data.*, gen.*)"),
            ([f"gen={good}", "gen.max_new_tokens=many"], "bad value for config key 'gen.max_new_tokens': got 'many' "
                                                         "(expected int)"),
            ([f"gen={good}", "data.dataset=x.jsonl"], "data.dataset is a key of ppl, and no ppl task is given; gen "
                                                      "reads data.chat_template only"),
            ([f"gen={good}", "data.chat_template=chatm"], "data.chat_template 'chatm' is not one of auto, llama3, "
                                                          "chatml"),
            (["ppl", "data.dataset=x.jsonl", "gen.stop=[x]"], "gen.stop is a key of gen, and no gen task is given "
                                                              "(gen=FILE)"),
            (["gen"], "'gen' names no data; give gen=FILE (.jsonl, .json or .parquet rows of prompts) or "
                      "gen=reasoning_gym:NAME"),
            ([f"gen={good}", f"gen={good}"], f"gen is given twice ({good}, {good})")):
        assert _error(capsys, run, *args).startswith(message), args
    # (reasoning-gym's own words for an unknown generator follow; the line names it)
    unknown = _error(capsys, run, "gen=reasoning_gym:no_such_task")
    assert "reasoning-gym" in unknown and "'no_such_task'" in unknown


def test_a_grpo_runs_keys_are_gens_defaults_and_its_rows_stay_held_out(tmp_path: Path, capsys):
    """A GRPO run's max_new_tokens, stop, prompt_field and format_pattern are gen's defaults (the keys override
    them); reasoning_gym rows that overlap the ones the run trained on are refused."""
    from ember.commands.eval import parse

    run = tmp_path / "run"
    run.mkdir()
    gym = "reasoning_gym:basic_arithmetic"
    (run / "config.yaml").write_text(yaml.safe_dump({
        "task": "grpo", "seed": 3, "data": {"dataset": gym, "chat_template": "chatml"},
        "grpo": {"max_new_tokens": 12, "stop": ["\n"], "prompt_field": "question", "format_pattern": "x+",
                 "gym_size": 500}}))
    args = parse([str(run), "gen=g.jsonl", "gen.stop=END", "gen.rewards=math"])
    assert (args.gen.max_new_tokens, args.gen.stop, args.gen.prompt_field, args.gen.format_pattern,
            args.gen.rewards, args.data.chat_template) == (12, ["END"], "question", "x+", ["math"], "chatml")
    assert parse([str(run), f"gen={gym}"]).gen.seed == generative.GYM_SEED  # far past the run's rows 3..502
    with pytest.raises(ConfigError) as err:
        parse([str(run), f"gen={gym}", "gen.seed=400", "gen.gym_size=200"])
    assert str(err.value) == (f"gen.seed=400 draws rows 400..599 of {gym}, and the run trained on its rows 3..502 "
                              "(seed 3, grpo.gym_size=500); a held-out eval needs gen.seed >= 503")
    assert parse([str(run), f"gen={gym}", "gen.seed=503"]).gen.seed == 503
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "lm", "grpo": {"max_new_tokens": 12}}))
    assert parse([str(run), "gen=g.jsonl"]).gen == GenOptions()  # another task's grpo section is no default


# ---------------------------------------------------------------- through the CLI, on a trained run
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gen-command")
    proc = run_ember("train", "debug", *TINY_RUN, "max_steps=2", f"output_dir={root / 'run'}")
    assert proc.returncode == 0, proc.stderr
    return root / "run"


def _expected(run: Path, texts: list[str], max_new: int) -> list[tuple[str, int, str]]:
    from ember.generate import tokenizer_for
    from ember.model_io.load import load_model

    model, tok = load_model(run).eval(), tokenizer_for(str(run))
    return [_greedy(model, tok, tok.encode(t), max_new) for t in texts]


@pytest.mark.slow
def test_ember_eval_gen_writes_eval_json_and_the_completions(trained: Path, tmp_path: Path):
    texts = ["def main(", "import os", "class A:", "for i in", "return x", "while True"]
    expected = _expected(trained, texts, 6)
    rows = [{"prompt": t, "answer": e[0] if i % 2 else "not it"} for i, (t, e) in enumerate(zip(texts, expected))]
    data = write_jsonl(tmp_path / "g.jsonl", rows)
    lam = write_jsonl(tmp_path / "l.jsonl", [{"text": "import os and sys"}])
    out, completions = tmp_path / "eval.json", tmp_path / "out" / "c.jsonl"
    run_ember("eval", str(trained), f"lambada={lam}", "--output", str(out), expect=0)
    proc = run_ember("eval", str(trained), f"gen={data}", "gen.max_new_tokens=6", "eval.batch_size=4",
                     f"gen.completions={completions}", "--output", str(out), expect=0)
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["lambada", "gen"]  # merged as every task is
    assert results["gen"] == {"exact": 3 / 6, "n": 6, "completion_tokens": sum(e[1] for e in expected) / 6,
                              "truncated": sum(e[2] == "length" for e in expected) / 6, "max_new_tokens": 6,
                              "data": data}
    written = [json.loads(line) for line in completions.read_text().splitlines()]
    assert [(r["prompt"], r["completion"], r["answer"], r["rewards"]) for r in written] == [
        (t, e[0], row["answer"], {"exact": float(i % 2)}) for i, (t, e, row) in enumerate(zip(texts, expected, rows))]
    assert f"wrote 6 completions to {completions}" in proc.stdout and "gen             exact 0.5000" in proc.stdout


@pytest.mark.slow
def test_gen_on_two_fsdp_ranks_equals_one_process(trained: Path, tmp_path: Path):
    """5 rows in batches of 2 over 2 data ranks: one rank has a batch fewer and decodes idly with the other."""
    rows = [{"prompt": t, "answer": "x"} for t in ["def f(", "import", "class B", "x = 1", "if not"]]
    data = write_jsonl(tmp_path / "g.jsonl", rows)
    for name, extra in (("one", []), ("two", ["--nproc-per-node", "2"])):
        run_ember("eval", *extra, str(trained), f"gen={data}", "gen.max_new_tokens=5", "eval.batch_size=2",
                  *(["ici_mesh.fsdp=2"] if extra else []), f"gen.completions={tmp_path / name}.jsonl", "--output",
                  str(tmp_path / f"{name}.json"), expect=0)
    one, two = ((tmp_path / f"{n}.jsonl").read_text() for n in ("one", "two"))
    assert one == two and len(one.splitlines()) == 5
    assert (json.loads((tmp_path / "one.json").read_text())["results"]
            == json.loads((tmp_path / "two.json").read_text())["results"])


@pytest.mark.slow
def test_chat_prompts_are_rendered_with_the_template_and_its_generation_prompt(trained: Path, tmp_path: Path):
    from ember.finetune.grpo import prompt_encoder
    from ember.generate import tokenizer_for
    from ember.model_io.load import load_model

    rows = [{"messages": [{"role": "user", "content": "def main("}], "answer": "x"},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "import"}],
             "answer": "y"}]
    model, tok = load_model(trained).eval(), tokenizer_for(str(trained))
    encode = prompt_encoder(DataConfig(chat_template="chatml"), tok, "prompt")
    expected = [_greedy(model, tok, encode(row), 4) for row in rows]
    rows[1]["answer"] = expected[1][0]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    completions = tmp_path / "c.jsonl"
    run_ember("eval", str(trained), f"gen={data}", "gen.max_new_tokens=4", "data.chat_template=chatml",
              f"gen.completions={completions}", "--output", str(tmp_path / "e.json"), expect=0)
    written = [json.loads(line) for line in completions.read_text().splitlines()]
    assert [r["completion"] for r in written] == [e[0] for e in expected]
    assert written[1]["prompt"] == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nimport<|im_end|>\n" \
                                   "<|im_start|>assistant\n"
    assert json.loads((tmp_path / "e.json").read_text())["results"]["gen"]["exact"] == 1 / 2
    # the embedded tokenizer has no folder, so no template of its own: said naming the row, before any generation
    proc = run_ember("eval", str(trained), f"gen={data}", "gen.max_new_tokens=4", "--output", str(tmp_path / "f.json"))
    assert proc.returncode == 2 and proc.stderr == (
        f"error: {data} line 1: the tokenizer (embedded byte-level BPE) has no folder to read a chat template from; "
        "set data.chat_template to a built-in (llama3, chatml) or data.tokenizer\n")
