"""Experiment trackers as metric sinks beside metrics.jsonl: Weights & Biases (metrics.wandb) and MLflow
(metrics.mlflow). MetricsLogger starts them on rank 0 only, so a tracker that cannot start (not installed,
a bad URI, no W&B login) is a one-line ConfigError before the first step; a tracker that fails later is
warned about once and dropped, and training goes on (metrics.jsonl has every record).

Credentials are never ember's business: wandb reads WANDB_API_KEY (or its netrc) itself, MLflow its
MLFLOW_TRACKING_* variables; ember passes neither, logs no environment, and shows a URI without its password.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union
from urllib.parse import urlsplit, urlunsplit

import yaml

from ember.config import dotted_keys
from ember.config_schema import MetricsConfig
from ember.errors import ConfigError, first_error_line

if TYPE_CHECKING:
    from mlflow.entities import Run


def scalars(values: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record as tracker metrics: a list of numbers (MoE tokens per expert)
    becomes key/0, key/1, ...; text, nested dicts (a spike's data position) and nulls are left out."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if key == "step":
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item):
                out[key if index is None else f"{key}/{index}"] = float(item)
    return out


def _shown_uri(uri: str) -> str:
    """A tracking URI fit for an error message: a password in it (https://user:pass@host) is left out."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{parts.hostname}"
                                     + (f":{parts.port}" if parts.port else "")))


class WandbTracker:
    """One W&B run per output_dir: its id is kept in OUTPUT_DIR/wandb-run-id, so a resumed run goes on
    logging into the same W&B run. WANDB_MODE=offline writes it under OUTPUT_DIR/wandb/ for `wandb sync`."""

    def __init__(self, cfg: MetricsConfig, output_dir: Path, config: dict[str, Any]):
        import wandb

        id_file = output_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]  # W&B's id shape
        try:
            self.run = wandb.init(
                project=cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "ember",
                entity=cfg.wandb_entity,  # None: $WANDB_ENTITY or the account's default
                name=cfg.wandb_name or os.environ.get("WANDB_NAME") or output_dir.resolve().name,
                tags=list(cfg.wandb_tags) or None, group=cfg.wandb_group, config=config, dir=str(output_dir),
                id=run_id, resume="allow", reinit="create_new",
                # console off: ember's console lines stay ember's (and no terminal output goes to W&B's files)
                settings=wandb.Settings(console="off", save_code=False, silent=True))
        except Exception as err:  # wandb.errors.UsageError (no login), CommError (no network), ...
            raise ConfigError(f"metrics.wandb: W&B did not start: {first_error_line(err)} "
                              "(offline: WANDB_MODE=offline)") from None
        id_file.write_text(run_id + "\n")

    def log(self, step: int, values: dict[str, Any]) -> None:
        numbers = scalars(values)
        if numbers:
            # W&B merges logs of one step (the train record, then validation) and ignores steps already past.
            self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """One MLflow run per output_dir (its id kept in OUTPUT_DIR/mlflow-run-id, for resumes): the flattened
    config as params, every record's numbers as metrics by step, config.yaml as an artifact.
    Tracking store: $MLFLOW_TRACKING_URI, else sqlite in OUTPUT_DIR/mlflow.db with artifacts in
    OUTPUT_DIR/mlartifacts."""

    def __init__(self, cfg: MetricsConfig, output_dir: Path, config: dict[str, Any]):
        from mlflow.tracking import MlflowClient

        output_dir = output_dir.resolve()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{output_dir / 'mlflow.db'}"
        local = "MLFLOW_TRACKING_URI" not in os.environ
        name = cfg.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ember"
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not "Creating initial MLflow database tables..."
        logging.getLogger("alembic").setLevel(logging.WARNING)
        id_file = output_dir / "mlflow-run-id"
        check_reachable(uri)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                name, artifact_location=(output_dir / "mlartifacts").as_uri() if local else None)
            run = self._existing_run(id_file)
            if run is None:
                run = self.client.create_run(experiment_id, run_name=output_dir.name,
                                             tags={"mlflow.source.name": "ember train"})
            else:
                self.client.update_run(run.info.run_id, status="RUNNING")
            self.run_id = run.info.run_id
            self._log_params(config, set(run.data.params))
            if (output_dir / "config.yaml").is_file():
                self.client.log_artifact(self.run_id, str(output_dir / "config.yaml"))
        except Exception as err:  # MlflowException, a database or network error
            raise ConfigError(f"metrics.mlflow: cannot start an MLflow run at {_shown_uri(uri)}: "
                              f"{first_error_line(err)}") from None
        id_file.write_text(self.run_id + "\n")

    def _existing_run(self, id_file: Path) -> Optional[Run]:
        if not id_file.is_file():
            return None
        try:
            return self.client.get_run(id_file.read_text().strip())
        except Exception:  # another store now (MLFLOW_TRACKING_URI changed): start a new run there
            return None

    def _log_params(self, config: dict[str, Any], present: set[str]) -> None:
        from mlflow.entities import Param

        # A resumed run keeps its first params (MLflow refuses to change one); its config.yaml artifact is the new one.
        params = [Param(_metric_key(k), str(v)[:6000]) for k, v in dotted_keys(config).items()
                  if _metric_key(k) not in present]
        for start in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, step: int, values: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_metric_key(k), v, now, step) for k, v in scalars(values).items()]
        for start in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


