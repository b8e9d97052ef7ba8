"""`ember eval`, `generate`, `convert` and `report` on a run whose output_dir is on an S3-compatible server (moto's
server mode on 127.0.0.1, tests/object_store.py): each gives what it gives on a local copy of the run, its outputs
land on the store (or at --output), and a bad location is one line with exit 2 before any work."""

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import job_env, read_records, run_ember
from tests.object_store import BUCKET, S3Server
from tests.storage.test_object_storage import TINY

pytestmark = pytest.mark.slow


def _env(server: S3Server, cache: Path) -> dict:
    return job_env(**server.env(EMBER_CACHE=str(cache)))


@pytest.fixture(scope="module")
def s3_run(s3_server, tmp_path_factory) -> tuple[str, Path, Path]:
    """A tiny run trained to s3://ember-test/cmds (checkpoints at steps 2, 4, 6), its objects downloaded (before any
    test writes beside it), and the EMBER_CACHE the tests share."""
    folder = tmp_path_factory.mktemp("cmds")
    url = s3_server.url("cmds")
    # the embedded text rather than TINY's synthetic tokens: ppl scores the run's own documents
    run_ember("train", *TINY, "data.dataset=embedded", "model.vocab_size=320", f"output_dir={url}",
              env=_env(s3_server, folder / "cache"), expect=0)
    local = folder / "cmds"
    s3_server.filesystem().get(f"{BUCKET}/cmds/", str(local), recursive=True)
    assert sorted(p.name for p in (local / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    return url, local, folder / "cache"


def _read_json(server: S3Server, key: str) -> dict:
    return json.loads(server.filesystem().cat(f"{BUCKET}/{key}"))


def test_eval_on_s3_equals_eval_on_a_local_copy_and_eval_json_lands_on_the_store(s3_server, s3_run, tmp_path):
    url, local, cache = s3_run
    fs = s3_server.filesystem()
    # an earlier result on the store, in the run's own eval.json: kept, as a local eval keeps it
    earlier = {"choice": {"acc": 0.25, "data": "/data/choice.jsonl"}}
    fs.pipe(f"{BUCKET}/cmds/checkpoints/step-6/eval.json",
            json.dumps({"model": url, "step": 6, "results": earlier}).encode())
    copy = tmp_path / "copy"  # the local run, with the same earlier result
    shutil.copytree(local, copy)
    (copy / "checkpoints" / "step-6" / "eval.json").write_text(json.dumps({"model": url, "step": 6,
                                                                             "results": earlier}))
    keys = ["eval.max_tokens=256", "eval.batch_size=2"]
    proc = run_ember("eval", url, "ppl", *keys, env=_env(s3_server, cache), expect=0)
    assert f"wrote {url}/checkpoints/step-6/eval.json (kept the earlier choice)" in proc.stdout, proc.stdout
    run_ember("eval", str(copy), "ppl", *keys, env=_env(s3_server, cache), expect=0)
    remote = _read_json(s3_server, "cmds/checkpoints/step-6/eval.json")
    mine = json.loads((copy / "checkpoints" / "step-6" / "eval.json").read_text())
    assert remote["model"] == url and remote["step"] == mine["step"] == 6
    assert remote["results"] == mine["results"]  # every number (== on floats), the earlier result kept in both
    assert remote["results"]["ppl"]["tokens"] == 256 and remote["results"]["ppl"]["perplexity"] > 1
    assert remote["results"]["choice"] == earlier["choice"]
    # --output elsewhere on the store: a new eval.json of this model there
    out = s3_server.url("elsewhere/eval.json")
    run_ember("eval", url, "ppl", *keys, "--output", out, env=_env(s3_server, cache), expect=0)
    assert _read_json(s3_server, "elsewhere/eval.json")["results"] == {"ppl": mine["results"]["ppl"]}
    # the model came through the cache: one copy of the newest checkpoint, beside the run's config.yaml
    (copied,) = cache.glob("remote/*/data/cmds")
    assert sorted(p.name for p in (copied / "checkpoints").iterdir()) == ["step-6"]
    assert (copied / "config.yaml").read_text() == (local / "config.yaml").read_text()
    assert not (copied / "checkpoints" / "step-6" / "eval.json").exists()  # results live on the store


def test_generate_from_s3_equals_generate_from_a_local_copy(s3_server, s3_run):
    url, local, cache = s3_run
    s3_server.filesystem().pipe(f"{BUCKET}/prompts.jsonl", b'{"prompt": "The quick brown fox"}\n')
    args = ["--max-new-tokens", "12", "--json", "--precision", "fp32"]
    remote = json.loads(run_ember("generate", url, "--prompt-file", s3_server.url("prompts.jsonl"), *args,
                                  env=_env(s3_server, cache), expect=0).stdout)
    mine = json.loads(run_ember("generate", str(local), "--prompt", "The quick brown fox", *args,
                                env=_env(s3_server, cache), expect=0).stdout)
    assert remote == mine  # the run's own tokenizer (its config.yaml's data section) and the same greedy tokens
    assert remote["prompt"] == "The quick brown fox" and len(remote["token_ids"]) == 12


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {key: value for file in sorted(folder.glob("*.safetensors")) for key, value in load_file(file).items()}


def test_convert_from_s3_to_s3_equals_converting_locally_and_refuses_a_non_empty_destination(s3_server, s3_run,
                                                                                              tmp_path):
    import torch

    url, local, cache = s3_run
    fs = s3_server.filesystem()
    dst = s3_server.url("exports/hf")
    proc = run_ember("convert", url, dst, "--to", "hf", env=_env(s3_server, cache), expect=0)
    assert f"wrote {dst} (hf)" in proc.stdout
    run_ember("convert", str(local), str(tmp_path / "mine"), "--to", "hf", env=_env(s3_server, cache), expect=0)
    fs.get(f"{BUCKET}/exports/hf/", str(tmp_path / "theirs"), recursive=True)
    theirs, mine = _tensors(tmp_path / "theirs"), _tensors(tmp_path / "mine")
    assert theirs.keys() == mine.keys() and len(mine) > 5
    assert all(torch.equal(theirs[key], mine[key]) for key in mine)
    names = sorted(p.name for p in (tmp_path / "mine").iterdir())
    assert sorted(p.name for p in (tmp_path / "theirs").iterdir()) == names and "tokenizer.json" in names
    for name in ("config.json", "tokenizer.json"):
        assert (tmp_path / "theirs" / name).read_bytes() == (tmp_path / "mine" / name).read_bytes()
    assert fs.ls(f"{BUCKET}/exports", refresh=True) == [f"{BUCKET}/exports/hf"]  # no staging prefix left
    # a second conversion into it: refused without --overwrite, in one line, the destination untouched
    before = {path: info["ETag"] for path, info in fs.find(f"{BUCKET}/exports", detail=True).items()}
    proc = run_ember("convert", url, dst, "--to", "hf", env=_env(s3_server, cache))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "is not empty; give --overwrite" in lines[0], proc.stderr
    fs.invalidate_cache()
    assert {path: info["ETag"] for path, info in fs.find(f"{BUCKET}/exports", detail=True).items()} == before
    # with --overwrite: replaced whole, the same objects, and refused where it would destroy its own source
    run_ember("convert", str(local), dst, "--to", "hf", "--overwrite", env=_env(s3_server, cache), expect=0)
    fs.invalidate_cache()
    assert sorted(fs.find(f"{BUCKET}/exports")) == sorted(before)
    proc = run_ember("convert", url, s3_server.url(""), "--to", "hf", "--overwrite", env=_env(s3_server, cache))
    assert proc.returncode == 2 and "which this conversion reads; --overwrite would destroy it" in proc.stderr


def test_convert_writes_a_torch_file_to_s3_as_one_object(s3_server, s3_run, tmp_path):
    import torch

    url, local, cache = s3_run
    dst = s3_server.url("files/model.pt")
    run_ember("convert", str(local), dst, "--to", "torch", env=_env(s3_server, cache), expect=0)
    run_ember("convert", url, dst, "--to", "torch", "--overwrite", env=_env(s3_server, cache), expect=0)  # an export
    s3_server.filesystem().get(f"{BUCKET}/files/model.pt", str(tmp_path / "model.pt"))
    theirs = torch.load(tmp_path / "model.pt", weights_only=True)
    run_ember("convert", str(local), str(tmp_path / "mine.pt"), "--to", "torch", env=_env(s3_server, cache), expect=0)
    mine = torch.load(tmp_path / "mine.pt", weights_only=True)
    assert theirs["ember"] == mine["ember"] and theirs["model"].keys() == mine["model"].keys()
    assert all(torch.equal(theirs["model"][key], mine["model"][key]) for key in mine["model"])
    s3_server.filesystem().pipe(f"{BUCKET}/files/notes.pt", b"not a model")
    for target, message in ((s3_server.url("files/notes.pt"), "is not a file `ember convert --to torch` wrote"),
                            (s3_server.url("files"), "is a prefix holding objects, but --to torch writes one file")):
        proc = run_ember("convert", url, target, "--to", "torch", "--overwrite", env=_env(s3_server, cache))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert s3_server.filesystem().cat(f"{BUCKET}/files/notes.pt") == b"not a model"


def test_report_of_an_s3_run_is_written_to_the_store_and_compares_with_local_runs(s3_server, s3_run, tmp_path,
                                                                                   monkeypatch):
    url, local, cache = s3_run
    losses = [r for r in read_records(local) if "loss_avg" in r]
    final = f"{losses[-1]['loss_avg']:.4f} (step {losses[-1]['step']})"
    proc = run_ember("report", url, env=_env(s3_server, cache), expect=0)
    assert f"wrote {url}/report.html and " in proc.stdout, proc.stdout
    fs = s3_server.filesystem()
    page = fs.cat(f"{BUCKET}/cmds/report.html").decode()
    assert final in page and url in page
    figures = sorted(Path(p).name for p in fs.ls(f"{BUCKET}/cmds/report", refresh=True))
    assert figures and all(name.endswith(".png") for name in figures)
    assert fs.cat(f"{BUCKET}/cmds/report/{figures[0]}")[:4] == b"\x89PNG"
    # the same run local and on the store, compared on one local page: the same numbers for both
    from ember.report import build_report

    for key, value in s3_server.env(EMBER_CACHE=str(cache)).items():
        monkeypatch.setenv(key, value)
    report = build_report([url, str(local)], tmp_path / "compared.html")
    remote, mine = (run.summary() for run in report.runs)
    assert remote == mine and remote["checkpoints"] == [2, 4, 6] and remote["steps"] == 6
    assert [run.name for run in report.runs] == ["ember-test/cmds", f"{local.parent.name}/cmds"]
    assert sorted(p.name for p in (tmp_path / "compared").iterdir()) == figures
    assert (tmp_path / "compared.html").read_text().count(final) == 2


def test_bad_locations_are_one_line_with_exit_2_before_any_work(s3_server, s3_run, tmp_path):
    url, local, _ = s3_run
    cases = {
        "eval, missing bucket": (["eval", "s3://no-such-bucket/run", "ppl"], "path s3://no-such-bucket/run: the "
                                 "bucket 'no-such-bucket' does not exist"),
        "eval, nothing there": (["eval", s3_server.url("nothing"), "ppl"], f"path {s3_server.url('nothing')} does "
                                "not exist"),
        "eval, --output's bucket": (["eval", url, "ppl", "--output", "s3://no-such-bucket/eval.json"],
                                    "--output s3://no-such-bucket/eval.json: the bucket 'no-such-bucket'"),
        "generate, no backend": (["generate", "gs://bucket/run", "--prompt", "x"], "path gs://bucket/run: gs:// "
                                 "cannot be opened (its fsspec backend is not installed): pip install gcsfs"),
        "convert, SRC": (["convert", s3_server.url("nothing"), str(tmp_path / "out")], "SRC s3://ember-test/nothing "
                         "does not exist"),
        "convert, DST": (["convert", str(local), "s3://no-such-bucket/hf"], "DST s3://no-such-bucket/hf: the bucket"),
        "report": (["report", "s3://no-such-bucket/run"], "RUN s3://no-such-bucket/run: the bucket 'no-such-bucket'"),
        "report, not a run": (["report", s3_server.url("cmds/checkpoints")], "is not an ember run"),
    }
    cache = tmp_path / "cache"
    for name, (args, message) in cases.items():
        proc = run_ember(*args, env=_env(s3_server, cache))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (name, proc.stderr[-2000:])
    assert not cache.exists() and not (tmp_path / "out").exists()  # nothing downloaded, nothing written
    assert not s3_server.filesystem().exists(f"{BUCKET}/cmds/checkpoints/report.html")
