"""eval.json, the report `ember eval` writes beside a model ({model, step, results}): where it goes, what an
existing one holds (refused when it is another model's or not an eval.json), and this run's results merged
into it per task."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from ember.errors import ConfigError, first_error_line


def eval_json_target(path: Path, output: Optional[str]) -> Path:
    """Where eval.json goes: --output, else beside the model (eval_json_path)."""
    return Path(output) if output else eval_json_path(path)


def read_previous(target: Path, path: Path) -> dict[str, Any]:
    """What `target` already holds ({model, step, results}; {} when absent), to merge this run's results into.
    eval.json in the model's own place (the checkpoint, the HF directory, FILE.eval.json) is the model's by
    construction, wherever the model was when it was written (a run moved or copied since); any other file must
    be an eval.json of this model and step, else it is refused rather than overwritten."""
    if not target.exists():
        return {}
    try:
        previous = json.loads(target.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{target} exists and is not an eval.json ember can add to ({first_error_line(err)}); "
                          "move it aside or pass another --output") from None
    if not isinstance(previous, dict) or not isinstance(previous.get("results"), dict):
        raise ConfigError(f"{target} exists and is not an eval.json ({{model, step, results}}); move it aside or "
                          "pass another --output")
    own = eval_json_path(path.resolve()).resolve()
    if target.resolve() == own:
        return previous
    theirs = Path(str(previous.get("model", "")))
    same = previous.get("step") == step_of(path) and (
        theirs.exists() and eval_json_path(theirs.resolve()).resolve() == own)
    if not same:
        raise ConfigError(f"{target} holds results of another model ({previous.get('model')}, step "
                          f"{previous.get('step')}); pass another --output or move it aside")
    return previous


def write_results(path: Path, results: dict[str, dict], target: Path) -> None:
    """Merge `results` into eval.json ({model, step, results}) at `target`: each task's entry replaces that
    task's earlier one, the other tasks' stay. Then print this run's table."""
    before = read_previous(target, path)
    previous = before.get("results", {})
    merged = {**previous, **results}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")  # replaced whole: a crash mid-write keeps the earlier file
    # the model's absolute path: a later eval from another directory still recognises it
    report = {"model": os.path.abspath(path), "step": step_of(path), "results": merged}
    if previous and before.get("model") != report["model"]:
        print(f"{target} was written for the model at {before.get('model')}; it is now at {report['model']}")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, target)
    for task, metrics in results.items():
        print(f"{task:<16}" + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in metrics.items()))
    kept = [task for task in previous if task not in results]
    print(f"wrote {target}" + (f" (kept the earlier {', '.join(kept)})" if kept else ""))


def step_of(path: Path) -> Optional[int]:
    from ember.model_io.model_meta import MODEL_JSON

    if path.is_dir() and (path / "checkpoints").is_dir():
        steps = sorted(int(p.parent.name[5:]) for p in path.glob(f"checkpoints/step-*/{MODEL_JSON}"))
        return steps[-1] if steps else None
    return int(path.name[5:]) if path.name.startswith("step-") and path.name[5:].isdigit() else None


def eval_json_path(path: Path) -> Path:
    """eval.json beside the model: in the checkpoint (a run's newest), the HF directory, or FILE.eval.json."""
    if path.is_file():
        return path.with_name(path.name + ".eval.json")
    step = step_of(path)
    if step is not None and (path / "checkpoints").is_dir():
        return path / "checkpoints" / f"step-{step}" / "eval.json"
    return path / "eval.json"
