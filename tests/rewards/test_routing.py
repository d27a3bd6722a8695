"""Routing by data_source, weighted components, and the reward config keys behind them."""

import pytest

from honing.config import build_config
from honing.errors import ConfigError, DataError, RewardError
from honing.pipeline.inputs import build_scorer, check_ground_truths
from honing.rewards.routing import DEFAULT_ROUTES, RewardRouter, VerifierSettings, build_router
from honing.types import Prompt, Rollout


class _Batch:
    def __init__(self):
        self.calls = []

    def score_batch(self, items):
        self.calls.append(len(items))
        return [{"score": 0.5, "verdict": "batch"} for _ in items]


def _resolver(functions):
    return lambda spec, settings: functions[spec]


def _item(source, response="1", truth="1"):
    return {"data_source": source, "response": response, "ground_truth": truth}


@pytest.mark.parametrize(
    ("source", "spec"),
    [
        ("openai/gsm8k", "math"),
        ("lighteval/MATH", "math"),
        ("DigitalLearningGmbH/MATH-lighteval", "math"),
        ("aime2024", "math"),
        ("numina_olympiads", "math"),
        ("codecontests", "code"),
        ("apps", "code"),
        ("taco", "code"),
        ("codeforces", "code"),
        ("arithmetic", "numeric"),
        ("my_set", None),
    ],
)
def test_verl_data_sources_route_to_the_right_verifier(source, spec):
    router = RewardRouter(DEFAULT_ROUTES, resolve=lambda spec, settings: spec)
    assert router.route(source) == spec


def test_each_route_gets_its_items_in_one_batch_and_order_is_kept():
    batch = _Batch()
    plain = lambda response, truth, **context: float(response == truth)  # noqa: E731
    router = RewardRouter(
        {"a": "batch", "b": "plain"}, resolve=_resolver({"batch": batch, "plain": plain})
    )
    items = [_item("b"), _item("a"), _item("b", "2"), _item("a"), _item("zzz")]
    results = router.score_batch(items)
    assert results[:4] == [1.0, {"score": 0.5, "verdict": "batch"}, 0.0, results[1]]
    assert isinstance(results[4], RewardError) and "data_source 'zzz'" in str(results[4])
    assert batch.calls == [2]
    assert len(router.last_latencies_ms) == 3  # the batch call + two plain calls


def test_a_raising_function_fails_only_its_items():
    def boom(response, truth, **context):
        raise ValueError("bad")

    router = RewardRouter(
        {"a": "boom"}, fallback=lambda r, t, **c: 1.0, resolve=_resolver({"boom": boom})
    )
    bad, good = router.score_batch([_item("a"), _item("other")])
    assert isinstance(bad, ValueError) and good == 1.0


def test_user_routes_override_and_a_spec_becomes_the_fallback():
    router = build_router("numeric", {"openai/gsm8k": "format"}, VerifierSettings())
    assert router.route("openai/gsm8k") == "format"
    assert router.route("lighteval/MATH") is None  # no auto table: the fallback scores it
    assert router.unrouted({"anything"}) == []
    auto = build_router("auto", {"mine": "numeric"}, VerifierSettings())
    assert auto.route("mine") == "numeric" and auto.route("apps") == "code"
    assert auto.unrouted({"mine", "apps", "mystery"}) == ["mystery"]


def test_unrouted_data_source_is_a_load_time_error():
    scorer = build_scorer(build_config({}))
    prompts = [Prompt("p1", "q", "1", data_source="arithmetic"), Prompt("p2", "q", "1", "web")]
    with pytest.raises(DataError, match="no reward function for data_source 'web'.*reward.routes"):
        check_ground_truths(prompts, scorer)


def test_numeric_route_checks_ground_truths_at_load_time():
    scorer = build_scorer(build_config({}))
    with pytest.raises(DataError, match="ground truth 'seven' is not a number"):
        check_ground_truths([Prompt("p1", "q", "seven", data_source="arithmetic")], scorer)


def test_weights_add_components_and_keep_the_base_score():
    config = build_config({"reward.weights": {"format": 0.5}, "reward.format_weight": 0.0})
    scorer = build_scorer(config)
    prompt = Prompt("p1", "2+2=", "4", data_source="arithmetic")
    rollouts = [Rollout("p1", 0, [1], [2], [0.0], "stop", 0, text) for text in ("4", "it is 4")]
    bare, wordy = scorer.score({"p1": prompt}, rollouts)
    assert (bare.reward, wordy.reward) == (1.5, 1.0)
    assert bare.details["base_score"] == 1.0 and bare.details["format"] == 1.0
    scorer.close()


def test_reward_maps_in_config_are_checked():
    config = build_config({"reward.routes": "{my_set: math}", "reward.weights": {"format": 1}})
    assert config.reward.routes == {"my_set": "math"} and config.reward.weights == {"format": 1.0}
    with pytest.raises(ConfigError, match=r"reward.weights.format: expected float, got 'lots'"):
        build_config({"reward.weights": {"format": "lots"}})
    with pytest.raises(ConfigError, match="reward.routes: expected dict"):
        build_config({"reward.routes": "[a, b]"})
    with pytest.raises(ConfigError, match="reward.on_error: 'error' is not allowed"):
        build_config({"reward.on_error": "error"})  # one name per policy: fail
