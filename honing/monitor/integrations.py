"""Weights & Biases and MLflow sinks: thin adapters, used when installed and configured.

Neither package is a dependency of honing. Configuring one that is not installed is a
``ConfigError`` naming the pip package. Each sink logs the metrics of every step (and, for
W&B, the histograms), with the run's resolved config as parameters. At the end of the run
(also one stopped by an alert or ended by an error) the run's HTML report
(``RUN_DIR/report.html``, see ``honing.monitor.report``) is handed to ``log_report``: W&B keeps
it as a ``report`` artifact named ``report-<run id>``, MLflow as the run artifact
``report.html``.

A resumed run continues the same remote run: the W&B run id is derived from the run
directory's absolute path, and the MLflow run id is kept in ``RUN_DIR/mlflow_run_id``.
Steps redone after a resume are sent again; W&B ignores steps below its last one, MLflow
keeps both values.

A full disk under a tracker's local store (MLflow's ``sqlite:`` or ``file:`` store) ends the
run with the run logger's one line (``RunLogger``), naming ``local_path``; MLflow's own log
of that error, with its traceback, is left out. W&B's local files
(``RUN_DIR/wandb``) are written by its own service process, which drops what finds no room
without a word; they share the run directory's disk, where ``metrics.jsonl`` then finds no
room either and ends the run.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from honing.errors import ConfigError
from honing.monitor.sinks import no_room, says_no_room

MLFLOW_RUN_ID_FILE = "mlflow_run_id"
# MLflow's SQL store logs each database error with its traceback before raising it
MLFLOW_STORE_LOGGER = "mlflow.store.db.utils"
_MLFLOW_INVALID = re.compile(r"[^a-zA-Z0-9_\-. :/]")


def require_module(module: str, pip_name: str, key: str) -> ModuleType:
    """Imports an optional package, or raises a one-line ``ConfigError`` naming it.

    Args:
        module: Import name, e.g. ``"wandb"``.
        pip_name: What to ``pip install``.
        key: The config key that asked for it, named in the error.

    Raises:
        ConfigError: If the package itself is missing. An ``ImportError`` raised from inside
            an installed package propagates unchanged: it is a broken install, not a typo.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise
        message = f"{key} is set but {module} is not installed: pip install {pip_name}"
        raise ConfigError(message) from None


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"trainer": {"lr": 0.1}}`` → ``{"trainer.lr": "0.1"}``: run parameters as strings."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten_params(value, prefix=f"{name}.")
        else:
            flat[name] = str(value)
    return flat


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics that are numbers, as floats (non-finite ones kept)."""
    out = {}
    for name, value in metrics.items():
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            continue
    return out


class _WithoutNoRoom(logging.Filter):
    """Drops a log record whose error says the disk is full: the run ends with its own one
    line for it, which a library's traceback would bury."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or not says_no_room(error)


_WITHOUT_NO_ROOM = _WithoutNoRoom()


def local_store(tracking_uri: str) -> Path | None:
    """The file or directory an MLflow tracking URI keeps its runs in, when it is local:
    ``sqlite:///runs.db`` (``sqlite:////abs/runs.db``), ``file:/abs/mlruns`` or a plain
    path; ``None`` for a server (``http://``, ``databricks``)."""
    if tracking_uri.startswith("sqlite:///"):
        return Path(tracking_uri.removeprefix("sqlite:///"))
    if tracking_uri.startswith("file:"):
        return Path(tracking_uri.removeprefix("file:").removeprefix("//"))
    if "://" in tracking_uri or tracking_uri == "databricks" or not tracking_uri:
        return None
    return Path(tracking_uri)


