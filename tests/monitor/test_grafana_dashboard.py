"""The Grafana dashboard (``deploy/grafana``) against what a real run's endpoint serves.

A 3-step run (async schedule, KL to a reference model, so the async and KL panels have data)
serves ``/metrics``; it is scraped over HTTP after the last step, just before the endpoint
closes. Every PromQL expression of the dashboard is parsed for the metric names it reads,
and each one must be among the scraped samples: renaming a metric on either side fails here.
Grafana itself is not started.
"""

import json
import re
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from honing.monitor.prometheus import PrometheusSink
from honing.services.process import free_port
from tests.monitor._runs import logged, train

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DASHBOARD = GRAFANA / "honing.json"
# Series a CPU run does not have; checked only where CUDA is.
CUDA_ONLY = {"honing_system_gpu_mem_mb"}
# One metric per subject the dashboard must show.
SUBJECTS = {
    "tokens/s": "honing_perf_throughput",
    "reward histogram": "honing_critic_score_bucket",
    "response-length distribution": "honing_response_length_bucket",
    "advantage variance": "honing_critic_advantages_var",
    "entropy": "honing_actor_entropy",
    "KL": "honing_actor_ppo_kl",
    "async queue depth": "honing_async_queue_depth",
    "staleness": "honing_async_staleness",
    "verifier latency p50": "honing_reward_latency_p50_ms",
    "verifier latency p99": "honing_reward_latency_p99_ms",
    "memory": "honing_system_rss_mb",
}
_GROUPING = ("by", "without", "on", "ignoring", "group_left", "group_right")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", *_GROUPING}
_LABEL_LIST = rf"\b(?:{'|'.join(_GROUPING)})\s*\([^)]*\)"


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects.

    Strings, label matchers ``{...}``, ranges ``[...]`` and grouping label lists are cut
    first; what remains is a metric name unless a ``(`` follows (a function or aggregation),
    it is a keyword, or it is part of a number, duration or ``$variable``.
    """
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(_LABEL_LIST, " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("(") or match.group().lower() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"].removeprefix("label_values(").split(",")[0])
    return exprs


def missing(dashboard: dict, served: set[str]) -> set[str]:
    """Metric names the dashboard reads that the endpoint did not serve."""
    used = set().union(*map(metric_names, expressions(dashboard)))
    return used - served


def served_names(text: str) -> set[str]:
    """Sample names of an exposition text (``name{labels} value`` or ``name value``)."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in lines}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('honing_actor_entropy{instance=~"$instance"}', {"honing_actor_entropy"}),
        ("time() - honing_last_step_timestamp_seconds", {"honing_last_step_timestamp_seconds"}),
        (
            'sum by (le) (increase(honing_critic_score_bucket{job="x"}[$__rate_interval]))',
            {"honing_critic_score_bucket"},
        ),
        ("histogram_quantile(0.99, rate(a_bucket[5m])) > bool 1e3 offset 1h", {"a_bucket"}),
        ("honing_a / on (instance) group_left honing_b or vector(0)", {"honing_a", "honing_b"}),
    ],
)
def test_metric_names_of_promql(expr, names):
    assert metric_names(expr) == names


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def scraped(micro_model_dir, digit_reward, tmp_path_factory):
    """``(exposition text, run_dir)``: ``/metrics`` of a finished 3-step run, over HTTP."""
    texts = []
    close = PrometheusSink.close

    def scrape_then_close(sink):
        with urllib.request.urlopen(sink.url, timeout=5) as response:
            texts.append(response.read().decode("utf-8"))
        close(sink)

    run_dir = tmp_path_factory.mktemp("grafana") / "run"
    overrides = [
        "schedule.mode=async",
        "algorithm.kl_coef=0.05",
        f"monitor.prometheus_port={free_port()}",
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PrometheusSink, "close", scrape_then_close)
        assert train(micro_model_dir, digit_reward, run_dir, *overrides) == 0
    (text,) = texts
    return text, run_dir


@pytest.mark.slow
def test_every_metric_the_dashboard_reads_is_served(dashboard, scraped):
    text, _ = scraped
    served = served_names(text)
    expected_missing = set() if torch.cuda.is_available() else CUDA_ONLY
    assert missing(dashboard, served) == expected_missing
    used = set().union(*map(metric_names, expressions(dashboard)))
    assert {subject: name in used for subject, name in SUBJECTS.items()} == dict.fromkeys(
        SUBJECTS, True
    )

    # the check can fail: a metric renamed in the dashboard, or one the endpoint stops serving
    renamed = json.loads(json.dumps(dashboard).replace("honing_actor_entropy", "honing_entropy"))
    assert missing(renamed, served) == expected_missing | {"honing_entropy"}
    assert missing(dashboard, served - {"honing_async_staleness"}) == expected_missing | {
        "honing_async_staleness"
    }


@pytest.mark.slow
def test_served_values_are_the_runs_last_step(scraped):
    text, run_dir = scraped
    values = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(values["honing_step"]) == 3
    assert float(values["honing_actor_entropy"]) == logged(run_dir, "actor/entropy")[3]
    assert float(values["honing_async_staleness"]) == logged(run_dir, "async/staleness")[3]
    # the histograms count every step's values: trained rewards, generated responses
    trained = sum(logged(run_dir, "samples/trained").values())
    generated = sum(logged(run_dir, "samples/generated").values())
    assert values["honing_critic_score_count"] == values['honing_critic_score_bucket{le="+Inf"}']
    assert float(values["honing_critic_score_count"]) == trained
    assert float(values["honing_response_length_count"]) == generated


def test_panels_use_the_datasource_variable_and_unique_ids(dashboard):
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"] and all(target["expr"] for target in panel["targets"])
    (source,) = [v for v in dashboard["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert (source["type"], source["query"]) == ("datasource", "prometheus")


def test_provisioning_points_at_the_dashboard_and_the_datasource(dashboard):
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert source["type"] == "prometheus" and source["uid"] == variable["current"]["value"]
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/honing.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
