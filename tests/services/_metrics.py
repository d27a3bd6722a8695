"""A service's ``GET /metrics`` page read with Prometheus's own parser."""

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scraped(url: str, **headers: str) -> dict[str, dict[frozenset, float]]:
    """Sample name -> its series' labels (a frozenset of pairs) -> value."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
    series: dict[str, dict[frozenset, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return series


def value(series: dict[str, dict[frozenset, float]], name: str, **labels: str) -> float:
    """The value of ``name`` under exactly ``labels``."""
    return series[name][frozenset(labels.items())]
