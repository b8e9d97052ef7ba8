"""A resume continues the same run: keys of what the run is (model, data, seed, ...) are refused when changed,
naming each key and both values, unless resume_allow_changes names them; the other keys may change, are
printed and recorded; config.yaml is the latest segment's and config_history/ keeps every segment's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from ember import config as config_lib
from ember.checkpoint import run_history
from ember.config import ConfigError
from ember.report.runs import read_run
from ember.train import run as run_lib
from ember.train.optim import lr_multiplier
from ember.train.trainer import Trainer
from tests.helpers import read_records, run_ember, tiny_model

TINY = ["debug", *tiny_model(2), "seq_len=32", "global_batch_size=4", "micro_batch_size=2", "logging_steps=1",
        "checkpoint.interval=2", "eval_batches=1", "optim.lr=0.002"]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog."}) + "\n"
                            for i in range(200)))
    return path


def _segments(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "config_history").iterdir())


@pytest.mark.slow
def test_a_changed_data_source_or_seed_is_refused_naming_each_key(tmp_path: Path, corpus: Path):
    out = tmp_path / "run"
    first = run_ember("train", *TINY, f"data.dataset={corpus}", "max_steps=2", f"output_dir={out}")
    assert first.returncode == 0, first.stderr
    config_before = (out / "config.yaml").read_bytes()
    proc = run_ember("train", *TINY, "data.dataset=synthetic", "seed=7", "max_steps=4", f"output_dir={out}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    step_dir = out / "checkpoints" / "step-2"
    assert proc.stderr == (
        f"error: resume from {step_dir} would change what the run is: data.dataset: checkpoint {corpus}, this run "
        "synthetic; seed: checkpoint 0, this run 7. Resume with the checkpoint's values, start over with resume=none "
        "(the old run is moved aside) or a new output_dir, or make the change on purpose with "
        "resume_allow_changes=[data.dataset,seed]\n")
    # Nothing trained, nothing rewritten.
    assert (out / "config.yaml").read_bytes() == config_before
    assert not (out / "checkpoints" / "step-4").exists() and _segments(out) == ["segment-1-step-0.yaml"]


@pytest.mark.slow
def test_allowed_changes_are_printed_and_each_segment_is_kept(tmp_path: Path, corpus: Path):
    out = tmp_path / "run"
    assert run_ember("train", *TINY, f"data.dataset={corpus}", "max_steps=2", f"output_dir={out}").returncode == 0
    proc = run_ember("train", *TINY, f"data.dataset={corpus}", "max_steps=4", "optim.lr=0.001",
                     "schedule.name=constant", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert ("changed on resume, against the checkpoint's config (recorded in config_history/): max_steps: 2 -> 4; "
            "optim.lr: 0.002 -> 0.001; "
            "schedule.name: cosine -> constant\n") in proc.stdout
    # The other keys of what the run is may change when resume_allow_changes names them; said as such.
    proc = run_ember("train", *TINY, "data.dataset=synthetic", "max_steps=6", "optim.lr=0.001",
                     "schedule.name=constant", "resume_allow_changes=[data]", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert (f"changed on resume, against the checkpoint's config (recorded in config_history/): max_steps: 4 -> 6; "
            f"allowed by resume_allow_changes: data.dataset: {corpus} -> synthetic\n") in proc.stdout

    assert _segments(out) == ["segment-1-step-0.yaml", "segment-2-step-2.yaml", "segment-3-step-4.yaml"]
    history = out / "config_history"
    configs = [run_lib.load_config(str(history / name)) for name in _segments(out)]
    assert [(c.max_steps, c.optim.lr, c.schedule.name, c.data.dataset) for c in configs] == [
        (2, 0.002, "cosine", str(corpus)), (4, 0.001, "constant", str(corpus)), (6, 0.001, "constant", "synthetic")]
    header = [line for line in (history / "segment-3-step-4.yaml").read_text().splitlines() if line.startswith("#")]
    assert header[0].startswith(f"# segment 3 of {out}: started ") and header[0].endswith(" at step 4")
    assert header[1:] == [f"# resumed from {out / 'checkpoints' / 'step-4'}",
                          "# changed against the checkpoint: max_steps: 4 -> 6",
                          f"# changed against the checkpoint: data.dataset: {corpus} -> synthetic "
                          "(resume_allow_changes)"]
    # config.yaml is the latest segment's; each checkpoint holds the config that saved it.
    assert yaml.safe_load((out / "config.yaml").read_text())["max_steps"] == 6
    saved = {s: yaml.safe_load((out / "checkpoints" / f"step-{s}" / "run_config.yaml").read_text())["max_steps"]
             for s in (2, 4, 6)}
    assert saved == {2: 2, 4: 4, 6: 6}
    assert read_run(out).summary()["max_steps"] == 6  # ember report reads config.yaml as before

    # Repeating the run from its config.yaml moves the old run, its history included, aside.
    proc = run_ember("train", str(out / "config.yaml"), "resume=none")
    assert proc.returncode == 0, proc.stderr
    (previous,) = out.glob("previous-*")
    assert _segments(previous) == ["segment-1-step-0.yaml", "segment-2-step-2.yaml", "segment-3-step-4.yaml"]
    assert _segments(out) == ["segment-1-step-0.yaml"]


def test_which_keys_are_what_the_run_is():
    identity = ["seed", "task", "seq_len", "global_batch_size", "model.n_layers", "model.init_from", "data.dataset",
                "data.mixture", "data.tokenizer", "lora.rank", "dpo.beta", "optim.name"]
    may_change = ["max_steps", "logging_steps", "micro_batch_size", "optim.lr", "schedule.name", "eval.limit",
                  "eval_interval", "metrics.console", "checkpoint.interval", "profile.enabled", "ici_mesh.fsdp",
                  "parallel.loss_parallel", "precision", "model.remat", "data.num_workers", "output_dir"]
    assert [k for k in identity if not run_history.is_identity(k)] == []
    assert [k for k in may_change if run_history.is_identity(k)] == []


def test_a_key_an_older_config_lacks_counts_as_its_default():
    now = run_history.config_dict(config_lib.JobConfig())
    older = run_history.config_dict(config_lib.JobConfig())
    del older["data"]["packing"], older["resume_allow_changes"]
    assert run_history.changes(older, now) == []
    now["data"]["packing"] = False
    assert [c.describe() for c in run_history.changes(older, now)] == ["data.packing: true -> false"]


def test_values_are_shown_as_config_yaml_spells_them(tmp_path: Path):
    step_dir = tmp_path / "run" / "checkpoints" / "step-2"
    step_dir.mkdir(parents=True)
    config_lib.save(config_lib.JobConfig(), step_dir / run_history.CHECKPOINT_CONFIG)
    now = run_history.config_dict(config_lib.JobConfig())
    now["data"]["packing"], now["model"]["n_layers"] = False, 3
    with pytest.raises(run_history.RunChanged, match=r"data\.packing: checkpoint true, this run false; "
                                                     r"model\.n_layers: checkpoint null, this run 3"):
        run_history.resume_changes(step_dir, now, [], print)


def test_resume_allow_changes_names_known_keys(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"^resume_allow_changes: 'data.datset' is not a config key or section "
                                          r"\(did you mean 'data.dataset'\?\)"):
        run_lib.load_config("debug", ["resume_allow_changes=[data.datset]"])
    assert run_lib.load_config("debug", ["resume_allow_changes=[data,seed]"]).resume_allow_changes == ["data", "seed"]
    # One key needs no brackets, on the command line or in a recipe.
    assert run_lib.load_config("debug", ["resume_allow_changes=seed"]).resume_allow_changes == ["seed"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("resume_allow_changes: data.dataset\n")
    assert run_lib.load_config(str(recipe)).resume_allow_changes == ["data.dataset"]
    with pytest.raises(ConfigError, match=r"^resume_allow_changes: 'sed' is not a config key or section \(did you mean "
                                          r"'seed'\?\)"):
        run_lib.load_config("debug", ["resume_allow_changes=sed"])


def test_a_checkpoint_without_its_config_is_compared_with_the_runs(tmp_path: Path):
    """Checkpoints saved before they carried run_config.yaml: the run's config.yaml, else a note (never silence)."""
    step_dir = tmp_path / "run" / "checkpoints" / "step-2"
    step_dir.mkdir(parents=True)
    said: list[str] = []
    now = run_history.config_dict(config_lib.JobConfig(seed=1))
    assert run_history.resume_changes(step_dir, now, [], said.append) == []
    assert said == [f"note: {step_dir} records no config, so what this run changes against it cannot be checked"]
    config_lib.save(config_lib.JobConfig(), tmp_path / "run" / "config.yaml")
    with pytest.raises(run_history.RunChanged,
                       match=r"would change what the run is: seed: checkpoint 0, this run 1\. "):
        run_history.resume_changes(step_dir, now, [], said.append)
    assert [c.describe() for c in run_history.resume_changes(step_dir, now, ["seed"], said.append)] == ["seed: 0 -> 1"]


