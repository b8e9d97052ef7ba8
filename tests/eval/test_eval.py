"""Eval tasks equal an independent computation on a tiny model: each expected pick or log-probability here
comes from one full-sequence forward and log_softmax, written out in the test, not from ember.eval."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ember.config import DataConfig
from ember.data.tokenizer import BOS, Tokenizer, train_bpe
from ember.errors import ConfigError, DataError, UserFileNotFound
from ember.eval import boolq, choice, lambada, loglikelihood, ppl, rolling_logprob
from ember.eval.scoring import encode_pair
from tests.helpers import TINY_RUN, read_records, run_ember, tiny_llama, write_jsonl


class WordTokenizer:
    """One id per whitespace-separated word, assigned in order of first sight (ids from 2; EOS is 1)."""
    eos_id = 1

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.ids.setdefault(word, 2 + len(self.ids)) for word in text.split()]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        words = {i: w for w, i in self.ids.items()}
        return " ".join(words.get(i, "") for i in ids)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(128, family="llama3")


def _logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, from one forward of the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0]
    return F.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_encode_pair_moves_trailing_spaces_to_the_continuation():
    tok = WordTokenizer()
    assert encode_pair(tok, "a b ", "c") == (tok.encode("a b"), tok.encode("c"))


def test_lambada_equals_a_hand_computation(model, tmp_path: Path):
    tok = WordTokenizer()
    rng = torch.Generator().manual_seed(1)
    rows = [{"text": " ".join(f"w{int(i)}" for i in torch.randint(0, 40, (9,), generator=rng))} for _ in range(10)]
    expected_hits, expected_ll = 0, 0.0
    for row in rows:
        ids = tok.encode(row["text"])
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]]))[0, -1]
        expected_hits += int(logits.argmax()) == ids[-1]
        expected_ll += float(F.log_softmax(logits, -1)[ids[-1]])
    result = lambada(model, tok, write_jsonl(tmp_path / "l.jsonl", rows), batch_size=3)
    assert result["n"] == 10 and result["acc"] == expected_hits / 10
    assert result["perplexity"] == pytest.approx(math.exp(-expected_ll / 10), rel=1e-5)


def test_boolq_and_choice_equal_a_hand_computation(model, tmp_path: Path):
    tok = WordTokenizer()
    rows = [{"passage": f"p{i} q{i % 3}", "question": f"is q{i}", "answer": bool(i % 2)} for i in range(10)]
    correct = 0
    for row in rows:
        prompt = tok.encode(f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:")
        no, yes = (float(_logprobs(model, prompt + tok.encode(w))[-1]) for w in ("no", "yes"))
        correct += (yes > no) == row["answer"]
    assert boolq(model, tok, write_jsonl(tmp_path / "b.jsonl", rows))["acc"] == correct / 10
    rows = [{"context": f"c{i} d{i}", "choices": ["x", "longer y", f"z{i} z"], "label": i % 3} for i in range(10)]
    acc = acc_norm = 0
    for row in rows:
        ctx = tok.encode(row["context"])
        lls = [float(_logprobs(model, ctx + tok.encode(c))[-len(tok.encode(c)):].sum()) for c in row["choices"]]
        acc += max(range(3), key=lambda j: lls[j]) == row["label"]
        acc_norm += max(range(3), key=lambda j: lls[j] / len(" " + row["choices"][j])) == row["label"]
    result = choice(model, tok, write_jsonl(tmp_path / "c.jsonl", rows), batch_size=4)
    assert (result["acc"], result["acc_norm"], result["n"]) == (acc / 10, acc_norm / 10, 10)


def test_an_empty_context_is_scored_after_bos_or_eos(model, tmp_path: Path):
    """lm-eval's loglikelihood with an empty context: the continuation after the BOS token, or EOS where the
    tokenizer has no BOS."""
    tok = WordTokenizer()  # no BOS: EOS (1) is the context
    (score,) = loglikelihood(model, tok, [("", " x y")])
    assert score.n_tokens == 2
    assert score.logprob == pytest.approx(float(_logprobs(model, [1, *tok.encode("x y")]).sum()), rel=1e-5)
    with_bos = WordTokenizer()
    with_bos.bos_id = 0
    assert encode_pair(with_bos, "", " x y") == ([0], with_bos.encode("x y"))
    # lm-eval's prefix is the BOS transformers knows: a tokenizer.json's only when tokenizer_config.json names it.
    # The embedded BPE has <|begin_of_text|> but declares it nowhere (its HF export neither): EOS, as lm-eval's
    # hf model uses on that export; named in tokenizer_config.json: BOS.
    bpe = train_bpe(["import os and sys", "def main ( self ) : return"] * 4, 300)
    undeclared, declared = Tokenizer(bpe, "bpe"), Tokenizer(bpe, "bpe", {"bos_token": BOS})
    assert (undeclared.bos_id, undeclared.eos_id) == (0, 1)
    assert encode_pair(undeclared, "", " os") == ([1], undeclared.encode(" os"))
    assert encode_pair(declared, "", " os") == ([0], declared.encode(" os"))
    rows = [{"context": "", "choices": ["x", "longer y"], "label": 1}, {"context": "c d", "choices": ["x"], "label": 0}]
    lls = [float(_logprobs(model, [1, *tok.encode(c)])[-len(tok.encode(c)):].sum()) for c in rows[0]["choices"]]
    picked = max(range(2), key=lambda j: lls[j])
    picked_norm = max(range(2), key=lambda j: lls[j] / len(" " + rows[0]["choices"][j]))
    assert choice(model, tok, write_jsonl(tmp_path / "c.jsonl", rows)) == {
        "acc": ((picked == 1) + 1) / 2, "acc_norm": ((picked_norm == 1) + 1) / 2, "n": 2}


def test_rolling_windows_score_each_token_once(model):
    ids = torch.randint(2, 128, (50,), generator=torch.Generator().manual_seed(2)).tolist()
    full = _logprobs(model, ids)
    logprob, count = rolling_logprob(model, ids, window=64, stride=32)
    assert count == 49 and logprob == pytest.approx(float(full.sum()), rel=1e-5)
    # Windows of 20 every 20 tokens: window k is ids[20k : 20k + 20] predicting ids[20k + 1 .. 20k + 20], so each
    # token is scored once, with its own window's earlier tokens as context.
    expected = sum(float(_logprobs(model, ids[s:min(s + 21, 50)]).sum()) for s in (0, 20, 40))
    logprob, count = rolling_logprob(model, ids, window=20, stride=20, batch_size=2)
    assert count == 49 and logprob == pytest.approx(expected, rel=1e-5)
    # Overlapping windows (stride 10): window k scores ids[20 + 10(k-1) + 1 ..] with 10 more tokens of context.
    expected = float(_logprobs(model, ids[0:21]).sum()) + sum(
        float(_logprobs(model, ids[s:min(s + 21, 50)])[-10:].sum()) for s in (10, 20))
    tail_start = 30  # the last window ends at the sequence's end: ids[30:50] scores 41..49
    expected += float(_logprobs(model, ids[tail_start:50])[-9:].sum())
    logprob, count = rolling_logprob(model, ids, window=20, stride=10)
    assert count == 49 and logprob == pytest.approx(expected, rel=1e-5)


def test_loglikelihood_cuts_long_inputs_from_the_left(model):
    tok = WordTokenizer()
    context = " ".join(f"t{i}" for i in range(100))  # longer than max_seq_len=64
    (score,) = loglikelihood(model, tok, [(context, " end")])
    ids = tok.encode(context + " end")[-65:]
    assert score.logprob == pytest.approx(float(_logprobs(model, ids)[-1]), rel=1e-5) and score.n_tokens == 1


def test_ppl_split_all_scores_every_token_of_the_file(model, tmp_path: Path):
    tok = WordTokenizer()
    docs = ["a b c d e", "f g a b", "h i j k l m n"]
    data = DataConfig(dataset=write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs]))
    ids = [i for d in docs for i in tok.encode(d) + [tok.eos_id]]  # documents joined with EOS, as in training
    result = ppl(model, tok, data, split="all", seq_len=64)
    assert result["tokens"] == len(ids) - 1 == 18 and (result["seq_len"], result["stride"]) == (64, 32)
    assert (ppl(model, tok, data, split="all")["seq_len"], ppl(model, tok, data, split="all", stride=5)["stride"]) \
        == (64, 5)  # unset: the model's max_seq_len
    assert result["loss"] == pytest.approx(-float(_logprobs(model, ids).sum()) / 18, rel=1e-5)
    held_out = ppl(model, tok, data, split="val", seq_len=64)["tokens"]  # ember's validation share: one document
    assert held_out in (len(tok.encode(d)) for d in docs)
    with pytest.raises(ConfigError, match="data.val_fraction=0 holds out no validation split of '.*d.jsonl'; score "
                                          "all of it with eval.split=all"):
        ppl(model, tok, DataConfig(dataset=data.dataset, val_fraction=0.0), split="val")
    with pytest.raises(ConfigError, match="eval.split must be one of val, train, all, got 'test'"):
        ppl(model, tok, data, split="test")


def test_boolq_reads_answers_as_written(model, tmp_path: Path):
    """JSON booleans, and the strings true/false/yes/no in any case: read with bool(), every string would count
    as true (this seeded model says yes to all eight, so that reading would score 7/8)."""
    tok = WordTokenizer()
    answers = [True, False, "false", "No", "yes", "TRUE", "no", "FALSE"]
    truth = [True, False, False, False, True, True, False, False]
    rows = [{"passage": f"p{i} q{i % 3}", "question": f"is q{i}", "answer": a} for i, a in enumerate(answers)]
    correct = 0
    for row, expected in zip(rows, truth):
        prompt = tok.encode(f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:")
        no, yes = (float(_logprobs(model, prompt + tok.encode(w))[-1]) for w in ("no", "yes"))
        correct += (yes > no) == expected
    assert boolq(model, tok, write_jsonl(tmp_path / "b.jsonl", rows)) == {"acc": correct / 8, "n": 8}
    for answer in ["maybe", None, 1, ""]:
        bad = write_jsonl(tmp_path / "bad.jsonl", [rows[0], {**rows[1], "answer": answer}])
        with pytest.raises(DataError) as err:
            boolq(model, tok, bad)
        assert str(err.value) == (f"{bad} line 2: 'answer' must be true or false (a JSON boolean, or \"true\", "
                                  f'"false", "yes", "no"), got {json.dumps(answer)}')


def test_rows_of_the_wrong_type_name_their_line(model, tmp_path: Path):
    tok = WordTokenizer()
    for task, row, message in [
            (lambada, {"text": 5}, "'text' must be a string of a context and a last word (the target), got 5"),
            (lambada, {"text": "alone"}, "'text' must be a string of a context and a last word (the target)"),
            (boolq, {"passage": ["x"], "question": "q", "answer": True}, "'passage' must be a string, got [\"x\"]"),
            (choice, {"context": "c", "choices": ["a", 2], "label": 0},
             "'choices' must be a non-empty list of strings"),
            (choice, {"context": "c", "choices": ["a", "b"], "label": "1"}, "'label' must be an integer index into "
                                                                               'choices, got "1"'),
            (choice, {"context": "c", "choices": ["a", "b"], "label": 1.5}, "'label' must be an integer index"),
            (choice, {"context": "c", "choices": ["a", "b"], "label": True}, "'label' must be an integer index"),
            (choice, {"context": "c", "choices": ["a", "b"], "label": 2}, "'label' 2 is not an index into its 2 "
                                                                             "choices"),
            # choice scores context + " " + choice: a space the data adds beside it would be scored as a second one
            (choice, {"context": "c", "choices": ["a", " b"], "label": 0},
             "'choices' must be written without leading whitespace (one space is put between context and choice, "
             "as lm-eval's target_delimiter does), got [\"a\", \" b\"]"),
            (choice, {"context": "c", "choices": ["a", "\nb"], "label": 0}, "'choices' must be written without "
                                                                            "leading whitespace"),
            (choice, {"context": "c ", "choices": ["a", "b"], "label": 0},
             "'context' must not end with a space or tab (one space is put between context and choice, as lm-eval's "
             'target_delimiter does), got "c "')]:
        path = write_jsonl(tmp_path / "rows.jsonl", [row])
        with pytest.raises(DataError, match=f"^{re.escape(path)} line 1: {re.escape(message)}"):
            task(model, tok, path)


def test_limit_takes_the_first_rows_and_refuses_less_than_one(model, tmp_path: Path):
    tok = WordTokenizer()
    path = write_jsonl(tmp_path / "l.jsonl", [{"text": f"a{i} b{i} c{i}"} for i in range(3)])
    assert lambada(model, tok, path, limit=2)["n"] == 2 and lambada(model, tok, path)["n"] == 3
    assert lambada(model, tok, path, limit=5)["n"] == 3
    for limit in (0, -1):
        with pytest.raises(ConfigError, match=f"eval.limit must be an integer >= 1 \\(leave it unset to score every "
                                              f"row\\), got {limit}"):
            lambada(model, tok, path, limit=limit)
    for batch_size in (0, -2):
        with pytest.raises(ConfigError, match=f"eval.batch_size must be an integer >= 1, got {batch_size}"):
            lambada(model, tok, path, batch_size=batch_size)
        with pytest.raises(ConfigError, match=f"eval.batch_size must be an integer >= 1, got {batch_size}"):
            rolling_logprob(model, list(range(2, 20)), 8, 4, batch_size)


@pytest.mark.slow
def test_cli_writes_eval_json_and_refuses_bad_input(tmp_path: Path):
    run = tmp_path / "run"
    proc = run_ember("train", "debug", *TINY_RUN, "max_steps=2", f"output_dir={run}")
    assert proc.returncode == 0, proc.stderr
    data = write_jsonl(tmp_path / "l.jsonl", [{"text": "import os and sys"}, {"text": "def main ( self"}])
    proc = run_ember("eval", str(run), "ppl", f"lambada={data}", "eval.max_tokens=300")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((run / "checkpoints" / "step-2" / "eval.json").read_text())
    assert report["model"] == str(run) and report["step"] == 2
    assert set(report["results"]["ppl"]) == {"loss", "perplexity", "bits_per_byte", "tokens", "seq_len", "stride",
                                             "data", "split"}
    assert (report["results"]["ppl"]["data"], report["results"]["ppl"]["split"]) == ("embedded", "val")
    assert report["results"]["ppl"]["perplexity"] == pytest.approx(math.exp(report["results"]["ppl"]["loss"]))
    assert report["results"]["lambada"]["data"] == str(Path(data).resolve())
    assert set(report["results"]["lambada"]) == {"acc", "perplexity", "n", "data"}
    assert report["results"]["lambada"]["n"] == 2
    empty, latin = tmp_path / "empty.jsonl", tmp_path / "latin.jsonl"
    empty.write_text("")
    latin.write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    missing = write_jsonl(tmp_path / "m.jsonl", [{"passage": "x", "question": "y"}])
    for args, message in [(["hellaswag"], "unknown eval task or key 'hellaswag'"),
                          ([f"boolq={missing}"], "line 1 has no 'answer' field"),
                          ([f"lambada={empty}"], "is empty"),
                          ([f"lambada={latin}"], "is not UTF-8 text"),
                          ([f"lambada={tmp_path / 'nope.jsonl'}"], "does not exist")]:
        proc = run_ember("eval", str(run), *args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, (args, proc.stderr)
    proc = run_ember("eval", str(tmp_path), "ppl")
    assert proc.returncode == 2 and "holds no model" in proc.stderr


@pytest.mark.slow
def test_in_loop_eval_logs_the_tasks_and_equals_ember_eval(tmp_path: Path):
    lam = write_jsonl(tmp_path / "l.jsonl", [{"text": "import os and sys"}, {"text": "def main ( self"},
                                             {"text": "return None if x"}])
    bq = write_jsonl(tmp_path / "b.jsonl", [{"passage": "import os", "question": "is it python", "answer": True},
                                            {"passage": "a b c", "question": "is it python", "answer": False}])
    run = tmp_path / "run"
    proc = run_ember("train", "debug", *TINY_RUN, "max_steps=4", "eval_interval=2", f"output_dir={run}",
                     f"eval.tasks=[{{name: lambada, data: {lam}}}, {{name: boolq, data: {bq}}}]")
    assert proc.returncode == 0, proc.stderr
    logged = {r["step"]: r for r in read_records(run) if "eval/lambada/acc" in r}
    assert sorted(logged) == [2, 4] and logged[4]["eval/boolq/n"] == 2 and "val_loss" in logged[4]
    proc = run_ember("eval", str(run), f"lambada={lam}", f"boolq={bq}", "--output", str(tmp_path / "e.json"))
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "e.json").read_text())["results"]
    assert logged[4]["eval/lambada/perplexity"] == pytest.approx(results["lambada"]["perplexity"], rel=1e-5)
    assert logged[4]["eval/boolq/acc"] == results["boolq"]["acc"]


def test_in_loop_eval_config_errors(tmp_path: Path):
    from ember.config import ConfigError
    from ember.train import run as run_lib

    for tasks in ("[{name: mmlu, data: x.jsonl}]", "[{name:mmlu,data:x.jsonl}]", "[{name:mmlu, data:x.jsonl}]"):
        # YAML's spaced `key: value` and the tight `key:value` a shell user types read the same
        with pytest.raises(ConfigError, match=r"eval.tasks\[0\].name 'mmlu' is not one of lambada, boolq, choice"):
            run_lib.load_config("debug", [f"eval.tasks={tasks}"])
    # a value's colons kept
    with pytest.raises(UserFileNotFound, match=r"eval.tasks\[0\].data memory://ember-absent/x.jsonl.* does not exist"):
        run_lib.load_config("debug", ["eval.tasks=[{name:boolq,data:memory://ember-absent/x.jsonl}]"])
    with pytest.raises(ConfigError, match=r"eval.tasks\[0\].data '.*nope.jsonl' is not a file"):
        run_lib.load_config("debug", [f"eval.tasks=[{{name: boolq, data: {tmp_path / 'nope.jsonl'}}}]"])
    bad = write_jsonl(tmp_path / "b.jsonl", [{"passage": "p", "question": "q", "answer": "maybe"}])
    with pytest.raises(DataError, match=r"b.jsonl line 1: 'answer' must be true or false"):  # rows read at config time
        run_lib.load_config("debug", [f"eval.tasks=[{{name: boolq, data: {bad}}}]"])
    for key, value, message in [("limit", -1, r"eval.limit must be >= 1 \(null: every row\), got -1"),
                                ("limit", 0, r"eval.limit must be >= 1 \(null: every row\), got 0"),
                                ("batch_size", 0, "eval.batch_size must be >= 1, got 0")]:
        with pytest.raises(ConfigError, match=message):
            run_lib.load_config("debug", [f"eval.{key}={value}"])
    data = write_jsonl(tmp_path / "l.jsonl", [{"text": "a b"}])
    other = write_jsonl(tmp_path / "m.jsonl", [{"text": "c d"}])
    with pytest.raises(ConfigError, match=r"eval.tasks\[1\] is a second lambada task \(eval.tasks\[0\] is one\): its "
                                          r"eval/lambada/\* results would overwrite the first's"):
        run_lib.load_config("debug", [f"eval.tasks=[{{name: lambada, data: {data}}}, "
                                      f"{{name: lambada, data: {other}}}]"])
    with pytest.raises(ConfigError, match="use `ember eval` on the checkpoint for tensor"):
        run_lib.load_config("debug", [f"eval.tasks=[{{name: lambada, data: {data}}}]", "ici_mesh.tensor=2",
                                  "micro_batch_size=8"], world_size=2)


def test_an_unreachable_hub_is_one_line_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capfd: pytest.CaptureFixture):
    """Without HF_HUB_OFFLINE and with no network (an endpoint that refuses connections), a hub task is read from
    the local cache only (an empty one here): one error, and none of the hub client's retry lines (capfd: its log
    handler writes to the process's stderr)."""
    import datasets
    from huggingface_hub import constants

    from ember.eval.tasks import TASK_ROWS

    for module, name in ((constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
                         (datasets.config, "HF_DATASETS_OFFLINE")):
        monkeypatch.setattr(module, name, False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(DataError) as err:
        TASK_ROWS["lambada"]("lambada")
    assert str(err.value) == ("cannot load lambada data 'EleutherAI/lambada_openai' from the Hugging Face hub: "
                              "http://127.0.0.1:9 cannot be reached (Connection refused) and it is not in the local "
                              "cache; give a local jsonl file (lambada=FILE.jsonl)")
    assert capfd.readouterr() == ("", "")
    assert constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False  # offline for the call only


def test_plain_ppl_of_a_model_that_is_not_a_run_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture):
    """An HF directory (or a torch file) has no run config.yaml to take ppl's data from: ppl alone is refused
    before the model loads (a config.json stands for the directory here), never scored on a default corpus."""
    from ember import cli

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (tmp_path / "m.pt").write_bytes(b"")
    for path in (hf, tmp_path / "m.pt"):
        assert cli.main(["eval", str(path), "ppl", "eval.max_tokens=40"]) == 2
        assert capsys.readouterr() == ("", f"error: plain ppl scores an ember run's own data (its config.yaml), and "
                                           f"'{path}' is not an ember run; name the text to score: ppl=DATA (a file, "
                                           "folder, glob or hub dataset) or data.dataset=DATA\n")
