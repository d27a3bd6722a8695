"""Pure tensor functions for RL on language models: reductions, advantages, losses, KL.

Imports only torch. Advantage estimators, policy losses, loss aggregations and KL estimators
are chosen by name from registries, so adding an algorithm is one function and one name.
"""

from honing.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage,
    grpo,
    register_advantage,
)
from honing.algorithms.core import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from honing.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate_loss,
    get_policy_loss,
    kl_penalty,
    ppo_clip,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "aggregate_loss",
    "entropy_from_logits",
    "get_advantage",
    "get_policy_loss",
    "grpo",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_clip",
    "register_advantage",
    "register_policy_loss",
]
