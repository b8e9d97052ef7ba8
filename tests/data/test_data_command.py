"""`ember data prepare` and `ember data tokenizer train` as a user runs them (in process, ember.cli.main): an
existing output is kept unless --overwrite, a failure leaves nothing half-written, --val-fraction 0 prepares no
val split, the errors name the command's own arguments, and a vocabulary smaller than asked is said."""

import json
from pathlib import Path

import numpy as np
import pytest
from data_testing import SMALL_VOCAB, DataCfg

from ember import cli
from ember.data import packing
from ember.data.loader import build_loader
from ember.data.prepare import MANIFEST
from ember.data.tokenizer import build_tokenizer, load_tokenizer, train_bpe
from ember.errors import DataError
from tests.helpers import TINY_RUN, job_env, read_records, run_ember, write_jsonl


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """data/ with 300 short documents (a few of which the default val_fraction holds out)."""
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "d.jsonl", [{"text": f"word {i} " * (1 + i % 7)} for i in range(300)])
    return tmp_path / "data"


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    train_bpe([f"word {i} " * 3 for i in range(300)], 300).save(str(path))
    return path


def _ember(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    code = cli.main(["data", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under PATH with its bytes: what a refused or failed command must leave as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_tokenizer_train_keeps_an_existing_file_and_replaces_a_tokenizer_only_with_overwrite(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture):
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"text": "my notes"}\n')
    for overwrite in ([], ["--overwrite"]):  # a user's data file is never a tokenizer to replace
        code, out, err = _ember(capsys, "tokenizer", "train", str(corpus), str(notes), "--vocab-size", "400",
                                *overwrite)
        assert (code, out) == (2, "")
        assert err == (f"error: '{notes}' exists and is not a tokenizer.json; write to another OUT (a new .json path "
                       "or a folder)\n")
        assert notes.read_text() == '{"text": "my notes"}\n'
    tok = tmp_path / "tok"
    assert _ember(capsys, "tokenizer", "train", str(corpus), str(tok), "--vocab-size", "300")[0] == 0
    first = (tok / "tokenizer.json").read_bytes()
    code, out, err = _ember(capsys, "tokenizer", "train", str(corpus), str(tok), "--vocab-size", "400")
    assert (code, out) == (2, "")
    assert err == f"error: '{tok / 'tokenizer.json'}' exists; give --overwrite to replace it, or write to another OUT\n"
    assert (tok / "tokenizer.json").read_bytes() == first
    code, out, _ = _ember(capsys, "tokenizer", "train", str(corpus), str(tok), "--vocab-size", "400", "--overwrite")
    assert code == 0 and out.endswith(f"of {corpus}: {tok / 'tokenizer.json'}\n")
    assert load_tokenizer(str(tok)).vocab_size == 400
    assert sorted(p.name for p in tok.iterdir()) == ["tokenizer.json"]  # no temporary file left beside it


def test_tokenizer_train_says_when_the_corpus_gives_fewer_tokens_than_asked(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture):
    data = tmp_path / "small.jsonl"
    write_jsonl(data, [{"text": f"ab {i}"} for i in range(40)])
    code, out, _ = _ember(capsys, "tokenizer", "train", str(data), str(tmp_path / "tok"), "--vocab-size", "500")
    size = load_tokenizer(str(tmp_path / "tok")).vocab_size
    assert code == 0 and 259 < size < 500
    assert out.splitlines()[1] == (f"note: {size:,} tokens, fewer than --vocab-size 500: the corpus had no more merges "
                                   "to learn (more text gives more)")
    code, out, _ = _ember(capsys, "tokenizer", "train", str(data), str(tmp_path / "tok2"), "--vocab-size", str(size))
    assert code == 0 and len(out.splitlines()) == 1  # as many as asked: no note


def test_prepare_keeps_an_existing_output_and_replaces_it_whole_with_overwrite(
        tmp_path: Path, corpus: Path, tokenizer_json: Path, capsys: pytest.CaptureFixture):
    shards = tmp_path / "shards"
    prepare = ["prepare", str(corpus), str(shards), "--tokenizer", str(tokenizer_json)]
    assert _ember(capsys, *prepare)[0] == 0
    before = _tree(shards)
    assert set(before) == {"train.bin", "val.bin", MANIFEST}
    (shards / "train.bin").write_bytes(b"a run's shards")  # what --overwrite must replace, not keep
    before = _tree(shards)
    code, out, err = _ember(capsys, *prepare, "--val-fraction", "0.5")
    assert (code, out) == (2, "")
    assert err == (f"error: '{shards}' is not empty; give --overwrite to replace what it holds, or write to a new "
                   "OUT_DIR\n")
    assert _tree(shards) == before
    assert _ember(capsys, *prepare, "--val-fraction", "0.5", "--overwrite")[0] == 0
    manifest = json.loads((shards / MANIFEST).read_text())
    assert manifest["val_fraction"] == 0.5 and set(_tree(shards)) == {"train.bin", "val.bin", MANIFEST}
    assert (shards / "train.bin").stat().st_size == manifest["splits"]["train"]["num_tokens"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "shards", "tok"]  # no staging directory left
    notes = tmp_path / "notes.jsonl"
    notes.write_text("{}\n")
    for overwrite in ([], ["--overwrite"]):
        code, _, err = _ember(capsys, "prepare", str(corpus), str(notes), "--tokenizer", str(tokenizer_json),
                              *overwrite)
        assert code == 2
        assert err == f"error: OUT_DIR '{notes}' is a file, not a directory: give a new or empty directory\n"
        assert notes.read_text() == "{}\n"
    # --overwrite never replaces what preparing reads: the source, or the tokenizer.
    for out_dir, read in ((corpus, corpus / "d.jsonl"), (tokenizer_json.parent, tokenizer_json)):
        code, _, err = _ember(capsys, "prepare", str(corpus), str(out_dir), "--tokenizer", str(tokenizer_json),
                              "--overwrite")
        assert code == 2 and err == (f"error: '{out_dir}' holds '{read}', which preparing reads; replacing "
                                     f"'{out_dir}' would delete it: write to another OUT_DIR\n")
        assert read.is_file()


def test_a_failed_prepare_leaves_the_output_as_it_was(tmp_path: Path, corpus: Path, tokenizer_json: Path,
                                                      capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    one = tmp_path / "one.jsonl"
    write_jsonl(one, [{"text": "a single document"}])
    shards = tmp_path / "shards"
    code, _, err = _ember(capsys, "prepare", str(one), str(shards), "--tokenizer", str(tokenizer_json))
    assert code == 2 and not shards.exists()  # the val split fails before any split is tokenized
    assert err == (f"error: SOURCE '{one}' has 1 document(s), too few to hold one out for the val split "
                   "(--val-fraction 0.02); add documents\n")
    shards.mkdir()
    (shards / "train.bin").write_bytes(b"kept")
    tokenize, calls = packing.tokenize_documents, []

    def fail_on_the_val_split(texts: list[str], tokenizer: object) -> np.ndarray:
        calls.append(len(texts))
        if len(calls) == 2:  # the train split is written by now
            raise DataError("the disk is full")
        return tokenize(texts, tokenizer)

    monkeypatch.setattr(packing, "tokenize_documents", fail_on_the_val_split)
    code, _, err = _ember(capsys, "prepare", str(corpus), str(shards), "--tokenizer", str(tokenizer_json),
                          "--overwrite")
    assert (code, err.splitlines()[-1], len(calls)) == (2, "error: the disk is full", 2)
    assert _tree(shards) == {"train.bin": b"kept"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "one.jsonl", "shards", "tok"]  # no staging left


def test_prepare_with_val_fraction_0_writes_no_val_split_and_a_run_reads_it_without_validation(
        tmp_path: Path, corpus: Path, tokenizer_json: Path, capsys: pytest.CaptureFixture):
    shards = tmp_path / "shards"
    code, out, _ = _ember(capsys, "prepare", str(corpus), str(shards), "--tokenizer", str(tokenizer_json),
                          "--val-fraction", "0")
    assert code == 0
    manifest = json.loads((shards / MANIFEST).read_text())
    assert manifest["val_fraction"] == 0 and list(manifest["splits"]) == ["train"]
    assert manifest["splits"]["train"]["num_documents"] == 300 and set(_tree(shards)) == {"train.bin", MANIFEST}
    assert out.splitlines()[1:] == [
        "val: none (--val-fraction 0): a run on these shards trains without validation",
        f"train with: ember train ... data.dataset={shards} data.tokenizer={tokenizer_json}"]
    tok = load_tokenizer(str(tokenizer_json))
    cfg = DataCfg(dataset=str(shards), val_fraction=0.0, num_workers=0)
    batch = next(build_loader(cfg, tok, seq_len=8, micro_batch_size=2))[0]
    assert batch.shape == (2, 8)
    tokens = np.fromfile(shards / "train.bin", dtype=np.uint16)
    assert len(tokens) == manifest["splits"]["train"]["num_tokens"]
    # The trainer catches this DataError and says "no validation: ..." in its header (the slow test below).
    with pytest.raises(DataError, match=r"^'.*shards' holds no val split \(prepared with --val-fraction 0\); "
                                        r"prepare it with a --val-fraction above 0 to validate on it$"):
        build_loader(cfg, tok, seq_len=8, micro_batch_size=2, split="val")


def test_prepare_with_the_default_tokenizer_says_the_run_settings_that_build_the_same_one(
        tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture):
    shards = tmp_path / "shards"
    code, out, _ = _ember(capsys, "prepare", "embedded", str(shards), "--vocab-size", str(SMALL_VOCAB),
                          "--val-fraction", "0")
    assert code == 0
    assert out.splitlines()[-1] == (f"train with: ember train ... data.dataset={shards} model.vocab_size={SMALL_VOCAB} "
                                    "data.val_fraction=0.0")
    # The embedded BPE is trained on the train split, so a run with the default data.val_fraction builds another.
    identity = json.loads((shards / MANIFEST).read_text())["tokenizer"]["identity"]
    assert build_tokenizer(DataCfg(val_fraction=0.0), SMALL_VOCAB).identity == identity
    assert build_tokenizer(DataCfg(), SMALL_VOCAB).identity != identity


@pytest.mark.parametrize("args, message", [
    (["--text-field", "body"], "{corpus}/d.jsonl line 1 has no 'body' field (it has: text); set --text-field to the "
                               "right column"),
    (["--val-fraction", "1"], "--val-fraction must be in [0, 1), got 1.0"),
    (["--tokenizer", "{tmp}/missing"], "--tokenizer '{tmp}/missing' not found: expected a tokenizer.json, a "
                                       "SentencePiece .model, a tiktoken BPE file, or a folder containing one; fix the "
                                       "path or leave out --tokenizer to use the embedded BPE"),
])
def test_prepare_errors_name_the_command_arguments(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture,
                                                   args: list[str], message: str):
    args = [a.format(tmp=tmp_path) for a in args]
    code, _, err = _ember(capsys, "prepare", str(corpus), str(tmp_path / "out"), *args)
    assert code == 2 and err == f"error: {message.format(corpus=corpus, tmp=tmp_path)}\n"
    assert not (tmp_path / "out").exists()


def test_tokenizer_train_errors_name_the_command_arguments(tmp_path: Path, capsys: pytest.CaptureFixture):
    code, _, err = _ember(capsys, "tokenizer", "train", str(tmp_path / "nope.jsonl"), str(tmp_path / "tok"),
                          "--vocab-size", "300")
    assert code == 2 and err == f"error: SOURCE path '{tmp_path / 'nope.jsonl'}' does not exist; check the path\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _ember(capsys, "tokenizer", "train", str(empty), str(tmp_path / "tok"), "--vocab-size", "300")
    assert code == 2 and err.startswith(f"error: SOURCE folder '{empty}' holds no ")
    assert not (tmp_path / "tok").exists()


@pytest.mark.slow
def test_a_run_on_shards_prepared_with_val_fraction_0_trains_without_validation(tmp_path: Path, corpus: Path,
                                                                              tokenizer_json: Path):
    shards = tmp_path / "shards"
    run_ember("data", "prepare", str(corpus), str(shards), "--tokenizer", str(tokenizer_json), "--val-fraction", "0",
              expect=0)
    proc = run_ember("train", "debug", *TINY_RUN, "max_steps=3", "logging_steps=1", "metrics.console=true",
                     "eval_interval=1", f"output_dir={tmp_path / 'run'}", f"data.dataset={shards}",
                     f"data.tokenizer={tokenizer_json}", "data.val_fraction=0",
                     env=job_env(EMBER_CACHE=str(tmp_path / "cache")), expect=0)
    assert (f"no validation: '{shards}' holds no val split (prepared with --val-fraction 0); prepare it with a "
            "--val-fraction above 0 to validate on it") in proc.stdout
    assert "done: 3 steps" in proc.stdout
    # eval_interval with nothing to evaluate: no bare `step 1` line, no record of nulls
    assert not [line for line in proc.stdout.splitlines() if line.strip().split() in (["step", "1"], ["step", "2"])]
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3] and all("loss" in r for r in records)


def test_gym_writes_seeded_rows_without_the_excluded_prompts(tmp_path: Path, capsys: pytest.CaptureFixture):
    options = ["--option", "max_terms=2", "--option", "max_digits=1", "--option", "operators=[+]",
               "--option", "allow_parentheses=false", "--option", "allow_negation=false"]
    held = tmp_path / "held.jsonl"
    assert _ember(capsys, "gym", "basic_arithmetic", str(held), "--size", "10", "--seed", "2", *options)[0] == 0
    code, out, _ = _ember(capsys, "gym", "basic_arithmetic", str(tmp_path / "train.jsonl"), "--size", "200",
                          *options, "--exclude", str(held))
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held_prompts = {json.loads(line)["prompt"] for line in held.read_text().splitlines()}
    assert code == 0 and f"{len(rows)} rows" in out and "left out as in --exclude" in out
    assert 0 < len(rows) < 200 and not held_prompts & {r["prompt"] for r in rows}
    for row in rows:  # one-digit sums, as the options asked; the response is what SFT trains
        a, b = row["prompt"].removeprefix("Calculate ").rstrip(".").split(" + ")
        assert int(a) + int(b) == int(row["answer"]) and row["response"] == f" {row['answer']}"
    again = tmp_path / "again.jsonl"
    _ember(capsys, "gym", "basic_arithmetic", str(again), "--size", "10", "--seed", "2", *options)
    assert again.read_text() == held.read_text()  # seeded
    mixed = tmp_path / "mixed.jsonl"
    _ember(capsys, "gym", "basic_arithmetic", str(mixed), "--size", "40", *options, "--response", " {answer}",
           "--response", " The answer is {answer}.")
    responses = [(r["response"], r["answer"]) for r in map(json.loads, mixed.read_text().splitlines())]
    short = sum(response == f" {answer}" for response, answer in responses)
    assert 0 < short < 40 and all(r in (f" {a}", f" The answer is {a}.") for r, a in responses)


@pytest.mark.parametrize("args, message", [
    (["--option", "max_digits"], "--option 'max_digits': give KEY=VALUE"),
    (["--option", "no_such_option=1"], "reasoning-gym cannot make generator 'basic_arithmetic'"),
    (["--size", "0"], "--size must be >= 1"),
    (["--response", "The answer"], "--response 'The answer' has no {answer}"),
    (["--exclude", "missing.jsonl"], "--exclude missing.jsonl: no such file"),
])
def test_gym_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str):
    code, _, err = _ember(capsys, "gym", "basic_arithmetic", str(tmp_path / "out.jsonl"), *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()
    (tmp_path / "out.jsonl").write_text("mine\n")
    code, _, err = _ember(capsys, "gym", "basic_arithmetic", str(tmp_path / "out.jsonl"), "--size", "2")
    assert code == 2 and "exists; give --overwrite" in err and (tmp_path / "out.jsonl").read_text() == "mine\n"
    for out, message in ((tmp_path, "is a directory"), (tmp_path / "x.txt", "write a .jsonl")):
        code, _, err = _ember(capsys, "gym", "basic_arithmetic", str(out), "--size", "2", "--overwrite")
        assert code == 2 and message in err
