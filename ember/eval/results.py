"""eval.json, the report `ember eval` writes beside a model ({model, step, results}): where it goes, what an
existing one holds (refused when it is another model's or not an eval.json), and this run's results merged
into it per task. The model and eval.json may be on an object store (ember.storage.location's UPaths): read
there, merged here, and written back whole (one PUT, which a store applies whole or not at all)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from ember.errors import ConfigError, first_error_line
from ember.storage.location import Location, as_path, is_url


def eval_json_target(path: Location, output: Optional[str]) -> Location:
    """Where eval.json goes: --output (a path or a URL), else beside the model (eval_json_path)."""
    return as_path(output) if output else eval_json_path(path)


def read_previous(target: Location, path: Location) -> dict[str, Any]:
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
    own = str(_resolved(eval_json_path(_resolved(path))))
    if str(_resolved(target)) == own:
        return previous
    model = str(previous.get("model", ""))
    theirs = as_path(model) if is_url(model) else Path(model)
    same = previous.get("step") == step_of(path) and (
        theirs.exists() and str(_resolved(eval_json_path(_resolved(theirs)))) == own)
    if not same:
        raise ConfigError(f"{target} holds results of another model ({previous.get('model')}, step "
                          f"{previous.get('step')}); pass another --output or move it aside")
    return previous


def write_results(path: Location, results: dict[str, dict], target: Location) -> None:
    """Merge `results` into eval.json ({model, step, results}) at `target`: each task's entry replaces that
    task's earlier one, the other tasks' stay. Then print this run's table."""
    before = read_previous(target, path)
    previous = before.get("results", {})
    merged = {**previous, **results}
    # the model's absolute path (or its URL): a later eval from another directory still recognises it
    report = {"model": os.path.abspath(path) if isinstance(path, Path) else str(path).rstrip("/"),
              "step": step_of(path), "results": merged}
    if previous and before.get("model") != report["model"]:
        print(f"{target} was written for the model at {before.get('model')}; it is now at {report['model']}")
    text = json.dumps(report, indent=2) + "\n"
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")  # replaced whole: a crash mid-write keeps the earlier file
        tmp.write_text(text)
        os.replace(tmp, target)
    else:
        target.write_text(text)  # one object, replaced whole
    for task, metrics in results.items():
        print(f"{task:<16}" + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in metrics.items()))
    kept = [task for task in previous if task not in results]
    print(f"wrote {target}" + (f" (kept the earlier {', '.join(kept)})" if kept else ""))


def step_of(path: Location) -> Optional[int]:
    from ember.model_io.model_meta import MODEL_JSON

    if path.is_dir() and (path / "checkpoints").is_dir():
        steps = sorted(int(p.parent.name[5:]) for p in path.glob(f"checkpoints/step-*/{MODEL_JSON}"))
        return steps[-1] if steps else None
    return int(path.name[5:]) if path.name.startswith("step-") and path.name[5:].isdigit() else None


def eval_json_path(path: Location) -> Location:
    """eval.json beside the model: in the checkpoint (a run's newest), the HF directory, or FILE.eval.json."""
    if path.is_file():
        return path.with_name(path.name + ".eval.json")
    step = step_of(path)
    if step is not None and (path / "checkpoints").is_dir():
        return path / "checkpoints" / f"step-{step}" / "eval.json"
    return path / "eval.json"


def _resolved(path: Location) -> Location:
    """A location as compared: a local path resolved, a URL as it is."""
    return path.resolve() if isinstance(path, Path) else path
