"""Runs whose output_dir is on an S3-compatible server (moto's server mode on 127.0.0.1, tests/object_store.py):
they train, die in a save or by SIGKILL with an upload in flight, resume bit for bit, reshard from world 2 to 4,
and write no credential anywhere. Every bad location is one line before any work."""

import signal
from pathlib import Path

import pytest

from tests.helpers import job_env, kill_injection, losses_by_step, run_ember, tiny_model
from tests.object_store import BUCKET, S3Server, start_s3_server

pytestmark = pytest.mark.slow

TINY = ["debug", "data.dataset=synthetic", *tiny_model(2), "model.vocab_size=256", "seq_len=32", "global_batch_size=4",
        "micro_batch_size=2", "logging_steps=1", "max_steps=6", "checkpoint.interval=2", "eval_batches=1",
        "metrics.console=false", "optim.lr=1e-2"]


def _env(server: S3Server, tmp_path: Path, **extra: str) -> dict:
    return job_env(**server.env(PYTHONPATH=str(kill_injection(tmp_path)), EMBER_CACHE=str(tmp_path / "cache"),
                                **extra))


def _pulled(server: S3Server, name: str, tmp_path: Path) -> Path:
    """The run's objects, downloaded: what the store holds, not the mirror."""
    target = tmp_path / f"pulled-{name}"
    server.filesystem().get(f"{BUCKET}/{name}/", str(target), recursive=True)
    return target


def _steps(server: S3Server, name: str) -> dict[str, bool]:
    """checkpoints/step-N -> whether it is committed (holds model.json)."""
    fs = server.filesystem()
    root = f"{BUCKET}/{name}/checkpoints"
    return {Path(p).name: fs.exists(f"{p}/model.json") for p in fs.ls(root, refresh=True)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "run"
    run_ember("train", *TINY, f"output_dir={out}", env=job_env(), expect=0)
    return out


def test_a_save_cut_short_on_s3_is_never_loaded_and_the_run_resumes_bit_for_bit(s3_server, uninterrupted, tmp_path):
    url = s3_server.url("cut")
    run_ember("train", *TINY, f"output_dir={url}", env=_env(s3_server, tmp_path, EMBER_DIE_IN_SAVE_AT="4"), expect=1)
    assert _steps(s3_server, "cut") == {"step-2": True, "step-4": False}  # shards uploaded, no commit marker
    proc = run_ember("train", *TINY, f"output_dir={url}", env=_env(s3_server, tmp_path), expect=0)
    assert "removed the incomplete checkpoint step-4" in proc.stdout, proc.stdout
    assert f"resumed from {url}/checkpoints/step-2 (step 2)" in proc.stdout, proc.stdout
    run = _pulled(s3_server, "cut", tmp_path)
    assert losses_by_step(run) == losses_by_step(uninterrupted)  # every step, bit for bit (== on floats)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    assert {"config.yaml", "run.json", "metrics.jsonl", "tb", "config_history"} <= {p.name for p in run.iterdir()}
    # no credential in any object of the run, nor in the local mirror it was written through
    written = [p for p in [*run.rglob("*"), *(tmp_path / "cache").rglob("*")] if p.is_file()]
    assert written
    for path in written:
        data = path.read_bytes()
        assert s3_server.secret.encode() not in data and s3_server.key_id.encode() not in data, path


def test_sigkill_with_an_async_upload_in_flight_resumes_bit_for_bit(s3_server, uninterrupted, tmp_path):
    url = s3_server.url("async")
    args = [*TINY, f"output_dir={url}", "checkpoint.async_save=true"]
    run_ember("train", *args, env=_env(s3_server, tmp_path, EMBER_KILL_AT_STEP="5"), expect=-signal.SIGKILL)
    run_ember("train", *args, env=_env(s3_server, tmp_path), expect=0)
    assert losses_by_step(_pulled(s3_server, "async", tmp_path)) == losses_by_step(uninterrupted)


def test_sigterm_saves_to_s3_and_resume_finishes(s3_server, uninterrupted, tmp_path):
    """SIGTERM at step 3 (sent by the run to itself, as a scheduler would): a checkpoint of step 3 is committed on
    the store, and the resumed run ends where the uninterrupted one did."""
    url = s3_server.url("term")
    inject = tmp_path / "term"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os, signal\n"
        "import ember.train.trainer as t\n"
        "original = t.Trainer.train_step\n"
        "def train_step(self, batches):\n"
        "    if self.step == 3:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return original(self, batches)\n"
        "t.Trainer.train_step = train_step\n")
    env = job_env(**s3_server.env(PYTHONPATH=str(inject), EMBER_CACHE=str(tmp_path / "cache")))
    proc = run_ember("train", *TINY, "checkpoint.interval=0", f"output_dir={url}", env=env, expect=0)
    assert "SIGTERM: saving a checkpoint at step 4" in proc.stdout, proc.stdout
    assert _steps(s3_server, "term") == {"step-4": True}
    run_ember("train", *TINY, "checkpoint.interval=0", f"output_dir={url}", env=_env(s3_server, tmp_path), expect=0)
    assert losses_by_step(_pulled(s3_server, "term", tmp_path)) == losses_by_step(uninterrupted)


