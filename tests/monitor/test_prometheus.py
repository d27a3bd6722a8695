"""Tests for the Prometheus endpoint: real HTTP GETs on loopback."""

import math
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from honing.errors import ConfigError
from honing.monitor.prometheus import (
    DEFAULT_BUCKETS,
    PrometheusSink,
    format_sample,
    prometheus_name,
)


def scrape(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.headers["Content-Type"], response.read().decode("utf-8")


def samples(text):
    """Metric name -> value, from the non-comment lines."""
    lines = (line.split(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in lines}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("critic/score/mean", "honing_critic_score_mean"),
        ("val/pass@8", "honing_val_pass_8"),
        ("timing_s/step", "honing_timing_s_step"),
        ("reward/latency_p99_ms", "honing_reward_latency_p99_ms"),
        ("/odd//name-", "honing_odd_name"),
        ("8bit", "honing_8bit"),
    ],
)
def test_prometheus_name(name, expected):
    assert prometheus_name(name) == expected


def test_format_sample_non_finite():
    assert [format_sample(v) for v in (math.nan, math.inf, -math.inf)] == ["NaN", "+Inf", "-Inf"]
    assert format_sample(0.25) == "0.25"


def test_serves_latest_values_over_http():
    sink = PrometheusSink(port=0)
    try:
        content_type, text = scrape(sink.url)
        assert content_type.startswith("text/plain; version=0.0.4")
        assert samples(text) == {}  # nothing logged yet: no step gauge either

        sink.write(1, {"critic/score/mean": 0.25, "val/accuracy": 0.5, "note": "text"})
        sink.write(2, {"critic/score/mean": 0.75, "actor/grad_norm": math.nan})
        _, text = scrape(sink.url)
    finally:
        sink.close()

    values = samples(text)
    assert values["honing_critic_score_mean"] == 0.75
    assert values["honing_val_accuracy"] == 0.5  # kept from step 1 until logged again
    assert math.isnan(values["honing_actor_grad_norm"])
    assert values["honing_step"] == 2
    assert abs(values["honing_last_step_timestamp_seconds"] - time.time()) < 60
    assert "honing_note" not in values
    assert "# HELP honing_critic_score_mean critic/score/mean" in text
    assert "# TYPE honing_critic_score_mean gauge" in text


def test_other_paths_are_404():
    sink = PrometheusSink(port=0)
    try:
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/other", timeout=5)
        assert error.value.code == 404
    finally:
        sink.close()


def test_busy_port_is_a_config_error_and_close_frees_the_port():
    first = PrometheusSink(port=0)
    port = first.port
    with pytest.raises(ConfigError, match=f"monitor.prometheus_port={port}: cannot listen"):
        PrometheusSink(port=port)
    first.close()
    again = PrometheusSink(port=port)  # the port is free again after close
    assert again.port == port
    again.close()


def test_histograms_are_cumulative_prometheus_histograms():
    sink = PrometheusSink(port=0, buckets={"critic/score": (0.0, 0.5, 1.0)})
    try:
        sink.write_histograms(1, {"critic/score": [0.0, 0.25, 1.0, math.nan]})
        sink.write_histograms(2, {"critic/score": [0.5, 3.0], "response_length": [1, 3, 3, 40]})
        _, text = scrape(sink.url)
    finally:
        sink.close()

    values = samples(text)
    # le is inclusive: 0.0 falls in le="0.0", 0.5 in le="0.5"; 3.0 only in +Inf; NaN is left out
    buckets = [values[f'honing_critic_score_bucket{{le="{le}"}}'] for le in ("0.0", "0.5", "1.0")]
    assert buckets == [1, 3, 4]
    assert values['honing_critic_score_bucket{le="+Inf"}'] == 5
    assert values["honing_critic_score_count"] == 5
    assert values["honing_critic_score_sum"] == 0.0 + 0.25 + 1.0 + 0.5 + 3.0
    assert "# TYPE honing_critic_score histogram" in text
    # response lengths in powers-of-two buckets: 1 | 2 | 4 (3, 3) | ... | 64 (40)
    assert values['honing_response_length_bucket{le="1.0"}'] == 1
    assert values['honing_response_length_bucket{le="2.0"}'] == 1
    assert values['honing_response_length_bucket{le="4.0"}'] == 3
    assert values['honing_response_length_bucket{le="32.0"}'] == 3
    assert values['honing_response_length_bucket{le="64.0"}'] == 4
    assert values["honing_response_length_sum"] == 47.0
    assert values["honing_response_length_count"] == 4


def test_histogram_of_an_unlisted_name_uses_the_default_buckets():
    sink = PrometheusSink(port=0)
    try:
        sink.write_histograms(1, {"reward/latency_ms": [0.2, 7.0]})
        text = sink.render()
    finally:
        sink.close()
    values = samples(text)
    buckets = [name for name in values if name.startswith("honing_reward_latency_ms_bucket")]
    assert len(buckets) == len(DEFAULT_BUCKETS) + 1
    assert values['honing_reward_latency_ms_bucket{le="0.25"}'] == 1
    assert values['honing_reward_latency_ms_bucket{le="5.0"}'] == 1
    assert values['honing_reward_latency_ms_bucket{le="+Inf"}'] == 2


def test_the_text_parses_with_prometheus_own_parser():
    """A metric's source name (its HELP text) with a backslash, a quote and a newline is
    escaped; every gauge and histogram reads back with prometheus_client's parser."""
    odd = 'custom\\reward "x"\nline'
    sink = PrometheusSink(port=0)
    try:
        sink.write(4, {odd: 0.5, "critic/score/mean": 0.25})
        sink.write_histograms(4, {"critic/score": [0.0, 1.0]})
        _, text = scrape(sink.url)
    finally:
        sink.close()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    custom = families["honing_custom_reward_x_line"]
    assert custom.documentation == odd and custom.samples[0].value == 0.5
    assert families["honing_critic_score_mean"].samples[0].value == 0.25
    assert families["honing_step"].samples[0].value == 4.0
    histogram = {s.name: s.value for s in families["honing_critic_score"].samples}
    assert histogram["honing_critic_score_count"] == 2.0
    assert histogram["honing_critic_score_sum"] == 1.0
