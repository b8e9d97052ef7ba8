"""The trainer end to end: the loss falls, runs repeat exactly, the CLI writes its files."""

import math
from pathlib import Path

import pytest
import torch

from ember.train import run as run_lib
from ember.train.trainer import Trainer
from tests.helpers import read_records, run_ember

# A smaller cut of the debug recipe so each case takes seconds on two cores.
SMALL = ["model.n_layers=2", "seq_len=128", "global_batch_size=8", "micro_batch_size=4", "logging_steps=5"]
REQUIRED_KEYS = {
    "step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device",
    "step_time_s", "tflops_per_device", "mfu", "memory_gb",
}


def _train(tmp_path: Path, *overrides: str) -> tuple[Trainer, dict, list[dict]]:
    cfg = run_lib.load_config("debug", SMALL + [f"output_dir={tmp_path}", "metrics.console=false", *overrides])
    trainer = Trainer(cfg)
    summary = trainer.train()
    return trainer, summary, read_records(tmp_path)


@pytest.mark.slow
def test_debug_loss_falls(tmp_path: Path):
    # 60 steps of 1k tokens from a near-uniform start (ln 8192 = 9.01): the loss must drop by 2.5 nats.
    trainer, summary, records = _train(tmp_path, "max_steps=60", "schedule.warmup_steps=5")
    assert summary["first_loss"] == pytest.approx(math.log(8192), abs=0.6)
    assert summary["final_loss_avg"] < summary["first_loss"] - 2.5
    assert summary["val_loss"] < summary["first_loss"] - 2.0
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(5, 61, 5))
    for record in train_records:
        assert REQUIRED_KEYS <= record.keys()
        # 8 sequences of 128 tokens a step (SMALL), over the window's mean step time
        assert record["tokens_per_s"] == pytest.approx(8 * 128 / record["step_time_s"], rel=1e-9)
        # MFU is the step's model FLOP rate over the peak the run divides by, the one its header names
        # (tests/metrics/test_mfu.py checks a run against the measured peak itself; the FLOP formula is pinned
        # by hand-computed counts in test_flops.py).
        assert record["mfu"] == pytest.approx(record["tflops_per_device"] * 1e12 / trainer.peak.value_flops,
                                              rel=1e-12)
        assert record["tflops_per_device"] == pytest.approx(
            record["tokens_per_s_per_device"] * trainer.spec.flops_per_token / 1e12, rel=1e-9
        )


@pytest.mark.slow
def test_same_seed_same_losses_and_gradient_accumulation(tmp_path: Path):
    _, _, a = _train(tmp_path / "a", "max_steps=6", "logging_steps=1")
    _, _, b = _train(tmp_path / "b", "max_steps=6", "logging_steps=1")
    losses_a = [r["loss"] for r in a if "loss" in r]
    assert losses_a == [r["loss"] for r in b if "loss" in r]
    assert [r["grad_norm"] for r in a if "loss" in r] == [r["grad_norm"] for r in b if "loss" in r]
    # One micro-batch of 8 or two of 4: the same global-batch mean, up to fp32 summation order.
    _, _, c = _train(tmp_path / "c", "max_steps=6", "logging_steps=1", "micro_batch_size=8")
    assert [r["loss"] for r in c if "loss" in r] == pytest.approx(losses_a, rel=1e-5)


def test_loss_is_global_token_mean_with_masked_labels(tmp_path: Path):
    cfg = run_lib.load_config("debug", SMALL + [f"output_dir={tmp_path}", "metrics.console=false", "max_steps=2"])
    trainer = Trainer(cfg)
    torch.manual_seed(0)
    inputs = torch.randint(0, 8192, (2, 4, 16))
    labels = torch.randint(0, 8192, (2, 4, 16))
    labels[0, :, :10] = -100  # micro-batch 0 has far fewer target tokens than micro-batch 1
    with torch.no_grad():
        logits = torch.cat([trainer.model(inputs[i]) for i in range(2)])
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss, _ = trainer.train_step([(inputs[0], labels[0]), (inputs[1], labels[1])])
    assert loss == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.slow
def test_cli_end_to_end_writes_config_and_metrics(tmp_path: Path):
    out = tmp_path / "run"
    proc = run_ember("train", "debug", *SMALL, "max_steps=10", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: 10 steps" in proc.stdout
    records = read_records(out)
    assert REQUIRED_KEYS <= records[0].keys()
    assert list((out / "tb").glob("events.out.tfevents.*"))
    saved = run_lib.load_config(str(out / "config.yaml"))
    assert saved.max_steps == 10 and saved.model.n_layers == 2 and saved.output_dir == str(out)
    # The saved config repeats the run exactly.
    again = run_ember("train", str(out / "config.yaml"), f"output_dir={tmp_path / 'again'}")
    assert again.returncode == 0, again.stderr[-2000:]
    repeat = read_records(tmp_path / "again")
    assert [r.get("loss") for r in repeat] == [r.get("loss") for r in records]
    # The final checkpoint loads through the public API and predicts like the trained model.
    from ember import load_model

    model = load_model(str(out))
    logits = model(torch.randint(0, 8192, (1, 16)))
    assert logits.shape == (1, 16, 8192) and torch.isfinite(logits).all()


@pytest.mark.slow
def test_synthetic_dataset_trains_without_tokenizer(tmp_path: Path):
    trainer, summary, _ = _train(tmp_path, "max_steps=3", "data.dataset=synthetic")
    assert trainer.tokenizer is None and summary["steps"] == 3


@pytest.mark.slow
def test_eval_interval_runs_on_its_own_cadence(tmp_path: Path):
    # eval_interval=2 with logging every 3 steps: validation at step 2 (and 4), then the final one at 5.
    _, summary, records = _train(tmp_path, "max_steps=5", "logging_steps=3", "eval_interval=2", "eval_batches=2")
    val_steps = [r["step"] for r in records if "val_loss" in r]
    assert val_steps == [2, 4, 5]
    assert [r["step"] for r in records if "loss" in r] == [3, 5]
    assert all(math.isfinite(r["val_loss"]) for r in records if "val_loss" in r)