def test_a_world_2_run_on_s3_resumes_at_world_4(s3_server, tmp_path):
    local = tmp_path / "world2"
    run_ember("train", "--nproc-per-node=2", *TINY, f"output_dir={local}", env=job_env(), expect=0)
    url = s3_server.url("reshard")
    env = _env(s3_server, tmp_path)
    run_ember("train", "--nproc-per-node=2", *TINY, "max_steps=4", f"output_dir={url}", env=env, expect=0)
    proc = run_ember("train", "--nproc-per-node=4", *TINY, "micro_batch_size=1", f"output_dir={url}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {url}/checkpoints/step-4 (step 4)" in proc.stdout
    got, want = losses_by_step(_pulled(s3_server, "reshard", tmp_path)), losses_by_step(local)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert [got[s] for s in (1, 2, 3, 4)] == [want[s] for s in (1, 2, 3, 4)]  # world 2, through the store
    for step in (5, 6):  # world 4 from world 2's shards: the same batches, summed in another order
        assert got[step][0] == pytest.approx(want[step][0], rel=1e-5)
        assert got[step][1] == pytest.approx(want[step][1], rel=1e-4)


def test_resume_names_a_checkpoint_on_s3_from_a_local_run(s3_server, uninterrupted, tmp_path, monkeypatch):
    url = s3_server.url("source")
    run_ember("train", *TINY, "max_steps=4", f"output_dir={url}", env=_env(s3_server, tmp_path), expect=0)
    out = tmp_path / "local"
    proc = run_ember("train", *TINY, f"output_dir={out}", f"resume={url}/checkpoints/step-4",
                     env=_env(s3_server, tmp_path), expect=0)
    assert f"resumed from {url}/checkpoints/step-4 (step 4)" in proc.stdout
    got, want = losses_by_step(out), losses_by_step(uninterrupted)
    assert sorted(got) == [5, 6] and all(got[s] == want[s] for s in (5, 6))
    # a run on the store is a model path too (eval, generate, convert): its newest committed checkpoint
    import torch

    from ember.model_io.load import load_model

    for key, value in s3_server.env(EMBER_CACHE=str(tmp_path / "cache")).items():
        monkeypatch.setenv(key, value)
    remote, local = load_model(url).state_dict(), load_model(_pulled(s3_server, "source", tmp_path)).state_dict()
    assert local.keys() == remote.keys() and all(torch.equal(local[k], remote[k]) for k in local)
    (copy,) = (tmp_path / "cache" / "remote").glob("*/data/source")  # the run's newest checkpoint and config
    assert sorted(p.relative_to(copy).as_posix() for p in copy.iterdir()) == ["checkpoints", "config.yaml"]
    assert [p.name for p in (copy / "checkpoints").iterdir()] == ["step-4"]


@pytest.fixture(scope="module")
def signing_server(tmp_path_factory):
    server = start_s3_server(tmp_path_factory.mktemp("signed"), check_signatures=True)
    try:
        yield server
    finally:
        server.stop()


def test_bad_locations_are_one_line_before_any_work(s3_server, signing_server, tmp_path):
    cache = tmp_path / "cache"
    cases = {
        "missing bucket": (s3_server.env(), "s3://no-such-bucket/run", "the bucket 'no-such-bucket' does not exist"),
        "wrong secret": (signing_server.env(AWS_SECRET_ACCESS_KEY="not-the-secret"), signing_server.url("run"),
                         "access denied"),
        "no credentials": ({**{k: v for k, v in s3_server.env().items() if not k.startswith("AWS_ACCESS")
                               and not k.startswith("AWS_SECRET")}, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                            "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true"},
                           s3_server.url("run"), "no credentials for it in the environment"),
        "unreachable endpoint": (s3_server.env(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1"),
                                 s3_server.url("run"), "cannot be reached"),
        "backend not installed": (s3_server.env(), "gs://bucket/run", "pip install gcsfs"),
        "credentials in the URL": (s3_server.env(), f"s3://AKID:{s3_server.secret}@{BUCKET}/run",
                                   "carries credentials in the URL"),
    }
    for name, (env, url, message) in cases.items():
        proc = run_ember("train", *TINY, f"output_dir={url}", env=job_env(**env, EMBER_CACHE=str(cache)))
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (name, proc.stderr[-2000:])
        assert s3_server.secret not in proc.stderr, name
    assert not cache.exists()  # no mirror made, nothing written
    assert not s3_server.filesystem().exists(f"{BUCKET}/run")


def test_init_from_an_hf_directory_on_s3_equals_the_local_load(s3_server, uninterrupted, tmp_path, monkeypatch):
    import torch

    from ember.model_io.load import load_model

    hf = tmp_path / "hf"
    run_ember("convert", str(uninterrupted), str(hf), "--to", "hf", env=job_env(), expect=0)
    fs = s3_server.filesystem()
    fs.put(str(hf), f"{BUCKET}/models/hf", recursive=True)
    url = s3_server.url("models/hf")
    for key, value in s3_server.env(EMBER_CACHE=str(tmp_path / "cache")).items():
        monkeypatch.setenv(key, value)
    local, remote = load_model(hf).state_dict(), load_model(url).state_dict()
    assert local.keys() == remote.keys() and all(torch.equal(local[k], remote[k]) for k in local)
    (copy,) = (tmp_path / "cache" / "remote").glob("*/data/hf")
    first = copy.stat().st_mtime_ns
    load_model(url)  # unchanged on the store: the copy is reused, not downloaded again
    assert copy.stat().st_mtime_ns == first
    # training from it equals training from the local directory, step for step
    args = [*TINY, "max_steps=2", "checkpoint.interval=0"]
    run_ember("train", *args, f"model.init_from={hf}", f"output_dir={tmp_path / 'a'}", env=job_env(), expect=0)
    run_ember("train", *args, f"model.init_from={url}", f"output_dir={tmp_path / 'b'}",
              env=_env(s3_server, tmp_path), expect=0)
    assert losses_by_step(tmp_path / "b") == losses_by_step(tmp_path / "a")


def test_the_xla_path_checkpoints_to_s3_and_the_torch_path_resumes_it(s3_server, tmp_path):
    """device=xla on 8 virtual devices: each host's chunks and the merged metadata on the store, committed by
    model.json; the torch path resumes step 4 from there and trains the same losses."""
    from tests.xla.conftest import XLA_ENV
    from tests.xla.test_xla_checkpoint import BASE, FSDP8

    url = s3_server.url("xla")
    env = {**_env(s3_server, tmp_path), **XLA_ENV}
    env.pop("OMP_NUM_THREADS", None)
    run_ember("train", *BASE, *FSDP8, f"output_dir={url}", env=env, expect=0)
    assert _steps(s3_server, "xla") == {"step-4": True, "step-8": True}
    out = tmp_path / "torch"
    run_ember("train", *BASE, "device=cpu", "micro_batch_size=8", f"output_dir={out}",
              f"resume={url}/checkpoints/step-4", env=env, expect=0)
    xla, torch_path = losses_by_step(_pulled(s3_server, "xla", tmp_path)), losses_by_step(out)
    assert sorted(torch_path) == [5, 6, 7, 8]
    for step in torch_path:
        assert torch_path[step][0] == pytest.approx(xla[step][0], rel=1e-5)


def test_plan_writes_its_json_to_s3_and_never_over_a_file_it_did_not_write(s3_server, tmp_path):
    import json

    url = s3_server.url("plans/plan.json")
    env = _env(s3_server, tmp_path)
    proc = run_ember("plan", "debug", "micro_batch_size=4", "--world", "2", "--output", url, env=env, expect=0)
    assert f"wrote {url}" in proc.stdout
    plan = json.loads(s3_server.filesystem().cat(f"{BUCKET}/plans/plan.json"))
    assert plan["world_size"] == 2 and plan["fits"] is True
    s3_server.filesystem().pipe(f"{BUCKET}/plans/notes.json", b'{"mine": 1}')
    notes = s3_server.url("plans/notes.json")
    proc = run_ember("plan", "debug", "micro_batch_size=4", "--world", "2", "--output", notes, env=env, expect=2)
    assert "is not a plan.json ember wrote" in proc.stderr
    assert s3_server.filesystem().cat(f"{BUCKET}/plans/notes.json") == b'{"mine": 1}'
