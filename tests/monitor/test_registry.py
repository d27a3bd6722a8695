"""Tests for sinks built by name from the monitor config (RunLogger.from_config)."""

import io
import json
import socket
import sys
import urllib.request
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from honing.errors import ConfigError
from honing.monitor import RunLogger
from honing.monitor.console import ConsoleSink
from honing.monitor.registry import (
    SINKS,
    SinkContext,
    SinkPlugin,
    build_sinks,
    check_sinks,
    enabled_sinks,
    register_sink,
)
from honing.monitor.tensorboard_sink import TensorBoardSink
from honing.services.process import free_port


@dataclass(frozen=True)
class Monitor:
    """The monitor section with the keys the registry reads."""

    console: bool = False
    tensorboard: bool = False
    prometheus_port: int = 0
    prometheus_host: str = "127.0.0.1"
    wandb_project: str = ""
    mlflow_tracking_uri: str = ""


def context(tmp_path, **options):
    return SinkContext(tmp_path, 10, Monitor(**options), io.StringIO())


def test_each_switch_enables_its_sink(tmp_path):
    def names(**options):
        return [plugin.name for plugin in enabled_sinks(context(tmp_path, **options))]

    assert names() == []
    assert names(console=True, tensorboard=True) == ["console", "tensorboard"]
    assert names(prometheus_port=9464) == ["prometheus"]
    assert names(wandb_project="p", mlflow_tracking_uri="file:x") == ["wandb", "mlflow"]


def test_a_section_without_the_new_keys_gets_the_old_defaults(tmp_path):
    old = SimpleNamespace(console=True, tensorboard=False)
    assert [p.name for p in enabled_sinks(SinkContext(tmp_path, 5, old))] == ["console"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"wandb_project": "p"}, "monitor.wandb_project is set but wandb is not installed: "),
        ({"mlflow_tracking_uri": "u"}, "monitor.mlflow_tracking_uri is set but mlflow is not "),
    ],
)
def test_configured_but_not_installed_fails_before_building(
    monkeypatch, tmp_path, options, message
):
    package = next(iter(options)).split("_")[0]
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ConfigError, match=message + f".*pip install {package}$"):
        check_sinks(context(tmp_path, console=True, **options))
    with pytest.raises(ConfigError):
        RunLogger.from_config(tmp_path / "run", Monitor(**options), total_steps=3)
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_a_failing_sink_closes_those_built_before_it(tmp_path):
    port = free_port()
    closed = []

    class Closing:
        def write(self, step, metrics):
            pass

        def close(self):
            closed.append(True)

    def broken(ctx):
        raise ConfigError("monitor.broken: cannot start")

    register_sink(SinkPlugin("closing", "monitor.closing", lambda c: True, lambda c: Closing()))
    register_sink(SinkPlugin("broken", "monitor.broken", lambda c: True, broken))
    try:
        with pytest.raises(ConfigError, match="cannot start"):
            build_sinks(context(tmp_path, prometheus_port=port))
    finally:
        del SINKS["closing"], SINKS["broken"]
    assert closed == [True]
    with socket.socket() as probe:  # the Prometheus sink built first released its port
        probe.bind(("127.0.0.1", port))


def test_run_logger_from_config_fans_out_to_every_sink(tmp_path):
    port = free_port()
    stream = io.StringIO()
    monitor = Monitor(console=True, tensorboard=True, prometheus_port=port)
    with RunLogger.from_config(tmp_path, monitor, total_steps=4, stream=stream) as logger:
        kinds = [type(sink).__name__ for sink in logger.sinks]
        assert kinds == ["JsonlSink", "ConsoleSink", "TensorBoardSink", "PrometheusSink"]
        logger.log_histograms(1, {"response_length": [1, 2, 2, 4]})
        logger.log_metrics(1, {"critic/score/mean": 0.5})
        logger.log_event("alert", rule="entropy_low")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            scraped = response.read().decode()

    assert "honing_critic_score_mean 0.5\n" in scraped and "honing_step 1.0\n" in scraped
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["critic/score/mean"] == 0.5
    assert "step 1/4" in stream.getvalue() and "[alert] rule=entropy_low" in stream.getvalue()
    assert any((tmp_path / "tensorboard").iterdir())
    assert isinstance(logger.sinks[1], ConsoleSink) and isinstance(logger.sinks[2], TensorBoardSink)
