"""`ember eval`'s command line: what each TASK=DATA scores, eval.json merged per task, and one-line errors for bad
values, all through the CLI on one tiny trained run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import TINY_RUN, run_ember, write_jsonl

# Every test here runs `ember eval` on a run trained in a subprocess.
pytestmark = pytest.mark.slow

TEXTS = ["import os and sys are modules", "def main ( self ) : return None", "for i in range ( 10 ) : print ( i )"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval-command")
    proc = run_ember("train", "debug", *TINY_RUN, "max_steps=2", f"output_dir={root / 'run'}")
    assert proc.returncode == 0, proc.stderr
    write_jsonl(root / "texts.jsonl", [{"text": t} for t in TEXTS])
    return root / "run"


def _results(path: Path) -> dict:
    return json.loads(path.read_text())["results"]


def test_ppl_equals_data_scores_all_of_the_data(run: Path, tmp_path: Path):
    from ember.generate import tokenizer_for

    texts = run.parent / "texts.jsonl"
    tokenizer = tokenizer_for(str(run))
    every_token = sum(len(tokenizer.encode(t)) + 1 for t in TEXTS) - 1  # joined with EOS; the first is context only
    proc = run_ember("eval", str(run), f"ppl={texts}", "--output", str(tmp_path / "a.json"))
    assert proc.returncode == 0, proc.stderr
    whole = _results(tmp_path / "a.json")["ppl"]
    assert (whole["tokens"], whole["split"], whole["data"]) == (every_token, "all", str(texts))
    # the window says how the numbers were made: the run's training seq_len, half of it as the stride
    assert (whole["seq_len"], whole["stride"]) == (32, 16) and "seq_len 32  stride 16" in proc.stdout
    # the same as naming the source with data.dataset and the split explicitly
    proc = run_ember("eval", str(run), "ppl", f"data.dataset={texts}", "eval.split=all", "--output",
                     str(tmp_path / "b.json"))
    assert proc.returncode == 0, proc.stderr
    assert _results(tmp_path / "b.json")["ppl"] == whole
    # plain ppl: the run's own source, its validation split
    proc = run_ember("eval", str(run), "ppl", "eval.max_tokens=50", "--output", str(tmp_path / "c.json"))
    assert proc.returncode == 0, proc.stderr
    val = _results(tmp_path / "c.json")["ppl"]
    assert (val["tokens"], val["split"], val["data"]) == (50, "val", "embedded")


def test_eval_json_merges_per_task_and_records_the_data(run: Path, tmp_path: Path):
    lam = write_jsonl(tmp_path / "l.jsonl", [{"text": t} for t in TEXTS])
    lam2 = write_jsonl(tmp_path / "l2.jsonl", [{"text": t} for t in TEXTS[:2]])
    bq = write_jsonl(tmp_path / "b.jsonl", [{"passage": "import os", "question": "is it python", "answer": True}])
    eval_json = run / "checkpoints" / "step-2" / "eval.json"
    eval_json.unlink(missing_ok=True)
    for tasks in ([f"lambada={lam}"], [f"boolq={bq}"]):
        proc = run_ember("eval", str(run), *tasks)
        assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"wrote {eval_json} (kept the earlier lambada)"
    results = _results(eval_json)
    assert list(results) == ["lambada", "boolq"]
    assert (results["lambada"]["n"], results["lambada"]["data"]) == (3, lam)
    assert (results["boolq"]["n"], results["boolq"]["data"]) == (1, bq)
    # a re-run task replaces its own entry, with the data it used; the checkpoint directory names the same model
    proc = run_ember("eval", str(eval_json.parent), f"lambada={lam2}")
    assert proc.returncode == 0, proc.stderr
    merged = _results(eval_json)
    assert (merged["lambada"]["n"], merged["lambada"]["data"]) == (2, lam2) and merged["boolq"] == results["boolq"]
    assert json.loads(eval_json.read_text())["model"] == str(eval_json.parent)


def test_bad_values_are_one_line_and_lose_nothing(run: Path, tmp_path: Path):
    texts = run.parent / "texts.jsonl"
    lam = write_jsonl(tmp_path / "l.jsonl", [{"text": t} for t in TEXTS])
    five = write_jsonl(tmp_path / "five.jsonl", [{"text": "a b c"}, {"text": 5}])
    maybe = write_jsonl(tmp_path / "maybe.jsonl", [{"passage": "p", "question": "q", "answer": "maybe"}])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "/elsewhere/run", "step": 7, "results": {"boolq": {"acc": 0.5}}}) + "\n")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    cases = [
        (["ppl", "eval.batch_size=0"], "eval.batch_size must be an integer >= 1, got 0"),
        (["ppl", "eval.batch_size=-2"], "eval.batch_size must be an integer >= 1, got -2"),
        ([f"lambada={lam}", "eval.batch_size=x"], "bad value for config key 'eval.batch_size': got 'x' (expected int)"),
        ([f"lambada={lam}", "eval.limit=-1"], "eval.limit must be an integer >= 1 (leave it unset to score every row), "
                                              "got -1"),
        ([f"lambada={lam}", "eval.limit=0"], "eval.limit must be an integer >= 1"),
        (["ppl", "eval.limit=5"], "eval.limit counts rows of lambada, boolq, choice and gen; ppl is bounded by "
                                  "eval.max_tokens"),
        ([f"lambada={five}"], f"{five} line 2: 'text' must be a string of a context and a last word (the target), "
                              "got 5"),
        ([f"boolq={maybe}"], f"{maybe} line 1: 'answer' must be true or false"),
        ([f"lambada={lam}", f"lambada={five}"], "lambada is given twice"),
        (["ppl", f"ppl={texts}"], "ppl is given twice"),
        ([f"ppl={texts}", f"data.dataset={texts}"], "ppl=DATA and data.dataset both name ppl's data; give one"),
        (["ppl", f"data.dataset={texts}", "data.val_fraction=0"],
         f"data.val_fraction=0 holds out no validation split of '{texts}'; score all of it with eval.split=all"),
        (["ppl", "eval.split=test"], "eval.split must be one of val, train, all, got 'test'"),
        (["ppl", "data.text_fild=body"], "unknown config key 'data.text_fild' (did you mean 'data.text_field'?)"),
        ([f"lamabda={lam}"], f"unknown eval task or key 'lamabda={lam}' (did you mean 'lambada'?)"),
        ([f"lambada={lam}", "eval.split=all"], "eval.split is a key of ppl, and no ppl task is given"),
        ([f"lambada={lam}", "--output", str(other)],
         f"{other} holds results of another model (/elsewhere/run, step 7)"),
        ([f"lambada={lam}", "--output", str(broken)], f"{broken} exists and is not an eval.json ember can add to"),
        (["--harness", "lambada_openai", "--limit", "-1"], "--limit must be an integer >= 1 (leave it unset to score "
                                                            "every row), got -1"),
        (["--harness", "lambada_openai", "--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    ]
    for args, message in cases:
        proc = run_ember("eval", str(run), *args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, (args, proc.stderr)
    assert _results(other) == {"boolq": {"acc": 0.5}} and broken.read_text() == "{not json"


def test_a_torch_file_without_tokenizer_names_no_guess(run: Path, tmp_path: Path):
    """A torch file keeps no tokenizer and no trace of which one its run used (cached embedded BPEs of the same
    vocab size differ by val_fraction and corpus), so the error names no cached file, only ways that are certain:
    the run, its data.tokenizer, or an HF export (which carries the tokenizer). eval and generate say the same."""
    model = tmp_path / "m.pt"
    proc = run_ember("convert", str(run), str(model), "--to", "torch")
    assert proc.returncode == 0, proc.stderr
    message = (f"error: '{model}' is a torch file: it holds no tokenizer and does not say which one its run used; "
               "give the run directory instead (its tokenizer is known), or --tokenizer FILE with the run's "
               "data.tokenizer (in its config.yaml), or export the run with `ember convert RUN --to hf`, which "
               "writes its tokenizer (the embedded BPE too) beside the weights\n")
    proc = run_ember("eval", str(model), "ppl", "data.dataset=embedded", "eval.max_tokens=40")
    assert (proc.returncode, proc.stderr) == (2, message)
    proc = run_ember("generate", str(model), "--prompt", "def", "--max-new-tokens", "2")
    assert (proc.returncode, proc.stderr) == (2, message)
    # the HF export the error points to carries the run's tokenizer: the same numbers as the run (same window, the
    # run's data named: the export and the torch file have no config.yaml to take it from)
    proc = run_ember("convert", str(run), str(tmp_path / "hf"), "--to", "hf")
    assert proc.returncode == 0, proc.stderr
    losses = []
    exported = str(tmp_path / "hf" / "tokenizer.json")
    for path, extra in ((run, []), (tmp_path / "hf", []), (model, ["--tokenizer", exported])):
        out = tmp_path / f"{len(losses)}.json"
        proc = run_ember("eval", str(path), "ppl", "data.dataset=embedded", "eval.max_tokens=40", "eval.seq_len=32",
                         *extra, "--output", str(out))
        assert proc.returncode == 0, proc.stderr
        losses.append(_results(out)["ppl"]["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)


def test_hub_tasks_that_cannot_load_are_one_line(run: Path, tmp_path: Path):
    """`lambada` / `boolq` alone load the hub dataset; offline (and with an empty cache) that is one line naming
    the dataset and the local alternative, as data.dataset's hub sources are. So it is without HF_HUB_OFFLINE
    when the hub cannot be reached (an endpoint that refuses connections): no retry lines before it."""
    offline = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    unreachable = {key: value for key, value in offline.items() if "OFFLINE" not in key and "PROXY" not in key.upper()}
    unreachable["HF_ENDPOINT"] = "http://127.0.0.1:9"
    for env in (offline, unreachable):
        for task, name in (("boolq", "super_glue"), ("lambada", "EleutherAI/lambada_openai")):
            proc = run_ember("eval", str(run), task, env=env)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
            assert proc.stderr.startswith(f"error: cannot load {task} data '{name}' from the Hugging Face hub: "), \
                proc.stderr
            assert proc.stderr.endswith(f"; give a local jsonl file ({task}=FILE.jsonl)\n"), proc.stderr


def test_a_moved_run_keeps_its_eval_json(run: Path, tmp_path: Path):
    """eval.json in the run's own checkpoint is that run's wherever the run now lies: a moved run merges into it
    and records its new path; the same file given as --output for another model is still refused."""
    import shutil

    lam = write_jsonl(tmp_path / "l.jsonl", [{"text": t} for t in TEXTS])
    bq = write_jsonl(tmp_path / "b.jsonl", [{"passage": "import os", "question": "is it python", "answer": True}])
    first, moved = tmp_path / "base2", tmp_path / "base2moved"
    shutil.copytree(run, first)
    (first / "checkpoints" / "step-2" / "eval.json").unlink(missing_ok=True)
    proc = run_ember("eval", str(first), f"lambada={lam}")
    assert proc.returncode == 0, proc.stderr
    first.rename(moved)
    eval_json = moved / "checkpoints" / "step-2" / "eval.json"
    proc = run_ember("eval", str(moved), f"boolq={bq}")
    assert proc.returncode == 0, proc.stderr
    assert f"{eval_json} was written for the model at {first}; it is now at {moved}" in proc.stdout
    report = json.loads(eval_json.read_text())
    assert (report["model"], report["step"], list(report["results"])) == (str(moved), 2, ["lambada", "boolq"])
    proc = run_ember("eval", str(run), f"boolq={bq}", "--output", str(eval_json))
    assert proc.returncode == 2 and proc.stderr == (f"error: {eval_json} holds results of another model ({moved}, "
                                                    "step 2); pass another --output or move it aside\n"), proc.stderr
    assert list(_results(eval_json)) == ["lambada", "boolq"]


def test_a_relative_dataset_in_the_runs_config_says_where_it_is_read(run: Path, tmp_path: Path):
    """Training writes data.dataset as given: `corpus.jsonl` is read relative to the current directory. From
    elsewhere that is one line naming the run's config.yaml and the fix; from the run's starting directory, or
    with an absolute data.dataset, ppl scores it. (The copy's config.yaml is edited to a relative dataset.)"""
    import shutil

    import yaml

    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    started.mkdir()
    elsewhere.mkdir()
    write_jsonl(started / "corpus.jsonl", [{"text": t} for t in TEXTS * 20])
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["data"]["dataset"] = "corpus.jsonl"
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    proc = run_ember("eval", str(copy), "ppl", cwd=elsewhere)
    assert proc.returncode == 2 and proc.stderr == (
        f"error: data.dataset 'corpus.jsonl' comes from {copy / 'config.yaml'} and is read relative to the current "
        f"directory ({elsewhere}), where it is not; run from the directory the run was started in, or pass "
        "data.dataset=ABSOLUTE_PATH\n"), proc.stderr
    proc = run_ember("eval", str(copy), "ppl", "--output", str(tmp_path / "a.json"), cwd=started)
    assert proc.returncode == 0, proc.stderr
    proc = run_ember("eval", str(copy), "ppl", f"data.dataset={started / 'corpus.jsonl'}", "--output",
                     str(tmp_path / "b.json"), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    here, absolute = _results(tmp_path / "a.json")["ppl"], _results(tmp_path / "b.json")["ppl"]
    assert here == absolute and (here["data"], here["split"]) == (str(started / "corpus.jsonl"), "val")