REACH_TIMEOUT_S = 5.0  # the bounded check before MLflow's client, which retries a dead server for minutes
_RETRIED_STATUS = (408, 429, 500, 502, 503, 504)  # the answers MLflow's client retries for minutes too


def check_reachable(uri: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """An http(s) tracking URI must answer within `timeout_s`: MLflow's client retries a refused or silent
    server 7 times with exponential backoff (about 4 minutes) before it says anything. Any HTTP answer, even
    an error status, means the server is there; only no answer at all is refused. Other schemes (sqlite,
    file, databricks) are MLflow's to check."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    import urllib.error
    import urllib.request

    # user:password@ in the URI is MLflow's to send; urllib would take it for part of the host name
    health = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2], path=parts.path.rstrip("/") + "/health"))
    try:
        with urllib.request.urlopen(health, timeout=timeout_s):
            return
    except urllib.error.HTTPError as err:
        if err.code not in _RETRIED_STATUS:  # an answer (a 404 without /health, a 401 without credentials)
            return
        reason: object = f"HTTP {err.code}"
    except (OSError, ValueError) as err:  # refused, unknown host, timed out, a malformed URI
        reason = getattr(err, "reason", err)
    shown = first_error_line(reason) if isinstance(reason, BaseException) else reason
    raise ConfigError(f"metrics.mlflow: the MLflow tracking server at {_shown_uri(uri)} does not answer ({shown}; "
                      f"waited up to {timeout_s:g} s): start it, fix MLFLOW_TRACKING_URI, or unset it to track in "
                      "OUTPUT_DIR/mlflow.db")


def _metric_key(key: str) -> str:
    """MLflow names allow letters, digits, _ - . space / only (a mixture source may be a path with other signs)."""
    return re.sub(r"[^\w\-. /]", "_", key)


class Trackers:
    """The enabled trackers of rank 0, started now with the run's resolved config (OUTPUT_DIR/config.yaml,
    which the trainer writes first) and run facts (device, mesh)."""

    def __init__(self, cfg: MetricsConfig, output_dir: Path, run_info: Optional[dict[str, Any]] = None):
        config_file = output_dir / "config.yaml"
        config = yaml.safe_load(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        config = {**(config or {}), "run": dict(run_info or {})}
        self.active: list[Union[WandbTracker, MlflowTracker]] = []
        try:
            if getattr(cfg, "wandb", False):
                self.active.append(WandbTracker(cfg, output_dir, config))
            if getattr(cfg, "mlflow", False):
                self.active.append(MlflowTracker(cfg, output_dir, config))
        except BaseException:
            self.close()  # the one that started must not stay open when the next fails
            raise

    def log(self, step: int, values: dict[str, Any]) -> None:
        for tracker in list(self.active):
            try:
                tracker.log(step, values)
            except Exception as err:  # a network blip must not end a long run: metrics.jsonl has every record
                self.active.remove(tracker)
                warnings.warn(f"{type(tracker).__name__} failed at step {step} ({first_error_line(err)}); it logs no "
                              "more in this run, metrics.jsonl goes on", stacklevel=2)

    def close(self) -> None:
        for tracker in self.active:
            tracker.close()
        self.active = []