# In-process runs on synthetic data: the optimizer and schedule a resume hands to the next step.
SYNTHETIC = TINY[1:] + ["data.dataset=synthetic", "metrics.console=false", "schedule.warmup_steps=1"]


def _train(out: Path, *overrides: str) -> Trainer:
    trainer = Trainer(run_lib.load_config("debug", [*SYNTHETIC, *overrides, f"output_dir={out}"]))
    trainer.train()
    return trainer


def _logged_lr(out: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_records(out) if "lr" in r}


@pytest.mark.slow
def test_changed_optim_keys_take_effect_on_resume(tmp_path: Path):
    out = tmp_path / "run"
    _train(out, "max_steps=4")
    cfg = run_lib.load_config("debug", [*SYNTHETIC, "max_steps=6", "optim.lr=1e-3", "optim.weight_decay=0.5",
                                    "optim.betas=[0.8,0.9]", "optim.eps=1e-6", f"output_dir={out}"])
    trainer = Trainer(cfg)
    # The decay group takes the new weight decay, the no-decay group (norms, embeddings) keeps none.
    assert [(g["weight_decay"], g["betas"], g["eps"], g["initial_lr"]) for g in trainer.optimizer.param_groups] == [
        (0.5, (0.8, 0.9), 1e-6, 1e-3), (0.0, (0.8, 0.9), 1e-6, 1e-3)]
    assert trainer.lr_scheduler.base_lrs == [1e-3, 1e-3]
    trainer.train()
    lr = _logged_lr(out)
    assert [lr[s] for s in (5, 6)] == [1e-3 * lr_multiplier(s - 1, cfg.schedule, 6) for s in (5, 6)]
    assert lr[6] == pytest.approx(1e-4, rel=1e-12)  # the last step runs at min_lr_ratio x the new optim.lr


