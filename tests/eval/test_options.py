"""`ember eval`'s arguments through the config's override path (ember/eval/options.py): a misspelt key or task is
one line naming the closest one, and ppl's data.* keys, over the run's own data section, are typed and checked as
`ember train`'s are, all before any model loads. In process: the runs here are a config.yaml and no model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ember import cli, config as config_lib
from ember.config_schema import DataConfig
from ember.errors import ConfigError, UserFileNotFound
from tests.helpers import write_jsonl

KEYS = "eval.limit, eval.batch_size, eval.seq_len, eval.stride, eval.max_tokens, eval.split, data.*, gen.*"


def _error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """`ember eval ARGV`'s stderr, asserted to be one line with exit code 2 and nothing on stdout."""
    assert cli.main(["eval", *argv]) == 2, argv
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (argv, out, err)
    return err


def test_a_misspelt_key_or_task_is_one_line_naming_the_closest(tmp_path: Path, capsys: pytest.CaptureFixture):
    """Keys are compared with the keys ember eval has (eval.* and every data.* key), case-blind as the config's are;
    a misspelt task with the tasks and keys."""
    lam = write_jsonl(tmp_path / "l.jsonl", [{"text": "a b c"}])
    run = str(tmp_path / "run")
    keys, tasks = f"for ember eval (keys: {KEYS})", f"(tasks: ppl, lambada, boolq, choice, gen; keys: {KEYS})"
    for args, message in (
            ([f"lambada={lam}", "eval.limt=3"], f"unknown config key 'eval.limt' (did you mean 'eval.limit'?) {keys}"),
            ([f"lambada={lam}", "eval.BATCH_SIZE=2"],
             f"unknown config key 'eval.BATCH_SIZE' (did you mean 'eval.batch_size'?) {keys}"),
            (["ppl", "data.datset=x.jsonl"], f"unknown config key 'data.datset' (did you mean 'data.dataset'?) {keys}"),
            ([f"lambda={lam}"], f"unknown eval task or key 'lambda={lam}' (did you mean 'lambada'?) {tasks}"),
            (["boolg"], f"unknown eval task or key 'boolg' (did you mean 'boolq'?) {tasks}"),
            (["ppl", "evl.max_tokens=5"],
             f"unknown eval task or key 'evl.max_tokens=5' (did you mean 'eval.max_tokens'?) {tasks}"),
            (["hellaswag"], f"unknown eval task or key 'hellaswag' {tasks}")):
        assert _error(capsys, run, *args) == f"error: {message}\n"


def test_a_misspelt_harness_task_is_named_case_blind(tmp_path: Path, capsys: pytest.CaptureFixture):
    import lm_eval  # noqa: F401  the test extra: missing, this fails rather than skips
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text("task: ember_tiny\ndataset_path: json\noutput_type: loglikelihood\n")
    err = _error(capsys, str(tmp_path / "run"), "--harness", "EMBER_TYNI", "--include-path", str(tasks))
    assert err == (f"error: lm-eval task 'EMBER_TYNI' is not defined in --include-path {tasks} (did you mean "
                   "'ember_tiny'?); give a task name one of its YAMLs defines (task: NAME), or drop --include-path "
                   "for lm-eval's registered tasks\n")


def test_data_keys_are_typed_and_checked_as_trainings(tmp_path: Path, capsys: pytest.CaptureFixture):
    """The same line as `ember train` for the same data.* key: a value of the wrong type, and values training's
    checks refuse."""
    for item, message in (
            ("data.val_fraction=abc", "bad value for config key 'data.val_fraction': got 'abc' (expected float)"),
            ("data.num_workers=3", ("data.num_workers=3: 0 reads batches in the training thread, 1 in one "
                                    "background thread (one keeps ahead of the step; more would reorder samples); "
                                    "use 0 or 1")),
            ("data.mixture=[{source: /x.jsonl, weight: -1}]",
             "data.mixture[0] (/x.jsonl) has weight -1.0; weights must be positive"),
            ("data.streaming=true", ("data.streaming=true streams a hub dataset or local files (data.dataset); the "
                                     "embedded corpus, synthetic data and mixtures are read without it: set "
                                     "data.streaming=false"))):
        with pytest.raises(ConfigError) as train:
            config_lib.load("debug", [item])
        assert str(train.value) == message
        assert _error(capsys, str(tmp_path / "run"), "ppl", item) == f"error: {message}\n"


def test_ppl_reads_the_runs_data_section_under_the_keys(tmp_path: Path):
    """Plain ppl: the run's data section and seq_len, the command's keys over them, the validation split; ppl=DATA
    replaces the source only, and its split is all. A key the schema does not have in the run's config.yaml is
    named with the file; ppl=DATA that is not there is named as ppl's, before any model loads."""
    from ember.commands.eval import parse

    run = tmp_path / "run"
    run.mkdir()
    texts = write_jsonl(tmp_path / "t.jsonl", [{"body": "a b c"}])
    (run / "config.yaml").write_text(yaml.safe_dump({"seq_len": 48, "data": {"dataset": texts, "val_fraction": 0.1,
                                                                            "text_field": "body"}}))
    args = parse([str(run), "ppl", "data.val_fraction=0.25"])
    assert args.data == DataConfig(dataset=texts, val_fraction=0.25, text_field="body")
    assert (args.options.seq_len, args.options.stride, args.options.split) == (48, None, "val")
    other = write_jsonl(tmp_path / "o.jsonl", [{"body": "d e f"}])
    args = parse([str(run), f"ppl={other}", "eval.seq_len=16"])
    assert args.data == DataConfig(dataset=other, val_fraction=0.1, text_field="body")
    assert (args.options.seq_len, args.options.split) == (16, "all")
    assert parse([str(run), "lambada=l.jsonl"]).data is None  # no ppl: the run's data is not read
    with pytest.raises(UserFileNotFound, match=r"^ppl path 'nope/x.jsonl' does not exist; check the path$"):
        parse([str(run), "ppl=nope/x.jsonl"])
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"datset": texts}}))
    with pytest.raises(ConfigError) as err:
        parse([str(run), "ppl"])
    assert str(err.value) == f"unknown config key 'data.datset' (did you mean 'data.dataset'?) in {run / 'config.yaml'}"
