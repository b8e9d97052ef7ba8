"""A resume continues the same run: keys of what the run is (model, data, seed, ...) are refused when changed,
naming each key and both values, unless resume_allow_changes names them; the other keys may change, are
printed and recorded; config.yaml is the latest segment's and config_history/ keeps every segment's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ember import config as config_lib
from ember import run_history
from ember.config import ConfigError
from ember.report.runs import read_run

TINY = ["debug", "model.n_layers=2", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "seq_len=32", "global_batch_size=4", "micro_batch_size=2", "logging_steps=1", "checkpoint.interval=2",
        "eval_batches=1", "optim.lr=0.002"]


def _ember(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog."}) + "\n"
                            for i in range(200)))
    return path


def _segments(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "config_history").iterdir())


def test_a_changed_data_source_or_seed_is_refused_naming_each_key(tmp_path: Path, corpus: Path):
    out = tmp_path / "run"
    first = _ember("train", *TINY, f"data.dataset={corpus}", "max_steps=2", f"output_dir={out}")
    assert first.returncode == 0, first.stderr
    config_before = (out / "config.yaml").read_bytes()
    proc = _ember("train", *TINY, "data.dataset=synthetic", "seed=7", "max_steps=4", f"output_dir={out}")
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


def test_allowed_changes_are_printed_and_each_segment_is_kept(tmp_path: Path, corpus: Path):
    out = tmp_path / "run"
    assert _ember("train", *TINY, f"data.dataset={corpus}", "max_steps=2", f"output_dir={out}").returncode == 0
    proc = _ember("train", *TINY, f"data.dataset={corpus}", "max_steps=4", "optim.lr=0.001",
                  "schedule.name=constant", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert ("changed on resume (recorded in config_history/): max_steps: 2 -> 4; optim.lr: 0.002 -> 0.001; "
            "schedule.name: cosine -> constant\n") in proc.stdout
    # The other keys of what the run is may change when resume_allow_changes names them; said as such.
    proc = _ember("train", *TINY, "data.dataset=synthetic", "max_steps=6", "optim.lr=0.001", "schedule.name=constant",
                  "resume_allow_changes=[data]", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    assert (f"changed on resume (recorded in config_history/): max_steps: 4 -> 6; allowed by resume_allow_changes: "
            f"data.dataset: {corpus} -> synthetic\n") in proc.stdout

    assert _segments(out) == ["segment-1-step-0.yaml", "segment-2-step-2.yaml", "segment-3-step-4.yaml"]
    history = out / "config_history"
    configs = [config_lib.load(str(history / name)) for name in _segments(out)]
    assert [(c.max_steps, c.optim.lr, c.schedule.name, c.data.dataset) for c in configs] == [
        (2, 0.002, "cosine", str(corpus)), (4, 0.001, "constant", str(corpus)), (6, 0.001, "constant", "synthetic")]
    header = [line for line in (history / "segment-3-step-4.yaml").read_text().splitlines() if line.startswith("#")]
    assert header[0].startswith(f"# segment 3 of {out}: started ") and header[0].endswith(" at step 4")
    assert header[1:] == [f"# resumed from {out / 'checkpoints' / 'step-4'}", "# changed: max_steps: 4 -> 6",
                          f"# changed: data.dataset: {corpus} -> synthetic (resume_allow_changes)"]
    # config.yaml is the latest segment's; each checkpoint holds the config that saved it.
    assert yaml.safe_load((out / "config.yaml").read_text())["max_steps"] == 6
    saved = {s: yaml.safe_load((out / "checkpoints" / f"step-{s}" / "run_config.yaml").read_text())["max_steps"]
             for s in (2, 4, 6)}
    assert saved == {2: 2, 4: 4, 6: 6}
    assert read_run(out).summary()["max_steps"] == 6  # ember report reads config.yaml as before

    # Repeating the run from its config.yaml moves the old run, its history included, aside.
    proc = _ember("train", str(out / "config.yaml"), "resume=none")
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
        config_lib.load("debug", ["resume_allow_changes=[data.datset]"])
    assert config_lib.load("debug", ["resume_allow_changes=[data,seed]"]).resume_allow_changes == ["data", "seed"]
    # One key needs no brackets, on the command line or in a recipe.
    assert config_lib.load("debug", ["resume_allow_changes=seed"]).resume_allow_changes == ["seed"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text("resume_allow_changes: data.dataset\n")
    assert config_lib.load(str(recipe)).resume_allow_changes == ["data.dataset"]
    with pytest.raises(ConfigError, match=r"^resume_allow_changes: 'sed' is not a config key or section \(did you mean "
                                          r"'seed'\?\)"):
        config_lib.load("debug", ["resume_allow_changes=sed"])


def test_a_checkpoint_without_its_config_is_compared_with_the_runs(tmp_path: Path):
    """Checkpoints saved before they carried run_config.yaml: the run's config.yaml, else a note (never silence)."""
    step_dir = tmp_path / "run" / "checkpoints" / "step-2"
    step_dir.mkdir(parents=True)
    said: list[str] = []
    now = run_history.config_dict(config_lib.JobConfig(seed=1))
    assert run_history.resume_changes(step_dir, now, [], said.append) == []
    assert said == [f"note: {step_dir} records no config, so what this run changes against it cannot be checked"]
    config_lib.save(config_lib.JobConfig(), tmp_path / "run" / "config.yaml")
    with pytest.raises(run_history.RunChanged, match=r"would change what the run is: seed: checkpoint 0, this run 1\. "):
        run_history.resume_changes(step_dir, now, [], said.append)
    assert [c.describe() for c in run_history.resume_changes(step_dir, now, ["seed"], said.append)] == ["seed: 0 -> 1"]