@pytest.mark.slow
def test_a_changed_schedule_applies_from_the_first_resumed_step(tmp_path: Path):
    out = tmp_path / "run"
    _train(out, "max_steps=4", "schedule.name=constant")
    assert _logged_lr(out) == {1: 1e-3, 2: 2e-3, 3: 2e-3, 4: 2e-3}  # warmup 1: lr/2, then lr
    _train(out, "max_steps=8", "schedule.name=linear")
    # linear from the end of warmup (n=1) to step 8 at 0.1 x lr: step s runs at 1 - 0.9 * (s - 1) / 7
    expected = {s: 0.002 * (1 - 0.9 * (s - 1) / 7) for s in range(5, 9)}
    lr = _logged_lr(out)
    assert {s: lr[s] for s in range(5, 9)} == pytest.approx(expected, rel=1e-12)
    assert lr[5] == pytest.approx(9.714285714285714e-4, rel=1e-12)


@pytest.mark.slow
def test_a_longer_cosine_applies_from_the_first_resumed_step(tmp_path: Path):
    out = tmp_path / "run"
    _train(out, "max_steps=4")
    _train(out, "max_steps=8")
    # cosine from n=1 over 7 steps: 0.1 + 0.45 * (1 + cos(pi * (s - 1) / 7)); step 5: 0.1 + 0.45 * (1 + cos(4pi/7))
    assert _logged_lr(out)[5] == pytest.approx(0.002 * (0.1 + 0.45 * (1 + math.cos(4 * math.pi / 7))), rel=1e-12)
    assert _logged_lr(out)[5] == pytest.approx(8.99731e-4, rel=1e-5)


