"""Sinks as plugins: each one registered by name, switched on by its own config keys.

    monitor.console: true              ConsoleSink      progress bar + per-step line
    monitor.tensorboard: true          TensorBoardSink  RUN_DIR/tensorboard (+ histograms)
    monitor.prometheus_port: 9464      PrometheusSink   http://prometheus_host:port/metrics
    monitor.wandb_project: my-proj     WandbSink        (pip install wandb)
    monitor.mlflow_tracking_uri: ...   MlflowSink       (pip install mlflow)

``metrics.jsonl`` is not a plugin: the run directory always has it. A new destination is
one class with ``write``/``close`` (see ``honing.monitor.sinks.MetricSink``) and one
``register_sink`` call. Config values are read by attribute with a default, so any object
with the keys it sets works as the monitor section.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from honing.errors import ConfigError
from honing.monitor.sinks import MetricSink

TENSORBOARD_DIR = "tensorboard"


@dataclass(frozen=True)
class SinkContext:
    """What a sink may need to build itself.

    Attributes:
        run_dir: The run directory.
        total_steps: Last step of the run.
        monitor: The ``monitor`` config section (read by attribute).
        stream: Console stream; ``None`` means ``sys.stderr``.
        params: The resolved config as nested dicts, for remote trackers' run parameters.
    """

    run_dir: Path
    total_steps: int
    monitor: Any
    stream: TextIO | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def option(self, key: str, default: Any) -> Any:
        """``monitor.<key>``, or ``default`` when the section has no such key."""
        return getattr(self.monitor, key, default)


@dataclass(frozen=True)
class SinkPlugin:
    """A registered sink.

    Attributes:
        name: Registry name.
        key: The config key that switches it on (named in errors).
        enabled: Sink context -> whether the config switches this sink on.
        build: Builds the sink.
        module: Import name of the optional package it needs ("" = none).
        pip_name: What to ``pip install`` for it.
    """

    name: str
    key: str
    enabled: Callable[[SinkContext], bool]
    build: Callable[[SinkContext], MetricSink]
    module: str = ""
    pip_name: str = ""


SINKS: dict[str, SinkPlugin] = {}


def register_sink(plugin: SinkPlugin) -> SinkPlugin:
    """Adds (or replaces) a sink under ``plugin.name``; sinks are built in registration order."""
    SINKS[plugin.name] = plugin
    return plugin


def enabled_sinks(context: SinkContext) -> list[SinkPlugin]:
    """The registered sinks the config switches on, in registration order."""
    return [plugin for plugin in SINKS.values() if plugin.enabled(context)]


def check_sinks(context: SinkContext) -> None:
    """Fails fast, before anything is written, when a configured sink's package is missing.

    Raises:
        ConfigError: Naming the config key and the pip package.
    """
    for plugin in enabled_sinks(context):
        if plugin.module and importlib.util.find_spec(plugin.module) is None:
            raise ConfigError(
                f"{plugin.key} is set but {plugin.module} is not installed: "
                f"pip install {plugin.pip_name or plugin.module}"
            )


def build_sinks(context: SinkContext) -> list[MetricSink]:
    """Builds every enabled sink; if one fails, those already built are closed first.

    Raises:
        ConfigError: A package is missing, or a sink's settings cannot be honoured (e.g.
            the Prometheus port is taken).
    """
    check_sinks(context)
    built: list[MetricSink] = []
    try:
        for plugin in enabled_sinks(context):
            built.append(plugin.build(context))
    except BaseException:
        for sink in reversed(built):
            sink.close()
        raise
    return built


def _console(context: SinkContext) -> MetricSink:
    from honing.monitor.console import ConsoleSink

    return ConsoleSink(context.total_steps, stream=context.stream)


def _tensorboard(context: SinkContext) -> MetricSink:
    from honing.monitor.tensorboard_sink import TensorBoardSink

    return TensorBoardSink(context.run_dir / TENSORBOARD_DIR)


def _prometheus(context: SinkContext) -> MetricSink:
    from honing.monitor.prometheus import PrometheusSink

    port = context.option("prometheus_port", 0)
    return PrometheusSink(port, host=context.option("prometheus_host", "127.0.0.1"))


def _wandb(context: SinkContext) -> MetricSink:
    from honing.monitor.integrations import WandbSink

    return WandbSink(
        context.option("wandb_project", ""),
        run_dir=context.run_dir,
        entity=context.option("wandb_entity", ""),
        params=context.params,
    )


def _mlflow(context: SinkContext) -> MetricSink:
    from honing.monitor.integrations import MlflowSink

    return MlflowSink(
        context.option("mlflow_tracking_uri", ""),
        experiment=context.option("mlflow_experiment", "honing"),
        run_dir=context.run_dir,
        params=context.params,
    )


register_sink(
    SinkPlugin("console", "monitor.console", lambda c: c.option("console", True), _console)
)
register_sink(
    SinkPlugin(
        "tensorboard", "monitor.tensorboard", lambda c: c.option("tensorboard", True), _tensorboard
    )
)
register_sink(
    SinkPlugin(
        "prometheus",
        "monitor.prometheus_port",
        lambda c: c.option("prometheus_port", 0) > 0,
        _prometheus,
    )
)
register_sink(
    SinkPlugin(
        "wandb",
        "monitor.wandb_project",
        lambda c: bool(c.option("wandb_project", "")),
        _wandb,
        module="wandb",
        pip_name="wandb",
    )
)
register_sink(
    SinkPlugin(
        "mlflow",
        "monitor.mlflow_tracking_uri",
        lambda c: bool(c.option("mlflow_tracking_uri", "")),
        _mlflow,
        module="mlflow",
        pip_name="mlflow",
    )
)
