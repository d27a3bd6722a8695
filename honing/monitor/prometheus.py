"""A Prometheus endpoint on the trainer: every metric's latest value, and two histograms.

    curl http://127.0.0.1:9464/metrics
    # HELP honing_critic_score_mean critic/score/mean
    # TYPE honing_critic_score_mean gauge
    honing_critic_score_mean 0.4375
    ...
    honing_step 12.0
    honing_last_step_timestamp_seconds 1718000000.25

A daemon thread serves the text exposition format (version 0.0.4) with the standard
library's HTTP server; the text is ``prometheus_client``'s (``generate_latest`` over a
registry of this sink's own, as the services' pages are: ``honing.services.app``), so every
``HELP`` text and number is written as the format requires. Each scrape sees the metrics of the
last finished step (the newest value of each name; a name not logged at that step keeps its
older value, e.g. ``val/accuracy`` between validations).

The per-step value lists that ``RunLogger.log_histograms`` passes on (the rewards of the
trained samples, every response's length in tokens) are also served as Prometheus
histograms, counted over the whole run (cumulative, as Prometheus expects), so
``histogram_quantile`` and heatmaps work over any time window::

    # TYPE honing_critic_score histogram
    honing_critic_score_bucket{le="0.0"} 36
    ...
    honing_critic_score_bucket{le="+Inf"} 48
    honing_critic_score_sum 5.25
    honing_critic_score_count 48

Bucket bounds are fixed per name (``HISTOGRAM_BUCKETS``; a name not listed there gets
``DEFAULT_BUCKETS``). Non-finite values are left out; the counts restart from zero with the
process, which Prometheus's ``rate`` reads as a counter reset.

Limits: plain HTTP, no authentication — it binds 127.0.0.1 unless told otherwise; expose
it through whatever guards the node. Metric names are sanitised (``critic/score/mean`` →
``honing_critic_score_mean``); two names that sanitise alike share one gauge (last wins).
"""

from __future__ import annotations

import bisect
import math
import re
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample

from honing.errors import ConfigError

PREFIX = "honing_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID = re.compile(r"[^a-zA-Z0-9_]+")
DEFAULT_BUCKETS = (-1.0, -0.5, 0.0, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0)
HISTOGRAM_BUCKETS: dict[str, tuple[float, ...]] = {
    # rewards: binary 0/1 verifiers and graded [0, 1] ones, with room below and above
    "critic/score": (-1.0, -0.5, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0),
    # response lengths in tokens: powers of two, from a one-token answer to 32k
    "response_length": tuple(float(2**power) for power in range(16)),
}


def prometheus_name(name: str) -> str:
    """Turns a metric name into a Prometheus one: ``val/pass@8`` → ``honing_val_pass_8``.

    Runs of characters outside ``[a-zA-Z0-9_]`` become one underscore; leading and trailing
    underscores are dropped; the ``honing_`` prefix also keeps a leading digit legal.
    """
    return PREFIX + _INVALID.sub("_", name).strip("_")


def format_sample(value: float) -> str:
    """A number as the text format writes it (``NaN``, ``+Inf``, ``-Inf`` included): a
    histogram bucket's ``le``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    """Cumulative counts of observed values in fixed buckets, Prometheus's histogram type.

    Args:
        bounds: Upper bounds of the buckets, ascending (``+Inf`` is implied).
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket; the last is above every bound
        self.total = 0.0

    def observe(self, values: Sequence[float]) -> None:
        """Counts each finite value in the first bucket whose bound is >= it."""
        for value in values:
            value = float(value)
            if math.isfinite(value):
                self.counts[bisect.bisect_left(self.bounds, value)] += 1
                self.total += value

    def family(self, name: str, source: str) -> HistogramMetricFamily:
        """The histogram as ``prometheus_client`` writes it: a cumulative count per bound
        (``+Inf`` last), the sum and the count."""
        buckets, cumulative = [], 0
        for bound, count in zip([*self.bounds, math.inf], self.counts, strict=True):
            cumulative += count
            buckets.append((format_sample(bound), cumulative))
        documentation = f"{source} (histogram of the values of every step)"
        family = HistogramMetricFamily(name, documentation, buckets=buckets)
        # prometheus_client leaves _count and _sum out where a bucket is below zero (rewards'
        # are); the text format takes them, and histogram_quantile's users want the count
        family.samples += [
            Sample(f"{name}_count", {}, cumulative),
            Sample(f"{name}_sum", {}, self.total),
        ]
        return family


class PrometheusSink:
    """Serves the latest metrics on ``http://host:port/metrics`` from a daemon thread.

    Args:
        port: TCP port; 0 picks a free one (read it back from ``.port``). The config's
            ``monitor.prometheus_port=0`` means off, and then this sink is not built.
        host: Interface to bind; loopback by default.
        buckets: Histogram name -> bucket upper bounds, on top of ``HISTOGRAM_BUCKETS``.

    Raises:
        ConfigError: If the port cannot be bound (in use, or no permission).
    """

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        buckets: Mapping[str, Sequence[float]] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._gauges: dict[str, tuple[str, float]] = {}  # prometheus name -> (source, value)
        self._buckets = {**HISTOGRAM_BUCKETS, **(buckets or {})}
        self._histograms: dict[str, tuple[str, Histogram]] = {}  # name -> (source, counts)
        self._step: int | None = None
        self._step_time = math.nan
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)
        try:
            self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        except OSError as error:
            raise _port_error(port, host, error) from None
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

    def write_histograms(self, step: int, histograms: Mapping[str, Sequence[float]]) -> None:
        """Adds the step's values of each name to that name's run-long histogram."""
        with self._lock:
            for name, values in histograms.items():
                prom_name = prometheus_name(name)
                if prom_name not in self._histograms:
                    bounds = sorted(self._buckets.get(name, DEFAULT_BUCKETS))
                    self._histograms[prom_name] = (name, Histogram(bounds))
                self._histograms[prom_name][1].observe(values)

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        """The current values as metric families (``prometheus_client``'s collector API)."""
        with self._lock:
            gauges = sorted(self._gauges.items())
            histograms = [
                histogram.family(prom_name, source)
                for prom_name, (source, histogram) in sorted(self._histograms.items())
            ]
            step, step_time = self._step, self._step_time
        for prom_name, (source, value) in gauges:
            yield GaugeMetricFamily(prom_name, source, value=value)
        yield from histograms
        if step is not None:
            yield GaugeMetricFamily(f"{PREFIX}step", "last finished training step", value=step)
            yield GaugeMetricFamily(
                f"{PREFIX}last_step_timestamp_seconds",
                "unix time the last step was logged",
                value=step_time,
            )

    def render(self) -> str:
        """The exposition text of the current values."""
        return generate_latest(self._registry).decode("utf-8")

    def close(self) -> None:
        """Stops serving and frees the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """Fails now, before a run writes anything, when ``PrometheusSink`` could not listen on
    ``host:port``: binds it as the server will (address reuse on) and lets it go. A port
    taken between this check and the sink's start is refused by the sink.

    Raises:
        ConfigError: The port is in use or not ours to bind.
    """
    with socket.socket(ThreadingHTTPServer.address_family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, ThreadingHTTPServer.allow_reuse_address
        )
        try:
            probe.bind((host, port))
        except OSError as error:
            raise _port_error(port, host, error) from None


def _port_error(port: int, host: str, error: OSError) -> ConfigError:
    return ConfigError(
        f"monitor.prometheus_port={port}: cannot listen on {host}:{port} ({error}); choose "
        "another port, or 0 for none"
    )


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
