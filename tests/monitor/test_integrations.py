"""Tests for the W&B and MLflow sinks, against stand-ins for the packages.

Each test injects a small stand-in module into ``sys.modules`` that records the calls a sink
makes, so these run without the packages. ``test_trackers_e2e.py`` runs the real packages
(W&B offline, an MLflow tracking server on loopback).
"""

import json
import math
import sys
import types

import pytest

from honing.errors import ConfigError
from honing.monitor import RunLogger
from honing.monitor.integrations import (
    MlflowSink,
    WandbSink,
    flatten_params,
    require_module,
    wandb_run_id,
)


class FakeWandbRun:
    def __init__(self, **init_args):
        self.init_args, self.logged, self.finished = init_args, [], False
        self.id, self.artifacts = init_args["id"], []

    def log(self, data, step):
        self.logged.append((step, data))

    def log_artifact(self, artifact):
        self.artifacts.append(artifact)

    def finish(self):
        self.finished = True


class FakeHistogram:
    def __init__(self, values):
        self.values = values


class FakeArtifact:
    def __init__(self, name, type):  # noqa: A002 (wandb's argument name)
        self.name, self.type, self.files = name, type, []

    def add_file(self, path):
        self.files.append(path)


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.runs = []
    module.Histogram = FakeHistogram
    module.Artifact = FakeArtifact

    def init(**kwargs):
        module.runs.append(FakeWandbRun(**kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


@pytest.fixture
def fake_mlflow(monkeypatch):
    module = types.ModuleType("mlflow")
    module.calls = []
    counter = iter(range(1, 100))

    def record(name):
        return lambda *args, **kwargs: module.calls.append((name, args, kwargs))

    def start_run(run_id=None, run_name=None):
        module.calls.append(("start_run", (), {"run_id": run_id, "run_name": run_name}))
        info = types.SimpleNamespace(run_id=run_id or f"run{next(counter)}")
        return types.SimpleNamespace(info=info)

    names = ("set_tracking_uri", "set_experiment", "log_params", "log_metrics", "log_artifact")
    for name in (*names, "end_run"):
        setattr(module, name, record(name))
    module.start_run = start_run
    monkeypatch.setitem(sys.modules, "mlflow", module)
    return module


@pytest.mark.parametrize(
    ("module", "key"),
    [("wandb", "monitor.wandb_project"), ("mlflow", "monitor.mlflow_tracking_uri")],
)
def test_missing_package_is_a_one_line_config_error(monkeypatch, module, key):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed, even where it is
    with pytest.raises(ConfigError) as error:
        require_module(module, module, key)
    assert str(error.value) == f"{key} is set but {module} is not installed: pip install {module}"


def test_require_module_reraises_a_broken_install(monkeypatch, tmp_path):
    (tmp_path / "brokenpkg.py").write_text("import missing_dependency_of_brokenpkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="missing_dependency_of_brokenpkg"):
        require_module("brokenpkg", "brokenpkg", "monitor.x")


def test_flatten_params():
    params = {"trainer": {"lr": 0.1, "steps": [1, 2]}, "seed": 3}
    assert flatten_params(params) == {"trainer.lr": "0.1", "trainer.steps": "[1, 2]", "seed": "3"}


def test_wandb_sink_logs_metrics_and_histograms(fake_wandb, tmp_path):
    run_dir = tmp_path / "demo"
    sink = WandbSink("proj", run_dir=run_dir, params={"trainer": {"lr": 0.1}})
    sink.write(1, {"critic/score/mean": 0.5, "note": "text"})
    sink.write_histograms(1, {"response_length": [1, 2, math.nan], "empty": [math.inf]})
    sink.close()

    (run,) = fake_wandb.runs
    assert run.init_args == {
        "project": "proj",
        "entity": None,
        "name": "demo",
        "id": wandb_run_id(run_dir),
        "resume": "allow",
        "dir": str(run_dir),
        "config": {"trainer": {"lr": 0.1}},
    }
    assert run.logged[0] == (1, {"critic/score/mean": 0.5})
    step, histograms = run.logged[1]
    assert step == 1 and list(histograms) == ["response_length"]
    assert histograms["response_length"].values == [1.0, 2.0]
    assert run.finished


def test_wandb_run_id_is_stable_per_directory(tmp_path):
    assert wandb_run_id(tmp_path / "a") == wandb_run_id(tmp_path / "x" / ".." / "a")
    assert wandb_run_id(tmp_path / "a") != wandb_run_id(tmp_path / "b")


def test_mlflow_sink_logs_and_resumes_the_same_run(fake_mlflow, tmp_path):
    sink = MlflowSink(
        "file:/tmp/mlruns", experiment="exp", run_dir=tmp_path, params={"a": {"b": 1}}
    )
    sink.write(3, {"val/pass@8": 0.5, "loss": math.nan, "note": "text"})
    sink.close()
    assert (tmp_path / "mlflow_run_id").read_text() == "run1\n"

    first = fake_mlflow.calls[:]
    assert first[0] == ("set_tracking_uri", ("file:/tmp/mlruns",), {})
    assert first[1] == ("set_experiment", ("exp",), {})
    assert first[2] == ("start_run", (), {"run_id": None, "run_name": tmp_path.name})
    assert first[3] == ("log_params", ({"a.b": "1"},), {})
    name, args, kwargs = first[4]
    assert name == "log_metrics" and kwargs == {"step": 3}
    assert list(args[0]) == ["val/pass_8", "loss"] and math.isnan(args[0]["loss"])
    assert first[5] == ("end_run", (), {})

    fake_mlflow.calls.clear()
    MlflowSink("file:/tmp/mlruns", experiment="exp", run_dir=tmp_path).close()
    assert ("start_run", (), {"run_id": "run1", "run_name": tmp_path.name}) in fake_mlflow.calls
    assert not [call for call in fake_mlflow.calls if call[0] == "log_params"]


def test_wandb_sink_logs_the_report_as_an_artifact(fake_wandb, tmp_path):
    sink = WandbSink("proj", run_dir=tmp_path)
    sink.log_report(tmp_path / "report.html")
    (artifact,) = fake_wandb.runs[0].artifacts
    assert (artifact.name, artifact.type) == (f"report-{wandb_run_id(tmp_path)}", "report")
    assert artifact.files == [str(tmp_path / "report.html")]


def test_mlflow_sink_logs_the_report_as_an_artifact(fake_mlflow, tmp_path):
    sink = MlflowSink("file:/tmp/mlruns", experiment="exp", run_dir=tmp_path)
    sink.log_report(tmp_path / "report.html")
    assert fake_mlflow.calls[-1] == ("log_artifact", (str(tmp_path / "report.html"),), {})


class ReportTaker:
    def __init__(self, fail=False):
        self.reports, self.fail = [], fail

    def write(self, step, metrics):
        pass

    def log_report(self, path):
        if self.fail:
            raise ConnectionError("tracker down")
        self.reports.append(path)

    def close(self):
        pass


QUIET = {"tensorboard": False, "console": False}


def write_page(run_dir):
    (run_dir / "report.html").write_text("<html></html>")
    return run_dir / "report.html"


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_run_logger_writes_the_report_only_for_sinks_that_keep_it(tmp_path):
    with RunLogger(tmp_path / "plain", total_steps=1, **QUIET) as logger:
        assert logger.log_report(write_page) is None
    assert not (tmp_path / "plain" / "report.html").exists()

    taker = ReportTaker()
    with RunLogger(tmp_path / "kept", total_steps=1, **QUIET, sinks=[taker]) as logger:
        path = logger.log_report(write_page)
    assert taker.reports == [path] == [tmp_path / "kept" / "report.html"]


def test_run_logger_report_failures_are_events_not_errors(tmp_path):
    down, up = ReportTaker(fail=True), ReportTaker()
    with RunLogger(tmp_path, total_steps=1, **QUIET, sinks=[down, up]) as logger:
        assert logger.log_report(write_page) == tmp_path / "report.html"

        def broken(run_dir):
            raise OSError("disk full")

        assert logger.log_report(broken) is None
    assert up.reports == [tmp_path / "report.html"]  # one tracker down does not stop the next
    failed = [event for event in events(tmp_path) if event["kind"] == "report_failed"]
    assert [(event.get("sink"), event["error"]) for event in failed] == [
        ("ReportTaker", "ConnectionError: tracker down"),
        (None, "OSError: disk full"),
    ]
