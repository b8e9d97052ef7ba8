"""A run's config across its segments: each start or resume of one output_dir is a segment.

A resume continues the same run, so the keys that say what the run is (its model, data and their order, its
objective, the tokens of a step) must not change on the way: changed, they would leave checkpoints, metrics
and config.yaml describing a run that never happened. Such a change is refused with the keys and both values,
unless `resume_allow_changes` names them. Every other key (how long, how it learns from here on, what it logs
and saves, the layout) may change; each change is printed and recorded.

What is written:
- `OUTPUT_DIR/config.yaml`: the config of the run's latest segment, with resume=auto and resume_allow_changes=[]
  (`ember train OUTPUT_DIR/config.yaml` continues the run as it is now, `... resume=none` repeats it from scratch);
- `OUTPUT_DIR/config_history/segment-N-step-S.yaml`: segment N's whole config, started at step S, a header
  comment naming its time, the checkpoint it resumed and what it changed; each is a recipe too;
- `checkpoints/step-N/run_config.yaml`: the config of the segment that saved that checkpoint, which a resume
  compares against (a checkpoint copied or resumed from another directory carries it along).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml

from ember import config as config_lib
from ember.errors import CheckpointError, first_error_line

HISTORY_DIR = "config_history"
CHECKPOINT_CONFIG = "run_config.yaml"

# What a run is. A section name covers every key in it.
IDENTITY = ("seed", "task", "seq_len", "global_batch_size", "model", "data", "lora", "dpo", "grpo", "optim.name")
# Keys inside those sections that change how the run computes, not what: memory, the loader's thread.
NOT_IDENTITY = ("model.remat", "model.remat_every", "model.scan_layers", "data.num_workers", "data.prefetch")
# Keys of what the run is that no resume can change, allowed or not: the checkpoint holds other tensors (the
# adapters' shapes and where they sit). The model's architecture is checked before these (checkpoint/manager.py).
FIXED = ("lora.rank", "lora.targets")
# How this segment was started, not what it runs.
NOT_COMPARED = ("resume", "resume_allow_changes")


class RunChanged(CheckpointError):
    """A resume that would change what the run is (model, data, seed, ...)."""


@dataclass(frozen=True)
class Change:
    key: str  # dotted, as overrides write it
    before: Any  # the checkpoint's segment
    after: Any  # this segment
    identity: bool  # a key of what the run is (allowed only by resume_allow_changes)

    def describe(self) -> str:
        return f"{self.key}: {_show(self.before)} -> {_show(self.after)}"


def _covers(name: str, key: str) -> bool:
    return key == name or key.startswith(name + ".")


def is_identity(key: str) -> bool:
    """Whether a dotted config key is part of what the run is (docs/checkpoints.md, What a resume may change)."""
    return any(_covers(n, key) for n in IDENTITY) and not any(_covers(n, key) for n in NOT_IDENTITY)


def _show(value: Any) -> str:
    """A value as config.yaml spells it: true/false and null, not Python's True/False and None."""
    return json.dumps(value) if value is None or isinstance(value, (bool, list, dict)) else str(value)


def config_dict(cfg: config_lib.JobConfig) -> dict[str, Any]:
    """The config as config.yaml holds it (nested, YAML types)."""
    return yaml.safe_load(config_lib.to_yaml(cfg))


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[Change]:
    """Each key whose value differs between two configs as config.yaml holds them. A key the older config lacks
    (written before the key existed) counts as its default; keys no longer in the schema are not compared."""
    defaults = config_lib.dotted_keys(config_dict(config_lib.JobConfig()))
    old, new = config_lib.dotted_keys(before), config_lib.dotted_keys(after)
    found = []
    for key in sorted(new):
        previous = old.get(key, defaults.get(key))
        if key not in NOT_COMPARED and previous != new[key]:
            found.append(Change(key, previous, new[key], is_identity(key)))
    return found


