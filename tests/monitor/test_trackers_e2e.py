"""W&B (offline) and MLflow (a tracking server on loopback) fed by real short honing runs.

Each run is a 3-step ``honing train`` of the micro model with one tracker switched on. What
arrived is read back with the tracker's own reader: the W&B run's transaction log with
``wandb leet inspect --json`` (wandb's record reader), the MLflow run with ``MlflowClient``
over the server's REST API. Each figure is compared with the run's own ``metrics.jsonl``,
``config.yaml`` and ``report.html``.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from honing.monitor.integrations import MLFLOW_RUN_ID_FILE, flatten_params, wandb_run_id
from honing.monitor.registry import SINKS, SinkPlugin
from honing.services.process import free_port
from tests.monitor._runs import logged, train

pytestmark = pytest.mark.slow
STEPS = 3
METRIC = "critic/score/mean"


# -- Weights & Biases, offline -------------------------------------------------------------


@pytest.fixture(scope="module")
def wandb_run(micro_model_dir, digit_reward, tmp_path_factory):
    """The run directory of a finished run logged to W&B in offline mode."""
    import wandb  # the dev extra has it: a missing package fails, it does not skip

    root = tmp_path_factory.mktemp("wandb")
    environment = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",  # leave pytest's capture of stdout alone
        **{f"WANDB_{kind}_DIR": str(root / kind.lower()) for kind in ("CONFIG", "CACHE", "DATA")},
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in environment.items():
            patch.setenv(key, value)
        status = train(micro_model_dir, digit_reward, root / "run", "monitor.wandb_project=honing")
        wandb.teardown()  # stops the wandb-core service this process started
    assert status == 0
    return root / "run"


def without_empty(tree: dict) -> dict:
    """``tree`` without its empty mappings (``reward.routes: {}``), which W&B does not keep."""
    return {
        key: without_empty(value) if isinstance(value, dict) else value
        for key, value in tree.items()
        if value != {}
    }


def inspect(log: Path, *flags: str) -> str:
    """``wandb leet inspect --json [flags] LOG``: wandb's reader of its transaction log."""
    cli = Path(sys.executable).with_name("wandb")
    result = subprocess.run(
        [str(cli), "leet", "inspect", "--json", *flags, str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


@pytest.fixture(scope="module")
def wandb_log(wandb_run):
    """The run's records (``type`` -> list) and summary, as wandb reads them back."""
    (log,) = (wandb_run / "wandb").glob("offline-run-*/run-*.wandb")
    records: dict[str, list[dict]] = {}
    for line in inspect(log).splitlines():
        record = json.loads(line)
        records.setdefault(record["type"], []).append(record[record["type"]])
    return records, json.loads(inspect(log, "--summary"))


def test_wandb_offline_run_holds_every_step_and_the_config(wandb_run, wandb_log):
    records, summary = wandb_log
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert summary["run_id"] == wandb_run_id(wandb_run)
    assert (summary["project"], summary["name"]) == ("honing", wandb_run.name)

    history = {item["step"]["num"]: item["item"] for item in records["history"]}
    expected = logged(wandb_run, METRIC)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert {step: history[step][METRIC] for step in expected} == pytest.approx(expected)
    assert summary["summary"][METRIC] == pytest.approx(expected[STEPS])
    # each step's histograms (flattened by wandb: name._type, name.values = counts, name.bins)
    trained, generated = (
        logged(wandb_run, "samples/trained"),
        logged(wandb_run, "samples/generated"),
    )
    for step in expected:
        assert history[step]["critic/score._type"] == "histogram"
        assert sum(history[step]["critic/score.values"]) == trained[step]
        assert sum(history[step]["response_length.values"]) == generated[step]

    resolved = yaml.safe_load((wandb_run / "config.yaml").read_text())
    assert summary["config"] == without_empty(resolved)  # the whole resolved config, nested
    assert summary["config"]["trainer"]["total_steps"] == STEPS


def test_wandb_offline_run_keeps_the_report_as_an_artifact(wandb_run, wandb_log):
    records, _ = wandb_log
    (artifact,) = records["artifact"]
    assert (artifact["type"], artifact["name"]) == ("report", f"report-{wandb_run_id(wandb_run)}")
    (entry,) = artifact["manifest"]["contents"]
    report = wandb_run / "report.html"
    assert entry["path"] == "report.html"
    assert int(entry["size"]) == report.stat().st_size
    staged = Path(entry["local_path"])  # the copy `wandb sync` uploads
    assert staged.read_bytes() == report.read_bytes()
    assert b"honing run:" in staged.read_bytes()


# -- MLflow, a tracking server on loopback -------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on a free loopback port (SQLite store, proxied artifacts); killed
    after the module. Yields ``(process, url, log_path)`` as soon as it is started: it boots
    (8-15 s on 2 cores) while the module's first tests run; ``wait_healthy`` waits for it."""
    assert importlib.util.find_spec("mlflow"), "mlflow is in the dev extra"
    root = tmp_path_factory.mktemp("mlflow")
    port, log_path = free_port(), root / "server.log"
    command = [
        *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)),
        *("--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"),
        *("--artifacts-destination", str(root / "artifacts"), "--workers", "1"),
    ]
    # Without the job runner (MLflow's background jobs, which tracking does not use): the dev
    # extra has no huey, and the runner would restart its consumers, ~8 CPU-s per boot.
    environment = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=environment
        )
    try:
        yield process, f"http://127.0.0.1:{port}", log_path
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the server and its worker
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module", autouse=True)
def boot_mlflow_first(request):
    """Starts the MLflow server before this module's first test when an MLflow test is
    selected, so that it boots while the W&B and alert runs train."""
    here = [item for item in request.session.items if item.path == request.path]
    if importlib.util.find_spec("mlflow") and any("mlflow" in item.name for item in here):
        request.getfixturevalue("mlflow_server")


