"""A Prometheus endpoint on the trainer: the latest value of every metric, as gauges.

    curl http://127.0.0.1:9464/metrics
    # HELP honing_critic_score_mean critic/score/mean
    # TYPE honing_critic_score_mean gauge
    honing_critic_score_mean 0.4375
    ...
    honing_step 12
    honing_last_step_timestamp_seconds 1718000000.25

A daemon thread serves the text exposition format (version 0.0.4) with the standard
library's HTTP server, so no client library is needed. Each scrape sees the metrics of the
last finished step (the newest value of each name; a name not logged at that step keeps its
older value, e.g. ``val/accuracy`` between validations). Histograms are not exported.

Limits: plain HTTP, no authentication — it binds 127.0.0.1 unless told otherwise; expose
it through whatever guards the node. Metric names are sanitised (``critic/score/mean`` →
``honing_critic_score_mean``); two names that sanitise alike share one gauge (last wins).
"""

from __future__ import annotations

import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from honing.errors import ConfigError

PREFIX = "honing_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID = re.compile(r"[^a-zA-Z0-9_]+")


def prometheus_name(name: str) -> str:
    """Turns a metric name into a Prometheus one: ``val/pass@8`` → ``honing_val_pass_8``.

    Runs of characters outside ``[a-zA-Z0-9_]`` become one underscore; leading and trailing
    underscores are dropped; the ``honing_`` prefix also keeps a leading digit legal.
    """
    return PREFIX + _INVALID.sub("_", name).strip("_")


def format_sample(value: float) -> str:
    """A sample value as the text format writes it (``NaN``, ``+Inf``, ``-Inf`` included)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class PrometheusSink:
    """Serves the latest metrics on ``http://host:port/metrics`` from a daemon thread.

    Args:
        port: TCP port; 0 picks a free one (read it back from ``.port``). The config's
            ``monitor.prometheus_port=0`` means off, and then this sink is not built.
        host: Interface to bind; loopback by default.

    Raises:
        ConfigError: If the port cannot be bound (in use, or no permission).
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self._gauges: dict[str, tuple[str, float]] = {}  # prometheus name -> (source, value)
        self._step: int | None = None
        self._step_time = math.nan
        try:
            self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        except OSError as error:
            raise ConfigError(
                f"monitor.prometheus_port={port}: cannot listen on {host}:{port} ({error})"
            ) from None
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="honing-prometheus", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        """The scrape URL."""
        return f"http://{self.host}:{self.port}/metrics"

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Keeps the numeric metrics of ``step`` as the gauges' latest values."""
        fresh = {}
        for name, value in metrics.items():
            try:
                fresh[prometheus_name(name)] = (name, float(value))
            except (TypeError, ValueError):
                continue
        with self._lock:
            self._gauges.update(fresh)
            self._step = step
            self._step_time = time.time()

    def render(self) -> str:
        """The exposition text of the current values."""
        with self._lock:
            gauges = sorted(self._gauges.items())
            step, step_time = self._step, self._step_time
        lines = []
        for prom_name, (source, value) in gauges:
            lines += [
                f"# HELP {prom_name} {source}",
                f"# TYPE {prom_name} gauge",
                f"{prom_name} {format_sample(value)}",
            ]
        if step is not None:
            lines += [
                f"# HELP {PREFIX}step last finished training step",
                f"# TYPE {PREFIX}step gauge",
                f"{PREFIX}step {step}",
                f"# HELP {PREFIX}last_step_timestamp_seconds unix time the last step was logged",
                f"# TYPE {PREFIX}last_step_timestamp_seconds gauge",
                f"{PREFIX}last_step_timestamp_seconds {format_sample(step_time)}",
            ]
        return "".join(line + "\n" for line in lines)

    def close(self) -> None:
        """Stops serving and frees the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler_for(sink: PrometheusSink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served")
                return
            body = sink.render().encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # scrapes every few seconds would flood the console

    return Handler
