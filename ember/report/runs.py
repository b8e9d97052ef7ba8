"""Reading one run directory for `ember report`: metrics.jsonl, config.yaml, run.json, checkpoints, eval.json.

A run may still be going (the last line half-written) or may have been killed and resumed (the resumed
run logs the replayed steps again), so every series keeps the *last* value logged for each step, and a
line that does not parse is skipped and named in the run's notes, never fatal.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from ember.config import dotted_keys
from ember.errors import UserFileNotFound, first_error_line
from ember.storage.location import Location, is_url

Series = tuple[list[int], list[float]]  # (steps, values), steps ascending and unique


@dataclass
class Run:
    """What one run directory holds, as read now."""

    name: str
    path: Location  # as given (a URL for a run on an object store; read from its fetch_run copy)
    # key -> {step: value}: the last value logged at each step (a resumed run's replay overwrites the first)
    values: dict[str, dict[int, Any]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # config.yaml, nested as written
    info: dict[str, Any] = field(default_factory=dict)  # run.json: device, mesh, world size, parameters
    checkpoints: list[int] = field(default_factory=list)  # committed checkpoint steps (model.json present)
    evals: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)  # step -> eval.json's results
    notes: list[str] = field(default_factory=list)  # what is missing or was skipped, said in the report

    def series(self, key: str) -> Series:
        """The numeric values of `key` by step (nulls, i.e. NaN/inf when logged, left out)."""
        points = sorted((s, v) for s, v in self.values.get(key, {}).items() if _is_number(v))
        return [s for s, _ in points], [float(v) for _, v in points]

    def steps_to_tokens(self, steps: list[int]) -> Optional[list[float]]:
        """Tokens seen at each step: every record with `tokens_seen` gives tokens per step (constant in a run)."""
        per_step = self.tokens_per_step()
        return None if per_step is None else [s * per_step for s in steps]

    def tokens_per_step(self) -> Optional[float]:
        steps, tokens = self.series("tokens_seen")
        if steps:
            return tokens[-1] / steps[-1]
        return None

    def summary(self) -> dict[str, Any]:
        """The per-run row of the report's summary table (None where the run has no such number yet)."""
        loss_steps, loss_avg = self.series("loss_avg")
        val_steps, val = self.series("val_loss")
        tps = self.series("tokens_per_s")[1]
        mfu = self.series("mfu")[1]
        steps_logged = sorted(self.values.get("step", {}))
        last_step = steps_logged[-1] if steps_logged else None
        best_val = min(zip(val, val_steps)) if val else None
        return {
            "steps": last_step,
            "max_steps": self.config.get("max_steps"),
            "tokens": (self.series("tokens_seen")[1] or [None])[-1],
            "train_time_s": self.train_time_s(),
            "final_loss": loss_avg[-1] if loss_avg else None,  # the mean over the last logging window
            "final_loss_step": loss_steps[-1] if loss_steps else None,
            "best_loss": min(loss_avg) if loss_avg else None,
            "final_val_loss": val[-1] if val else None,
            "best_val_loss": best_val[0] if best_val else None,
            "best_val_step": best_val[1] if best_val else None,
            "median_tokens_per_s": statistics.median(tps) if tps else None,
            "median_mfu": statistics.median(mfu) if mfu else None,
            # the console's `?`: some records were divided by a peak measured while the machine was busy
            "mfu_provisional": any(v is True for v in self.values.get("mfu_provisional", {}).values()),
            "model": self.model_label(),
            "mesh": self.info.get("mesh") or _mesh_from_config(self.config, self.world_size()),
            "device": self.info.get("device_name") or self.info.get("device") or self.config.get("device"),
            "checkpoints": list(self.checkpoints),
            "skipped_steps": len(self.values.get("skipped_step", {})),
            "loss_spikes": len(self.values.get("loss_spike", {})),
            # a fault-tolerant run's steps that ran without some replica groups (None: not fault-tolerant)
            "degraded_steps": len(self.values.get("replica_groups", {}))
            if (self.config.get("fault_tolerance") or {}).get("enable") else None,
        }

    def model_label(self) -> Optional[str]:
        """The model that was built, from run.json (a fine-tune's architecture is model.init_from's, whatever
        model.flavor its recipe names); None for a run without that record."""
        built = self.info.get("model")
        if not isinstance(built, dict):
            return None
        family = built.get("family")
        label = f"{family} (from {built['init_from']})" if built.get("init_from") else f"{family} {built.get('flavor')}"
        params = self.info.get("params")
        return label + (f": {params:,} params" if isinstance(params, int) else "")

    def compared_config(self) -> dict[str, Any]:
        """The dotted config keys the runs are compared by. Where run.json records the built model, its flavor
        and hyper-parameters stand for model.*: a fine-tune's config names its recipe's flavor, not what it trained."""
        flat = dotted_keys(self.config)
        built = self.info.get("model")
        if isinstance(built, dict):
            flat["model.flavor"] = built.get("flavor")
            flat.update({f"model.{key}": value for key, value in (built.get("args") or {}).items()})
        return flat

    def world_size(self) -> Optional[int]:
        """run.json's, or tokens/s over tokens/s per device (older runs without run.json)."""
        if "world_size" in self.info:
            return int(self.info["world_size"])
        total, per_device = self.series("tokens_per_s")[1], self.series("tokens_per_s_per_device")[1]
        return round(total[-1] / per_device[-1]) if total and per_device and per_device[-1] > 0 else None

    def train_time_s(self) -> Optional[float]:
        """Time inside training steps: each record's mean step time x the steps since the previous record
        (validation, checkpoints and start-up are not in it)."""
        steps, times = self.series("step_time_s")
        if not steps:
            return None
        previous = [0] + steps[:-1]
        return sum(t * (s - p) for s, p, t in zip(steps, previous, times))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mesh_from_config(config: dict[str, Any], world_size: Optional[int]) -> Optional[str]:
    """The mesh a run without run.json had, resolved from its config for the world size its records imply."""
    if world_size is None or "ici_mesh" not in config:
        return None
    from types import SimpleNamespace

    from ember.parallel.mesh_shape import MeshError, resolve_mesh

    try:
        shape = resolve_mesh(SimpleNamespace(**config["ici_mesh"]), SimpleNamespace(**config.get("dcn_mesh", {})),
                             world_size)
    except (MeshError, TypeError, KeyError):
        return None
    return shape.describe()