def wandb_run_id(run_dir: str | Path) -> str:
    """A stable W&B run id for a run directory, so a resumed run continues the same run."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()
    return f"honing-{digest[:16]}"


class WandbSink:
    """Logs each step's metrics (and histograms) to a Weights & Biases run.

    Args:
        project: W&B project.
        run_dir: The run directory (W&B keeps its local files in it; fixes the run id).
        entity: W&B entity (team or user); empty means the account's default.
        params: The resolved config, shown as the run's config.

    Raises:
        ConfigError: If ``wandb`` is not installed.
    """

    def __init__(
        self,
        project: str,
        *,
        run_dir: str | Path,
        entity: str = "",
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self._wandb = require_module("wandb", "wandb", "monitor.wandb_project")
        run_dir = Path(run_dir)
        self.local_path = run_dir / "wandb"  # where W&B keeps this run's files
        self._run = self._wandb.init(
            project=project,
            entity=entity or None,
            name=run_dir.name,
            id=wandb_run_id(run_dir),
            resume="allow",
            dir=str(run_dir),
            config=dict(params or {}),
        )

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Logs the numeric metrics at ``step``."""
        self._run.log(numeric(metrics), step=step)

    def write_histograms(self, step: int, histograms: Mapping[str, Sequence[float]]) -> None:
        """Logs each finite sequence as a ``wandb.Histogram`` at ``step``."""
        data = {}
        for name, values in histograms.items():
            finite = [float(v) for v in values if math.isfinite(float(v))]
            if finite:
                data[name] = self._wandb.Histogram(finite)
        if data:
            self._run.log(data, step=step)

    def log_report(self, path: Path) -> None:
        """Logs the report file as a new version of the run's ``report`` artifact.

        W&B copies the file into its staging area at once (offline too, where ``wandb sync``
        uploads it later), so rewriting the report afterwards does not change this version.
        """
        artifact = self._wandb.Artifact(f"report-{self._run.id}", type="report")
        artifact.add_file(str(path))
        self._run.log_artifact(artifact)

    def close(self) -> None:
        """Finishes the W&B run (uploads what is pending)."""
        self._run.finish()


class MlflowSink:
    """Logs each step's metrics to an MLflow run.

    Metric names keep their slashes; characters MLflow rejects (``@`` in ``val/pass@8``)
    become ``_``.

    Args:
        tracking_uri: MLflow tracking URI (``http://…``, ``file:…``, ``databricks``).
        experiment: Experiment name; created if missing.
        run_dir: The run directory (run name, and the file keeping the MLflow run id).
        params: The resolved config, logged as parameters on a new run.

    Raises:
        ConfigError: If ``mlflow`` is not installed.
        UserError: Its local store finds the disk full.
    """

    def __init__(
        self,
        tracking_uri: str,
        *,
        experiment: str,
        run_dir: str | Path,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self._mlflow = require_module("mlflow", "mlflow", "monitor.mlflow_tracking_uri")
        self.local_path = local_store(tracking_uri)  # named when it finds the disk full
        logging.getLogger(MLFLOW_STORE_LOGGER).addFilter(_WITHOUT_NO_ROOM)
        try:
            self._start(tracking_uri, experiment, Path(run_dir), params or {})
        except Exception as err:
            logging.getLogger(MLFLOW_STORE_LOGGER).removeFilter(_WITHOUT_NO_ROOM)
            if not says_no_room(err):
                raise
            raise no_room(err, self.local_path or run_dir) from None

    def _start(
        self, tracking_uri: str, experiment: str, run_dir: Path, params: Mapping[str, Any]
    ) -> None:
        self._mlflow.set_tracking_uri(tracking_uri)
        self._mlflow.set_experiment(experiment)
        id_file = run_dir / MLFLOW_RUN_ID_FILE
        previous = id_file.read_text().strip() if id_file.exists() else None
        run = self._mlflow.start_run(run_id=previous, run_name=run_dir.name)
        if previous is None:
            id_file.write_text(run.info.run_id + "\n")
            self._mlflow.log_params(flatten_params(params))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Logs the numeric metrics at ``step``."""
        named = {_MLFLOW_INVALID.sub("_", k): v for k, v in numeric(metrics).items()}
        self._mlflow.log_metrics(named, step=step)

    def log_report(self, path: Path) -> None:
        """Uploads the report file as a run artifact (at the artifact root, same name)."""
        self._mlflow.log_artifact(str(path))

    def close(self) -> None:
        """Ends the MLflow run."""
        try:
            self._mlflow.end_run()
        finally:
            logging.getLogger(MLFLOW_STORE_LOGGER).removeFilter(_WITHOUT_NO_ROOM)