@pytest.mark.slow
def test_an_unchanged_resume_continues_bit_for_bit(tmp_path: Path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    uninterrupted = _train(whole, "max_steps=4")
    _train(parts, "max_steps=4", "checkpoint.interval=2")
    resumed = Trainer(run_lib.load_config("debug", [*SYNTHETIC, "max_steps=4", f"output_dir={parts}",
                                                f"resume={parts / 'checkpoints' / 'step-2'}"]))
    saved = torch.load(parts / "checkpoints" / "step-2" / "train-rank0.pt", weights_only=True)["lr_scheduler"]
    assert [g["lr"] for g in resumed.optimizer.param_groups] == saved["_last_lr"]
    assert resumed.lr_scheduler.base_lrs == saved["base_lrs"]
    resumed.train()
    pick = lambda run: [(r["step"], r["loss"], r["lr"], r["grad_norm"])  # noqa: E731
                        for r in read_records(run) if "loss" in r]
    assert pick(parts) == pick(whole)
    assert [{k: v for k, v in g.items() if k != "params"} for g in resumed.optimizer.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in uninterrupted.optimizer.param_groups]


@pytest.mark.slow
def test_config_yaml_continues_the_run_whatever_started_it(tmp_path: Path):
    out = tmp_path / "run"
    _train(out, "max_steps=2")
    _train(out, "max_steps=2", "resume=none", "resume_allow_changes=[data]")  # the first run moved aside
    for path in (out / "config.yaml", out / "config_history" / "segment-1-step-0.yaml"):
        saved = yaml.safe_load(path.read_text())
        assert (saved["resume"], saved["resume_allow_changes"]) == ("auto", []), path
    # `ember train OUT/config.yaml` continues this run: it neither moves it aside nor starts from 0.
    trainer = Trainer(run_lib.load_config(str(out / "config.yaml"), ["max_steps=4"]))
    assert trainer.checkpointer.resumed_from == out / "checkpoints" / "step-2"
    trainer.train()
    assert (len(list(out.glob("previous-*"))) == 1
            and _segments(out) == ["segment-1-step-0.yaml", "segment-2-step-2.yaml"])
    # A run started from another run's checkpoint continues from its own after that.
    other = tmp_path / "other"
    _train(other, "max_steps=6", f"resume={out / 'checkpoints' / 'step-4'}")
    assert yaml.safe_load((other / "config.yaml").read_text())["resume"] == "auto"
    trainer = Trainer(run_lib.load_config(str(other / "config.yaml"), ["max_steps=8"]))
    assert trainer.checkpointer.resumed_from == other / "checkpoints" / "step-6"
    trainer.train_loader.close()


def test_keys_no_resume_can_change_are_never_suggested(tmp_path: Path):
    step_dir = tmp_path / "run" / "checkpoints" / "step-2"
    step_dir.mkdir(parents=True)
    config_lib.save(config_lib.JobConfig(), step_dir / run_history.CHECKPOINT_CONFIG)
    now = run_history.config_dict(config_lib.JobConfig(seed=3))
    now["lora"]["rank"] = 8
    for allowed, listed in (([], "lora.rank: checkpoint 0, this run 8; seed: checkpoint 0, this run 3"),
                            (["lora.rank", "seed"], "lora.rank: checkpoint 0, this run 8"),
                            (["lora", "seed"], "lora.rank: checkpoint 0, this run 8")):
        with pytest.raises(run_history.RunChanged) as err:
            run_history.resume_changes(step_dir, now, allowed, print)
        assert str(err.value) == (
            f"resume from {step_dir} would change what the run is: {listed}. lora.rank cannot change on resume, not "
            "even with resume_allow_changes: resume with the checkpoint's values, or start over with resume=none (the "
            "old run is moved aside) or a new output_dir")


def test_an_architecture_change_is_refused_by_config_key(tmp_path: Path):
    out = tmp_path / "run"
    _train(out, "max_steps=2")
    with pytest.raises(ConfigError) as err:
        Trainer(run_lib.load_config("debug", [*SYNTHETIC, "max_steps=4", "model.n_layers=3", f"output_dir={out}",
                                          "resume_allow_changes=[model]"]))
    assert str(err.value) == (
        f"checkpoint {out / 'checkpoints' / 'step-2'} is of another model: model.n_layers: checkpoint 2, this run 3. "
        "The model's architecture cannot change on resume, not even with resume_allow_changes: resume with the "
        "checkpoint's model config, or start over with resume=none (the old run is moved aside) or a new output_dir")


@pytest.mark.slow
def test_a_refused_resume_of_another_runs_checkpoint_leaves_this_run_as_it_was(tmp_path: Path):
    """resume=PATH starts this output_dir over from another run's checkpoint: the files of the run there are moved
    aside only once that checkpoint is checked and loaded, and the message names the resume given."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    _train(mine, "max_steps=2")
    _train(other, "max_steps=2", "model.n_layers=3")
    before = sorted(p.name for p in mine.iterdir())
    metrics = (mine / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="is of another model: model.n_layers: checkpoint 3, this run 2"):
        Trainer(run_lib.load_config("debug", [*SYNTHETIC, "max_steps=4", f"output_dir={mine}",
                                              f"resume={other / 'checkpoints' / 'step-2'}"]))
    assert sorted(p.name for p in mine.iterdir()) == before and (mine / "metrics.jsonl").read_text() == metrics
    # The other run's checkpoint is at max_steps=2 already: nothing to train, and nothing moved.
    finished = Trainer(run_lib.load_config("debug", [*SYNTHETIC, "max_steps=2", "model.n_layers=3",
                                                     f"output_dir={mine}",
                                                     f"resume={other / 'checkpoints' / 'step-2'}"]))
    assert finished.train()["steps"] == 2 and sorted(p.name for p in mine.iterdir()) == before
    trainer = Trainer(run_lib.load_config("debug", [*SYNTHETIC, "max_steps=4", "model.n_layers=3", f"output_dir={mine}",
                                                    f"resume={other / 'checkpoints' / 'step-2'}"]))
    trainer.train_loader.close()
    assert trainer.step == 2 and [p.name for p in mine.iterdir() if p.name.startswith("previous-")]


def test_an_allowed_change_never_falls_back_to_older_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "run"
    _train(out, "max_steps=4", "checkpoint.interval=2")
    step_dir = out / "checkpoints" / "step-4"
    shard = sorted(step_dir.glob("*.distcp"))[0]
    shard.unlink()
    capsys.readouterr()
    with pytest.raises(ConfigError) as err:
        Trainer(run_lib.load_config("debug", [*SYNTHETIC, "max_steps=6", "seed=1", "resume_allow_changes=seed",
                                          f"output_dir={out}"]))
    assert str(err.value) == (
        f"checkpoint {step_dir}: shard file {shard.name} is missing; with resume_allow_changes changing seed, no older "
        "checkpoint is tried: resume with the checkpoint's values (then a damaged checkpoint falls back to the one "
        "before), or start over with resume=none (the old run is moved aside) or a new output_dir")
    assert "falling back" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_finished_run_asked_again_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture):
    out = tmp_path / "run"
    _train(out, "max_steps=2")
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    capsys.readouterr()
    summary = Trainer(run_lib.load_config("debug", [*SYNTHETIC, "max_steps=2", "seed=1", "resume_allow_changes=seed",
                                                "eval_interval=1", f"output_dir={out}"])).train()
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    printed = capsys.readouterr().out
    assert ("already at step 2 of max_steps=2: nothing to train, nothing written (raise max_steps to continue, or "
            "resume=none to start over)\n") in printed
    assert "changed on resume" not in printed  # nothing was recorded: the seed change is not claimed
    assert (summary["steps"], summary["val_loss"]) == (2, None)


@pytest.mark.slow
def test_a_start_refused_before_its_first_step_leaves_no_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens: the trackers refuse to start
    out = tmp_path / "run"
    with pytest.raises(ConfigError):
        Trainer(run_lib.load_config("debug", [*SYNTHETIC, "max_steps=2", "metrics.mlflow=true",
                                              f"output_dir={out}"])).train()
    assert sorted(p.name for p in out.iterdir()) == []
    _train(out, "max_steps=2")
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(ConfigError):
        Trainer(run_lib.load_config("debug", [*SYNTHETIC, "max_steps=4", "metrics.mlflow=true",
                                              f"output_dir={out}"])).train()
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    _train(out, "max_steps=4")
    assert _segments(out) == ["segment-1-step-0.yaml", "segment-2-step-2.yaml"]