def read_run(path: Path, name: Optional[str] = None) -> Run:
    """Read a run directory as it is now. A path that is not a run is a one-line UserFileNotFound; a run with
    nothing logged yet, or a cut line, is read with a note saying so."""
    path = Path(path)
    if not path.is_dir():
        raise UserFileNotFound(f"no run directory at '{path}' (give an `ember train` output_dir)")
    metrics, config_file = path / "metrics.jsonl", path / "config.yaml"
    if not metrics.is_file() and not config_file.is_file():
        raise UserFileNotFound(f"'{path}' is not an ember run: it has neither metrics.jsonl nor config.yaml")
    run = Run(name=name or path.resolve().name, path=path)
    if config_file.is_file():
        try:
            run.config = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            run.notes.append(f"config.yaml does not parse ({first_error_line(err)}): no config shown")
    else:
        run.notes.append("no config.yaml: config keys, mesh and device are unknown")
    info_file = path / "run.json"
    if info_file.is_file():
        try:
            run.info = json.loads(info_file.read_text(encoding="utf-8"))
        except ValueError:
            run.notes.append("run.json does not parse: device and mesh are inferred")
    if metrics.is_file():
        _read_metrics(metrics, run)
    else:
        run.notes.append("no metrics.jsonl yet: the run has not logged a step (metrics.jsonl=false, or just started)")
    if metrics.is_file() and not run.values.get("loss"):
        run.notes.append("metrics.jsonl holds no training-loss record yet")
    _read_checkpoints(path / "checkpoints", run)
    return run


# What read_run reads of a run, and of each of its checkpoints: all fetch_run copies from an object store.
RUN_FILES = ("metrics.jsonl", "config.yaml", "run.json")
CHECKPOINT_FILES = ("model.json", "eval.json")


def fetch_run(location: Location, folder: Path) -> Path:
    """A run on an object store as read_run reads it, copied into `folder`: its metrics.jsonl, config.yaml and
    run.json, and each checkpoint's model.json and eval.json (never its weights)."""
    fs, root = location.fs, location.path.rstrip("/")
    wanted = []
    for path in fs.find(root):
        parts = path[len(root) + 1:].split("/")
        if (len(parts) == 1 and parts[0] in RUN_FILES) or (
                len(parts) == 3 and parts[0] == "checkpoints" and parts[1].startswith("step-")
                and parts[2] in CHECKPOINT_FILES):
            wanted.append("/".join(parts))
    if not {"metrics.jsonl", "config.yaml"} & set(wanted):
        raise UserFileNotFound(f"'{location}' is not an ember run: it has neither metrics.jsonl nor config.yaml")
    for relative in wanted:
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{root}/{relative}", str(folder / relative))
    return folder


def _read_metrics(path: Path, run: Run) -> None:
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    complete = lines[:-1] if lines and lines[-1] == "" else lines  # the file ends with a newline when whole
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            where = "its last line" if number == len(complete) else f"line {number}"
            run.notes.append(f"metrics.jsonl: {where} is not a whole record (a run killed mid-write?): skipped")
            continue
        for key, value in record.items():
            run.values.setdefault(key, {})[step] = value  # file order: a replayed step's later record wins


def _read_checkpoints(root: Path, run: Run) -> None:
    if not root.is_dir():
        return
    for directory in root.glob("step-*"):
        if not directory.name[5:].isdigit():
            continue
        step = int(directory.name[5:])
        if (directory / "model.json").is_file():  # written last: the checkpoint is committed
            run.checkpoints.append(step)
        eval_file = directory / "eval.json"
        if eval_file.is_file():
            try:
                run.evals[step] = json.loads(eval_file.read_text(encoding="utf-8")).get("results", {})
            except (ValueError, AttributeError):
                run.notes.append(f"{eval_file.relative_to(run.path)} does not parse: skipped")
    run.checkpoints.sort()


def unique_names(paths: list) -> list[str]:
    """Short labels for the runs: the directory names, with as many parent directories as tell them apart (a
    URL's: its bucket and prefixes)."""
    parts = [_parts(str(p)) for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]  # the same directory given twice


def _parts(path: str) -> tuple[str, ...]:
    if is_url(path):
        scheme, rest = path.split("://", 1)
        return (f"{scheme}://", *(part for part in rest.split("/") if part))
    return Path(path).resolve().parts


def config_differences(runs: list[Run]) -> dict[str, list[Any]]:
    """Dotted config keys whose values differ between the runs -> each run's value (None: the key is absent).
    output_dir is left out: every run has its own, and the table already names the runs."""
    flats = [run.compared_config() for run in runs]
    keys = sorted(set().union(*flats) - {"output_dir"})
    missing = object()
    out = {}
    for key in keys:
        values = [flat.get(key, missing) for flat in flats]
        if any(v != values[0] for v in values[1:]):
            out[key] = [None if v is missing else v for v in values]
    return out