def resume_changes(step_dir: Path, run_config: dict[str, Any], allowed: Sequence[str],
                   say: Callable[[str], None]) -> list[Change]:
    """What this run changes against the config that saved `step_dir`; raises RunChanged, naming each key and
    both values, when a key of what the run is changed and `allowed` (resume_allow_changes) does not name it."""
    saved_file = step_dir / CHECKPOINT_CONFIG
    if not saved_file.is_file():  # a checkpoint saved before checkpoints carried their config: the run's
        saved_file = step_dir.parent.parent / "config.yaml"
    if not saved_file.is_file():
        say(f"note: {step_dir} records no config, so what this run changes against it cannot be checked")
        return []
    try:
        saved = yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{saved_file} does not parse ({first_error_line(err)}); restore it, or start "
                              "over with resume=none") from None
    found = changes(saved, run_config)
    fixed = [c for c in found if any(_covers(name, c.key) for name in FIXED)]
    refused = [c for c in found if c.identity and c not in fixed and not any(_covers(name, c.key) for name in allowed)]
    if not (fixed or refused):
        return found
    listed = "; ".join(f"{c.key}: checkpoint {_show(c.before)}, this run {_show(c.after)}" for c in fixed + refused)
    start_over = "start over with resume=none (the old run is moved aside) or a new output_dir"
    if fixed:  # suggesting resume_allow_changes would only lead to a checkpoint that cannot be loaded
        raise RunChanged(f"resume from {step_dir} would change what the run is: {listed}. "
                         f"{', '.join(c.key for c in fixed)} cannot change on resume, not even with "
                         f"resume_allow_changes: resume with the checkpoint's values, or {start_over}")
    raise RunChanged(f"resume from {step_dir} would change what the run is: {listed}. Resume with the checkpoint's "
                     f"values, {start_over}, or make the change on purpose with "
                     f"resume_allow_changes=[{','.join(c.key for c in refused)}]")


def describe_changes(found: list[Change]) -> str:
    """The console line of a resume that changed keys: against the config that saved the checkpoint, which is what
    the resumed state was trained with (an earlier segment that saved no checkpoint left nothing of its own)."""
    allowed = [c.describe() for c in found if c.identity]
    text = "; ".join(c.describe() for c in found if not c.identity)
    if allowed:
        text += ("; " if text else "") + "allowed by resume_allow_changes: " + "; ".join(allowed)
    return f"changed on resume, against the checkpoint's config (recorded in {HISTORY_DIR}/): {text}"


def record_segment(output_dir: Path, cfg: config_lib.JobConfig, start_step: int, resumed_from: Optional[Path],
                   found: list[Change]) -> Path:
    """Write config.yaml (this segment's config) and add it to config_history/; returns the history file.
    Both say resume=auto and resume_allow_changes=[]: run again, each continues the run, and a permission given
    to this resume does not carry over to the next (the header says how this segment started)."""
    cfg = dataclasses.replace(cfg, resume="auto", resume_allow_changes=[])
    history = output_dir / HISTORY_DIR
    history.mkdir(parents=True, exist_ok=True)
    numbers = [int(p.name.split("-")[1]) for p in history.glob("segment-*-step-*.yaml")
               if p.name.split("-")[1].isdigit()]
    segment = max(numbers, default=0) + 1
    header = [f"# segment {segment} of {output_dir}: "
              f"started {time.strftime('%Y-%m-%dT%H:%M:%S%z')} at step {start_step}",
              f"# resumed from {resumed_from}" if resumed_from else "# from scratch"]
    header += [f"# changed against the checkpoint: {c.describe()}" + (" (resume_allow_changes)" if c.identity else "")
               for c in sorted(found, key=lambda c: c.identity)]  # as the console line orders them
    path = history / f"segment-{segment}-step-{start_step}.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text("\n".join(header) + "\n" + config_lib.to_yaml(cfg), encoding="utf-8")
    tmp.replace(path)
    config_lib.save(cfg, output_dir / "config.yaml")
    return path


class SegmentStart:
    """A segment's files written before its first step: config.yaml and its config_history/ file (record_segment),
    then run.json (metrics/run_metrics.py). `undo` puts back what was there when the run is refused before that step (a
    tracker that cannot start), so a refused start leaves no segment that never ran."""

    KEPT = ("config.yaml", "run.json")

    def __init__(self, output_dir: Path, cfg: config_lib.JobConfig, start_step: int, resumed_from: Optional[Path],
                 found: list[Change]):
        self.output_dir = output_dir
        self.kept = {name: (output_dir / name).read_bytes() if (output_dir / name).is_file() else None
                     for name in self.KEPT}
        self.path = record_segment(output_dir, cfg, start_step, resumed_from, found)

    def undo(self) -> None:
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # config_history/ goes only if this segment was its first
            self.path.parent.rmdir()
        for name, data in self.kept.items():
            if data is None:
                (self.output_dir / name).unlink(missing_ok=True)
            else:
                (self.output_dir / name).write_bytes(data)
