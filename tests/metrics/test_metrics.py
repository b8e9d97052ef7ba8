"""MFU arithmetic, memory readings, and the three sinks of MetricsLogger."""

import io
import math
import sys
import warnings

import pytest
import torch
from rich.console import Console

from ember.config import MetricsConfig
from ember.metrics import run_metrics as metrics
from ember.metrics.run_metrics import MetricsLogger, format_line, mfu, peak_memory_gb
from tests.helpers import read_records

# One record as the trainer logs it.
RECORD = {
    "step": 10,
    "loss": 7.25,
    "lr": 3e-4,
    "grad_norm": 1.5,
    "tokens_per_s": 16000.0,
    "tokens_per_s_per_device": 4000.0,
    "step_time_s": 0.25,
    "tflops_per_device": 219.5,
    "mfu": 0.2219,
    "memory_gb": 61.2,
}


def test_mfu_llama_like_by_hand():
    # Llama-3-8B-like: N = 7.0e9 non-embedding parameters, 32 layers, 32 heads of 128, seq 8192.
    # 6N = 4.2e10; 12 * 32 * 32 * 128 * 8192 = 12 * 1.073741824e9 = 1.2884901888e10
    # flops/token = 5.4884901888e10; at 4,000 tok/s per device: 2.19539607552e14 FLOP/s,
    # on an H100 SXM (989.4e12 dense bf16): 2.19539607552e14 / 9.894e14 = 0.221892...
    flops_per_token = 6 * 7.0e9 + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token == 5.4884901888e10
    assert mfu(4000.0, flops_per_token, 989.4e12) == pytest.approx(0.221892, abs=1e-6)


def test_mfu_unknown_peak_is_none():
    assert mfu(4000.0, 5e10, None) is None
    assert mfu(4000.0, 5e10, 0.0) is None


def test_peak_memory_cpu_is_process_rss():
    # This process holds torch (hundreds of MB) and is well under 1 TiB.
    assert 0.05 < peak_memory_gb(torch.device("cpu")) < 1024


def test_jsonl_lines_parse_with_the_keys_given(tmp_path):
    out = io.StringIO()
    cfg = MetricsConfig(tensorboard=False)
    with MetricsLogger(tmp_path, cfg, console=Console(file=out, width=80)) as logger:
        logger.log(10, RECORD)
        logger.log(20, {**RECORD, "step": 20, "mfu": None, "grad_norm": math.nan})
        logger.log(20, {"val_loss": 6.5})  # no "step": it is added
    lines = read_records(tmp_path)
    assert lines[0] == RECORD  # keys and values exactly as given
    assert lines[1]["mfu"] is None and lines[1]["grad_norm"] is None  # NaN is not JSON: null
    assert lines[2] == {"step": 20, "val_loss": 6.5}
    console_lines = out.getvalue().splitlines()
    assert console_lines[0] == (
        "step     10  loss 7.2500  lr 3.00e-04  gnorm 1.500  tok/s 16,000  tok/s/dev 4,000  time 0.250s  "
        "TFLOP/s/dev 220  MFU 22.2%  mem 61.20GiB"  # one line, even on an 80-column console; memory_gb is GiB
    )
    assert "MFU" not in console_lines[1]  # an unknown MFU is left out, not printed as 0
    assert console_lines[2] == "step     20  val loss 6.5000"


def test_jsonl_appends_across_loggers(tmp_path):
    # A resumed run (start_step = its checkpoint's step) continues the file; records past that step, which a
    # crashed run logged after its last checkpoint, are dropped since those steps are trained again.
    cfg = MetricsConfig(console=False, tensorboard=False)
    for start, steps in ((0, (1, 2, 3)), (2, (3, 4))):
        logger = MetricsLogger(tmp_path, cfg, start_step=start)
        for step in steps:
            logger.log(step, {"step": step, "loss": float(start)})
        logger.close()
    records = read_records(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 0.0), (2, 0.0), (3, 2.0), (4, 2.0)]


def test_tensorboard_events_written(tmp_path):
    logger = MetricsLogger(tmp_path, MetricsConfig(console=False, jsonl=False))
    logger.log(10, RECORD)
    logger.close()
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    assert not (tmp_path / "metrics.jsonl").exists()


def test_missing_tensorboard_warns_once_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    monkeypatch.setattr(metrics, "_warned_no_tensorboard", False)
    cfg = MetricsConfig(console=False)
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        MetricsLogger(tmp_path / "a", cfg).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second logger must not warn again
        logger = MetricsLogger(tmp_path / "b", cfg)
    logger.log(1, RECORD)
    logger.close()
    assert read_records(tmp_path / "b") == [RECORD]


def test_disabled_logger_writes_nothing(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path / "run", MetricsConfig(), enabled=False, console=Console(file=out))
    logger.log(10, RECORD)
    logger.close()
    assert not (tmp_path / "run").exists()
    assert out.getvalue() == ""


def test_format_line_skips_missing_and_nonfinite():
    assert format_line(3, {"loss": 2.0, "lr": math.inf}) == "step      3  loss 2.0000"


def test_format_line_shows_the_eval_tasks_results():
    line = format_line(4, {"val_loss": 3.5, "eval/lambada/acc": 0.25, "eval/lambada/ppl": 120.5, "eval/lambada/n": 3})
    assert line.endswith("eval/lambada/acc 0.2500  eval/lambada/ppl 120.5000  eval/lambada/n 3")


def test_the_header_says_when_the_embedded_bpe_is_smaller_than_the_model_vocab(tmp_path):
    from ember.hardware.peaks import PeakFlops
    from ember.train import run as run_lib
    from tests.helpers import tiny_model

    cfg = run_lib.load_config("debug", [*tiny_model(), "model.vocab_size=1000", f"output_dir={tmp_path}"])
    spec = run_lib.resolve(cfg, 1, torch.device("cpu"))
    out = io.StringIO()
    bpe = type("Bpe", (), {"vocab_size": 900})()  # what the embedded corpus gave for 1,000 asked
    metrics.print_header(Console(file=out, width=400), spec, torch.nn.Linear(2, 2), 10, bpe, PeakFlops(1e12, "test"),
                         "the embedded corpus", [None])
    assert ("note: the embedded BPE has 900 tokens, fewer than model.vocab_size=1,000: the corpus had no more merges "
            "to learn (more text gives more); the model keeps 1,000 embedding rows, 100 of them no token's "
            "(model.vocab_size=900 drops them)") in out.getvalue().splitlines()