def wait_healthy(process: subprocess.Popen, url: str, log_path: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"mlflow server exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass  # not listening yet
        time.sleep(0.2)
    pytest.fail(f"mlflow server not healthy after {timeout} s:\n{log_path.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def mlflow_run(mlflow_server, micro_model_dir, digit_reward, tmp_path_factory):
    """``(client, run_id, run_dir)`` of a finished run logged to the server."""
    from mlflow.tracking import MlflowClient

    process, url, log_path = mlflow_server
    wait_healthy(process, url, log_path)
    run_dir = tmp_path_factory.mktemp("mlflow-run") / "run"
    overrides = [f"monitor.mlflow_tracking_uri={url}", "monitor.mlflow_experiment=honing-e2e"]
    assert train(micro_model_dir, digit_reward, run_dir, *overrides) == 0
    run_id = (run_dir / MLFLOW_RUN_ID_FILE).read_text().strip()
    return MlflowClient(tracking_uri=url), run_id, run_dir


def test_mlflow_server_holds_the_metric_history_and_params(mlflow_run):
    client, run_id, run_dir = mlflow_run
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    assert client.get_experiment(run.info.experiment_id).name == "honing-e2e"

    history = {point.step: point.value for point in client.get_metric_history(run_id, METRIC)}
    expected = logged(run_dir, METRIC)
    assert sorted(history) == sorted(expected) == list(range(1, STEPS + 1))
    assert history == pytest.approx(expected)
    passes = logged(run_dir, "val/pass@1")  # "@" is not allowed in MLflow names: "_"
    steps = [point.step for point in client.get_metric_history(run_id, "val/pass_1")]
    assert steps == sorted(passes) == [0, STEPS]

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    params = run.data.params
    assert params == flatten_params(resolved)  # every key of the resolved config
    assert params["trainer.total_steps"] == str(STEPS)
    assert params["monitor.mlflow_experiment"] == "honing-e2e"


def test_mlflow_server_keeps_the_report_artifact(mlflow_run, tmp_path):
    client, run_id, run_dir = mlflow_run
    assert [artifact.path for artifact in client.list_artifacts(run_id)] == ["report.html"]
    downloaded = Path(client.download_artifacts(run_id, "report.html", str(tmp_path)))
    assert downloaded.read_bytes() == (run_dir / "report.html").read_bytes()
    assert b"honing run:" in downloaded.read_bytes()


# -- the report of a run an alert stopped ----------------------------------------------------


class ReportKeeper:
    """A sink that keeps files, as the W&B and MLflow sinks do."""

    def __init__(self):
        self.reports = []

    def write(self, step, metrics):
        pass

    def log_report(self, path):
        self.reports.append((path, path.read_text()))

    def close(self):
        pass


def test_a_run_stopped_by_an_alert_still_hands_over_its_report(
    micro_model_dir, digit_reward, tmp_path, monkeypatch
):
    keeper = ReportKeeper()
    plugin = SinkPlugin("keeper", "monitor.keeper", lambda context: True, lambda context: keeper)
    monkeypatch.setitem(SINKS, "keeper", plugin)
    stop = "monitor.alerts=['critic/score/mean >= 0 -> stop']"  # fires at step 1
    assert train(micro_model_dir, digit_reward, tmp_path / "run", stop) == 3
    ((path, page),) = keeper.reports
    assert path == tmp_path / "run" / "report.html"
    assert "stopped at step 1" in page
