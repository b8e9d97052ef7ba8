"""W&B (offline) and MLflow (local sqlite) round trips: what the trackers logged, read back with their own
readers, equals metrics.jsonl; no secret from the environment lands in any file; start failures are one line."""

from __future__ import annotations

import contextlib
import glob
import http.server
import io
import json
import math
import socket
import struct
import threading
from pathlib import Path

import pytest
import yaml

from ember.cli import main
from ember.config import MetricsConfig
from ember.errors import ConfigError
from ember.metrics.run_metrics import MetricsLogger
from ember.metrics.trackers import check_reachable, scalars
from ember.train import run as run_lib
from tests.helpers import read_records, tiny_model

SECRETS = {"WANDB_API_KEY": "fake-wandb-key-0123456789abcdef0123456789abcdef",
           "HF_TOKEN": "hf_fakeTokenThatMustNotLeak42"}


def _wandb_records(run_file: Path) -> list:
    """The protobuf Records of a .wandb file: wandb's LevelDB-style log (a 7-byte ':W&B' header, then 32 KiB
    blocks of chunks, each with a 7-byte checksum/length/type header), parsed with wandb's own Record type."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = run_file.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, chunks, out = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        chunks += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            out.append(record)
            chunks = b""
    return out


def _expected_by_step(rows: list[dict]) -> dict[int, dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for row in rows:
        by_step.setdefault(row["step"], {}).update(scalars(row))
    return by_step


@pytest.mark.slow
def test_wandb_offline_and_mlflow_sqlite_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, train):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")  # no metrics.wandb_project: wandb's own variable counts
    monkeypatch.delenv("WANDB_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "tracked"
    train(run, "max_steps=6", "eval_interval=4", "metrics.wandb=true", "metrics.mlflow=true",
          "metrics.wandb_tags=[tiny,test]", "metrics.wandb_group=report-tests")
    expected = _expected_by_step(read_records(run))
    config = yaml.safe_load((run / "config.yaml").read_text())

    # W&B: the history rows by step, and the run's config
    run_files = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(run_files) == 1
    logged, run_record = {}, None
    for record in _wandb_records(Path(run_files[0])):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            logged.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "run":
            run_record = record.run
    assert logged == expected and sorted(logged) == [2, 4, 6]
    assert run_record.project == "from-env" and run_record.display_name == "tracked"  # the output_dir's name
    assert list(run_record.tags) == ["tiny", "test"] and run_record.run_group == "report-tests"
    wandb_config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert {k: wandb_config[k] for k in config} == config
    assert wandb_config["run"]["mesh"] == "single device" and wandb_config["run"]["world_size"] == 1

    # MLflow: metrics through the client API, params, the config artifact
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    run_id = (run / "mlflow-run-id").read_text().strip()
    mlflow_run = client.get_run(run_id)
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "tracked"
    keys = set().union(*expected.values())
    assert set(mlflow_run.data.metrics) == keys
    for key in keys:
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert history == {step: values[key] for step, values in expected.items() if key in values}, key
    assert mlflow_run.data.params["optim.lr"] == "0.002" and mlflow_run.data.params["run.device"] == "cpu"
    assert [a.path for a in client.list_artifacts(run_id)] == ["config.yaml"]

    # No secret of the environment in anything the run wrote
    for path in run.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            for name, value in SECRETS.items():
                assert value.encode() not in data, f"{name} found in {path}"


def test_only_rank_0_starts_trackers(tmp_path: Path):
    logger = MetricsLogger(tmp_path / "rank1", MetricsConfig(wandb=True, mlflow=True), enabled=False,
                           run_info={"device": "cpu"})
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert logger._trackers is None and not (tmp_path / "rank1").exists()


def test_scalars_expand_lists_and_drop_the_rest():
    record = {"step": 3, "loss": 2.5, "mfu": None, "moe/layer0/tokens_per_expert": [3, 5], "flag": True,
              "data_position": {"epoch": 0}, "note": "x", "nan": math.nan}
    assert scalars(record) == {"loss": 2.5, "moe/layer0/tokens_per_expert/0": 3.0,
                               "moe/layer0/tokens_per_expert/1": 5.0}


def test_a_tracker_that_cannot_start_is_one_line_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture, train):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracking.example:5000")
    assert main(["train", "debug", *tiny_model(), "max_steps=3", "metrics.mlflow=true",
                 f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: metrics.mlflow: cannot start an MLflow run at nosuchscheme://") and "\n" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"metrics.wandb=true needs the wandb package: pip install '.\[wandb\]'"):
        run_lib.load_config("debug", ["metrics.wandb=true"])


def test_an_unreachable_mlflow_server_is_one_line_after_the_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    # MLflow's own client would retry for about 4 minutes; with no retries a path that skips ember's check
    # fails fast too, with MLflow's message instead of the one asserted here.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    printed = io.StringIO()  # stdout and stderr in one stream, in the order they were written
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = main(["train", "debug", *tiny_model(), "max_steps=2", "metrics.mlflow=true",
                     f"output_dir={tmp_path / 'run'}"])
    lines = printed.getvalue().splitlines()
    assert code == 2 and lines[0].startswith("ember train llama3 debug: ")
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [f"error: metrics.mlflow: the MLflow tracking server at http://127.0.0.1:{port} does not answer "
                      "([Errno 111] Connection refused; waited up to 5 s): start it, fix MLFLOW_TRACKING_URI, or "
                      "unset it to track in OUTPUT_DIR/mlflow.db"]
    assert lines[-1] == errors[0] and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_server_that_accepts_and_never_answers_is_refused_after_the_timeout():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)  # the kernel accepts the connection; nothing ever reads or answers it
        uri = f"http://user:secret@127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(ConfigError) as info:
            check_reachable(uri, timeout_s=0.5)
    assert str(info.value) == ("metrics.mlflow: the MLflow tracking server at "
                               f"http://user:***@{uri.split('@')[1]} does not answer (timed out; waited up to 0.5 s): "
                               "start it, fix MLFLOW_TRACKING_URI, or unset it to track in OUTPUT_DIR/mlflow.db")


@pytest.mark.parametrize("status, reachable", [(200, True), (404, True), (401, True), (503, False)])
def test_any_http_answer_but_a_retried_status_counts_as_reachable(status: int, reachable: bool):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: object) -> None:  # no request lines on stderr
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        uri = f"http://127.0.0.1:{server.server_address[1]}/"
        try:
            if reachable:
                check_reachable(uri)
            else:
                with pytest.raises(ConfigError, match=rf"at {uri} does not answer \(HTTP 503; waited up to 5 s\)"):
                    check_reachable(uri)
        finally:
            server.shutdown()
