"""docs/compatibility.md's table is what the config rules say today, and each of its verdicts
is the one ``check_config`` gives the same config."""

from __future__ import annotations

import pytest

from honing.config import build_config
from honing.errors import ConfigError
from honing.pipeline import compatibility
from honing.pipeline.compatibility import DOC, FEATURES, pair_verdict, section, table, verdict
from honing.pipeline.rules import check_config
from honing.rollout.vllm.engine import vllm_available

BY_NAME = {feature.name: feature for feature in FEATURES}
VLLM_MISSING = vllm_available()


@pytest.mark.skipif(VLLM_MISSING is not None, reason=f"the table is made with vLLM: {VLLM_MISSING}")
def test_the_committed_table_is_the_rules_table():
    assert section(DOC.read_text(encoding="utf-8")) == table(), (
        "docs/compatibility.md differs from what pipeline/rules.py says; run "
        "python -m honing.pipeline.compatibility --write"
    )


def _direct(values: dict, world_size: int) -> str | None:
    try:
        check_config(build_config({"model.path": "builtin:tiny"} | values), world_size)
    except ConfigError as refusal:
        return str(refusal)
    return None


@pytest.mark.parametrize(
    ("a", "b", "values", "world_size"),
    [
        ("FSDP", "async", {"trainer.strategy": "fsdp", "schedule.mode": "async"}, 2),
        ("tools", "torchrun", {"rollout.tools": ["calculator"]}, 2),
        ("R3", "MTP", {"algorithm.routing_replay": "R3", "rollout.speculative": "mtp"}, 1),
        ("LoRA", "Ray", {"model.lora_rank": 4, "pipeline.backend": "ray"}, 1),
    ],
)
def test_a_pair_verdict_is_check_configs(a, b, values, world_size):
    expected = _direct(values, world_size)
    assert pair_verdict(BY_NAME[a], BY_NAME[b]) == expected
    assert pair_verdict(BY_NAME[b], BY_NAME[a]) == expected


@pytest.mark.parametrize("feature", FEATURES, ids=[feature.name for feature in FEATURES])
def test_each_feature_alone_passes_the_rules(feature):
    if feature.name == "vLLM" and VLLM_MISSING is not None:
        pytest.skip(VLLM_MISSING)
    assert verdict(feature) is None


def test_two_values_of_one_key_are_not_a_pair():
    reason = pair_verdict(BY_NAME["vLLM"], BY_NAME["servers"])
    assert reason == "rollout.engine takes one value, vllm or openai"


def test_write_replaces_the_section_alone(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        f"before\n{compatibility.BEGIN}\nold\n{compatibility.END}\nafter\n", encoding="utf-8"
    )
    monkeypatch.setattr(compatibility, "table", lambda: "| new |\n")
    compatibility.write(page)
    text = page.read_text(encoding="utf-8")
    assert text == f"before\n{compatibility.BEGIN}\n\n| new |\n\n{compatibility.END}\nafter\n"
    assert section(text) == "| new |\n"
