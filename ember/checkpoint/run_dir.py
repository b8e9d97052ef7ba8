"""A run's output_dir across the segments that train it: its complete checkpoints, whether a segment continues it
or starts over, what it computed in, and the files that are the run's (moved aside, never deleted, when another
run starts there). ember/checkpoint/manager.py writes and reads the checkpoints themselves."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Callable, Optional, Union

import torch.distributed as dist

from ember.checkpoint.run_history import HISTORY_DIR
from ember.model_io.model_meta import MODEL_JSON
from ember.storage.location import Location, as_path, is_url, move
from ember.storage.mirror import local_run_dir

STEP_DIR = re.compile(r"step-(\d+)")
STEP_TMP = re.compile(r"step-(\d+)\.tmp")


def complete_checkpoints(checkpoint_dir: Location) -> list[tuple[int, Location]]:
    """(step, path) of every complete checkpoint, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in checkpoint_dir.iterdir()
             if (m := STEP_DIR.fullmatch(p.name)) and (p / MODEL_JSON).is_file()]
    return sorted(found)


def newest_step(checkpoint_dir: Location) -> Optional[int]:
    """The step of the newest complete checkpoint; None without one."""
    found = complete_checkpoints(checkpoint_dir)
    return found[-1][0] if found else None


def starts_over(resume: str, output_dir: str) -> bool:
    """Whether a run begins other than from its own output_dir's checkpoints (resume=none, or another run's
    checkpoint): another run's files there are then moved aside, never mixed with this one's."""
    if resume == "auto":
        return False
    if resume == "none":
        return True
    if is_url(resume) or is_url(output_dir):
        run, given = str(output_dir).rstrip("/"), str(resume).rstrip("/")
        return given != run and not given.startswith(run + "/checkpoints/") and given != run + "/checkpoints"
    own, given = (Path(output_dir) / "checkpoints").resolve(), Path(resume).expanduser().resolve()
    return own not in given.parents and given != own.parent


def resumed_compute(resume: str, output_dir: str) -> Optional[str]:
    """What a run resuming its own checkpoints computed in (run.json's `compute`: float32, bfloat16), or None: it
    starts over, has no complete checkpoint yet, or recorded none."""
    run = as_path(output_dir)
    if starts_over(resume, output_dir) or not complete_checkpoints(run / "checkpoints"):
        return None
    try:
        compute = json.loads((run / "run.json").read_text(encoding="utf-8")).get("compute")
    except (OSError, ValueError, AttributeError):
        return None
    return compute if compute in ("float32", "bfloat16") else None


# What one run writes into its output_dir: checkpoints; metrics and run facts (metrics/run_metrics.py); its config
# and history (run_history.py); the W&B and MLflow run ids a resume logs into (metrics/trackers.py); `ember report`'s
# page and figures; profiling traces; `ember eval RUN`'s results.
RUN_FILES = ("checkpoints", "metrics.jsonl", "tb", "run.json", "config.yaml", HISTORY_DIR, "wandb-run-id",
             "mlflow-run-id", "report.html", "report", "profile", "eval.json")


def archive_previous_run(output_dir: Union[str, Path], say: Callable[[str], None],
                         reason: str = "resume=none") -> Optional[Path]:
    """Move another run's files out of `output_dir` into `output_dir/previous-<time>/`, so a run started over
    never mixes with it (and nothing is deleted): RUN_FILES. The trackers' stores (mlflow.db, mlartifacts/,
    wandb/) stay: they hold runs by id, and the old run's tracker ids go with it, so this run gets new ones.
    A remote output_dir's files are moved in its local mirror (ember/storage/mirror.py, which pushes the move),
    its checkpoints on the store. Rank 0 moves; every rank waits for it. Returns the folder, or None if there was
    nothing to move."""
    output_dir = str(output_dir)
    local = local_run_dir(output_dir)
    remote = as_path(output_dir) if is_url(output_dir) else None
    present = [local / n for n in RUN_FILES if (local / n).exists()]
    if remote is not None and (remote / "checkpoints").exists():
        present.append(remote / "checkpoints")
    target: Optional[Path] = None
    if present and any(p.name != "config.yaml" for p in present):
        target = local / time.strftime("previous-%Y%m%d-%H%M%S")
        if not dist.is_initialized() or dist.get_rank() == 0:
            suffix = 1
            while target.exists():
                target, suffix = local / time.strftime(f"previous-%Y%m%d-%H%M%S-{suffix}"), suffix + 1
            target.mkdir(parents=True)
            for path in present:
                if isinstance(path, Path):
                    os.replace(path, target / path.name)
                else:  # a remote run's checkpoints, moved on the store beside the mirror's moved files
                    move(path, remote / target.name / path.name)
            say(f"started over ({reason}): the previous run's {', '.join(p.name for p in present)} "
                f"moved to {target if remote is None else remote / target.name}")
    if dist.is_initialized():
        dist.barrier()
    return target
