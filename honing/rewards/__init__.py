"""Rewards: the reward-function protocol and registry, the scorer that applies a failure
policy, routing by data source (``routing``), the math and code verifiers (``math.verifier``,
``code_verifier``, loaded on first use; the programs run in ``honing.sandbox``) and the
verifier-service client (``remote``). No torch here (layer 2); see ``registry`` for the
signature."""

from honing.rewards.math.numeric import extract_answer, format_reward, numeric_reward, parse_number
from honing.rewards.registry import (
    REWARD_FUNCTIONS,
    RewardFn,
    describe_error,
    load_reward_fn,
    register_reward,
)
from honing.rewards.scorer import ON_ERROR_POLICIES, Scorer

__all__ = [
    "ON_ERROR_POLICIES",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "Scorer",
    "describe_error",
    "extract_answer",
    "format_reward",
    "load_reward_fn",
    "numeric_reward",
    "parse_number",
    "register_reward",
]
