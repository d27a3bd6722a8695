"""Tests for the W&B and MLflow sinks.

The real packages are not installed here and their services need the network, so each test
injects a small stand-in module into ``sys.modules`` that records the calls a sink makes.
"""

import math
import sys
import types

import pytest

from honing.errors import ConfigError
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

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


class FakeHistogram:
    def __init__(self, values):
        self.values = values


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.runs = []
    module.Histogram = FakeHistogram

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

    for name in ("set_tracking_uri", "set_experiment", "log_params", "log_metrics", "end_run"):
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
