"""Pure tensor functions for RL on language models: reductions, advantages, losses, KL.

Imports only torch. Advantage estimators, policy losses, loss aggregations and KL estimators
are chosen by name from registries, so adding an algorithm is one function and one name.
"""

from honing.algorithms.advantage_registry import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageSettings,
    get_advantage,
    register_advantage,
)
from honing.algorithms.advantages import (
    dr_grpo,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from honing.algorithms.core import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from honing.algorithms.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS, aggregate_loss, kl_penalty
from honing.algorithms.policy_losses import (
    POLICY_LOSSES,
    cispo,
    get_policy_loss,
    gspo,
    ppo_clip,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageSettings",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "aggregate_loss",
    "cispo",
    "dr_grpo",
    "entropy_from_logits",
    "gae",
    "get_advantage",
    "get_policy_loss",
    "grpo",
    "gspo",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_clip",
    "register_advantage",
    "register_policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]
