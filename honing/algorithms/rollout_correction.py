"""Rollout correction: importance weights, rejection and diagnostics for the gap between the
engine's sampling distribution ``mu`` and the trainer's old policy ``pi_old``.

Every quantity starts from the per-token log-ratio ``log rho = log pi_old - log mu`` of the
response tokens (clamped to [-20, 20] wherever it is exponentiated):

- **Importance weights** (``level``): ``token`` weighs each token by ``rho_t``; ``sequence``
  every token of a response by ``prod_t rho_t``. With an upper bound only they are truncated,
  ``min(w, upper)`` (TIS, https://fengyao.notion.site/off-policy-rl); with ``lower`` too a
  weight outside ``[lower, upper]`` is set to 0 (IcePop, https://ringtech.notion.site/icepop).
  ``batch_normalize`` divides them by their mean over the batch's tokens (``token``) or
  responses (``sequence``).
- **Rejection** (``rejections``): a divergence statistic per token (``k1 = -log rho``,
  ``k2 = (log rho)^2 / 2``, ``k3 = rho - 1 - log rho``; http://joschu.net/blog/kl-approx.html),
  taken per token or summed, averaged or maximised over a response, outside its bounds removes
  the token or the whole response from the loss mask; every option must keep a token (AND).
- **Diagnostics**: sums, counts and maxima (``tally``) that add up across micro-batches and
  data-parallel ranks, made into ``rollout_corr/*`` metrics by ``correction_metrics``.

The design and the metric names follow verl's rollout correction (Liu, Li et al., "When Speed
Kills Stability", https://richardli.xyz/rl-collapse). Weights are detached: they change the
measure the loss is averaged under, not the objective.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from honing.algorithms.core import masked_sum

IS_LEVELS = ("token", "sequence")
SAFE_LOG = 20.0  # |log rho| bound where it is exponentiated: exp(20) ~ 4.9e8

# The per-token divergence statistics of a log-ratio, by name.
STATISTICS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda log_ratio: -log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio**2,
    "k3": lambda log_ratio: torch.exp(log_ratio) - 1.0 - log_ratio,
}
AGGREGATIONS = ("token", "seq_sum", "seq_mean", "seq_max")
REJECTION_OPTIONS = tuple(
    f"{aggregation}_{statistic}"
    for aggregation in AGGREGATIONS
    for statistic in STATISTICS
    if (aggregation, statistic) != ("seq_max", "k1")  # the largest -log rho says no more
)

# Tally names: sums (added over micro-batches and ranks) and peaks (their maxima).
SUM, PEAK = "rollout_corr_sum/", "rollout_corr_peak/"
PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class Rejection:
    """One rejection option: ``k1`` keeps ``log lower <= k1 <= log upper``; ``k2`` and ``k3``
    keep ``statistic <= upper``."""

    option: str  # one of REJECTION_OPTIONS
    upper: float
    lower: float | None = None  # k1 only


@dataclass(frozen=True)
class CorrectionSettings:
    """What rollout correction does: the weights' ``level`` ("" for none) and bounds, batch
    normalisation, and the rejection options."""

    level: str = ""
    upper: float = 2.0
    lower: float | None = None  # IcePop's lower bound; None: truncate at ``upper``
    batch_normalize: bool = False
    rejections: tuple[Rejection, ...] = ()

    @property
    def needs_whole_batch(self) -> bool:
        """Whether the correction must see the whole batch before the loss: batch-normalised
        weights, and a rejection (it changes the loss's token count)."""
        return (bool(self.level) and self.batch_normalize) or bool(self.rejections)


def parse_bounds(spec: str) -> tuple[float | None, float]:
    """``"upper"`` or ``"lower_upper"`` -> (lower or None, upper); ValueError unless both
    are positive numbers with lower <= upper."""
    text = str(spec).strip()
    lower_text, upper_text = text.split("_", 1) if "_" in text else (None, text)
    try:
        upper = float(upper_text)
        lower = None if lower_text is None else float(lower_text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number or lower_upper (e.g. 2.0 or 0.5_2.0)") from None
    if not 0 < upper < math.inf or (lower is not None and not lower > 0):
        raise ValueError(f"{text!r}: bounds must be positive and finite")
    if lower is not None and lower > upper:
        raise ValueError(f"{text!r}: the lower bound is above the upper")
    return lower, upper


def parse_rejections(options: str, thresholds: str) -> tuple[Rejection, ...]:
    """Comma-separated ``options`` with their ``thresholds`` (one each, or one for all); a k1
    option takes ``lower_upper`` or an upper ratio bound (lower = 1 / upper), a k2 or k3
    option an upper bound. ValueError names what is wrong."""
    names = [name.strip() for name in options.split(",") if name.strip()]
    specs = [spec.strip() for spec in str(thresholds).split(",") if spec.strip()]
    for name in names:
        if name not in REJECTION_OPTIONS:
            raise ValueError(f"{name!r} is not known; choose from: {', '.join(REJECTION_OPTIONS)}")
        if names.count(name) > 1:
            raise ValueError(f"{name} is named twice")
    if len(specs) not in (1, len(names)):
        raise ValueError(f"{len(specs)} thresholds for {len(names)} options: 1, or one each")
    rejections = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs, strict=True):
        lower, upper = parse_bounds(spec)
        if name.endswith("k1"):
            rejections.append(Rejection(name, upper, 1.0 / upper if lower is None else lower))
        elif lower is not None:
            raise ValueError(f"{name} takes an upper bound only, not {spec!r}")
        else:
            rejections.append(Rejection(name, upper))
    return tuple(rejections)


def importance_weights(
    log_ratio: Tensor, mask: Tensor, level: str, upper: float, lower: float | None = None
) -> tuple[Tensor, Tensor]:
    """(applied, raw) weights, both [B, T] and 0 on padding, from ``log_ratio`` [B, T] (0 on
    padding): raw ``rho_t`` or ``prod_t rho_t``; applied truncated at ``upper``, or, given
    ``lower``, set to 0 outside ``[lower, upper]``."""
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFE_LOG, SAFE_LOG))  # [B, T]
    elif level == "sequence":
        total = log_ratio.sum(-1, keepdim=True).clamp(-SAFE_LOG, SAFE_LOG)  # [B, 1]
        raw = torch.exp(total).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown level {level!r}; choose one of: {', '.join(IS_LEVELS)}")
    raw = raw * mask
    if lower is None:
        return raw.clamp(max=upper), raw
    inside = (raw >= lower) & (raw <= upper)
    return torch.where(inside, raw, torch.zeros_like(raw)), raw


def batch_normalized(weights: Tensor, mask: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """``weights`` [B, T] divided by their mean over the tokens (``token``) or over the
    responses (``sequence``: one weight each), and that mean; unchanged (mean reported as 1)
    when the mean is not above 1e-8."""
    if level == "token":
        mean = masked_sum(weights, mask) / mask.sum().clamp_min(1)
    else:
        rows = mask.sum(-1) > 0  # [B]
        mean = weights.amax(-1)[rows].sum() / rows.sum().clamp_min(1)
    if mean <= 1e-8:
        return weights, torch.ones_like(mean)
    return weights / mean, mean


def rejection_keep(log_ratio: Tensor, mask: Tensor, rejection: Rejection) -> Tensor:
    """[B, T] bool: the tokens ``rejection`` keeps (a sequence option keeps all of a
    response's tokens or none). ``log_ratio`` [B, T] is 0 on padding."""
    aggregation, statistic = rejection.option.rsplit("_", 1)
    real = mask.bool()
    values = STATISTICS[statistic](log_ratio.clamp(-SAFE_LOG, SAFE_LOG))  # [B, T]
    values = torch.where(real, values, torch.zeros_like(values))
    if aggregation == "seq_sum":
        values = values.sum(-1, keepdim=True)  # [B, 1]
    elif aggregation == "seq_mean":
        values = values.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
    elif aggregation == "seq_max":
        lowest = torch.full_like(values, -math.inf)
        values = torch.where(real, values, lowest).amax(-1, keepdim=True)
        values = torch.where(real.any(-1, keepdim=True), values, torch.zeros_like(values))
    if statistic == "k1":
        keep = (values >= math.log(rejection.lower)) & (values <= math.log(rejection.upper))
    else:
        keep = values <= rejection.upper
    return keep.expand_as(real)


@dataclass
class Corrected:
    """What ``correct`` gives: the weights ([B, T]; None without a level), the kept tokens
    ([B, T] 0/1; None without rejection) and the tally for ``correction_metrics``."""

    weights: Tensor | None
    keep: Tensor | None
    tally: dict[str, Tensor]


def correct(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, settings: CorrectionSettings
) -> Corrected:
    """The weights, the rejection and the tally of ``settings`` for responses with
    ``old_logprobs`` and ``behaviour_logprobs`` ([B, T], detached here) under ``mask``.

    The weights and every rejection option read the response tokens of ``mask``, not one
    another's result; the caller multiplies the advantages by the weights and ``mask`` by
    ``keep``. ``batch_normalize`` and the rejection need the whole batch (a micro-batch's
    mean or token count is not the batch's).
    """
    real = mask.bool()
    old, behaviour = old_logprobs.detach(), behaviour_logprobs.detach()
    log_ratio = torch.where(real, old - behaviour, torch.zeros_like(old))  # [B, T]
    # the tally in float64: its variances are differences of sums (E[w^2] - E[w]^2)
    tally = _diagnostics(old.double(), behaviour.double(), mask, log_ratio.double())
    weights = keep = None
    if settings.level:
        weights, raw = importance_weights(
            log_ratio, mask, settings.level, settings.upper, settings.lower
        )
        tally |= _weight_tally(weights.double(), raw.double(), mask, settings)
        if settings.batch_normalize:
            weights, factor = batch_normalized(weights, mask, settings.level)
            tally[f"{PEAK}batch_norm_factor"] = factor  # one value for the whole batch
    if settings.rejections:
        keep = torch.ones_like(real)
        for rejection in settings.rejections:
            kept = rejection_keep(log_ratio, mask, rejection)
            tally |= _rejected(kept, real, f"rs_{rejection.option}_")
            keep = keep & kept
        tally |= _rejected(keep, real, "rs_")
        keep = keep.to(mask.dtype)
    return Corrected(weights, keep, tally)


def _diagnostics(old: Tensor, behaviour: Tensor, mask: Tensor, log_ratio: Tensor) -> dict:
    """The off-policy diagnostics' sums (per token and per response) and peaks."""
    real = mask.bool()
    rows = real.any(-1)  # [B] responses with a token
    safe = log_ratio.clamp(-SAFE_LOG, SAFE_LOG)
    count = mask.sum(-1).clamp_min(1)  # [B]
    old_mean = masked_sum(old, mask, dim=-1) / count  # [B] mean log pi_old per response
    behaviour_mean = masked_sum(behaviour, mask, dim=-1) / count
    log_ppl_diff = behaviour_mean - old_mean  # [B] log(ppl_old / ppl_mu)
    seq_log_ratio = log_ratio.sum(-1).clamp(-SAFE_LOG, SAFE_LOG)  # [B] log prod_t rho_t
    per_token = {
        "tokens": mask,
        "kl": -log_ratio,  # k1 estimate of KL(mu || pi_old) on tokens sampled from mu
        "k3": torch.exp(safe) - 1.0 - safe,
        "rho_squared": torch.exp(2.0 * safe),
    }
    per_response = {
        "seqs": torch.ones_like(old_mean),
        "training_log_ppl": -old_mean,
        "rollout_log_ppl": -behaviour_mean,
        "training_ppl": torch.exp(-old_mean),
        "rollout_ppl": torch.exp(-behaviour_mean),
        "log_ppl_diff": log_ppl_diff,
        "log_ppl_abs_diff": log_ppl_diff.abs(),
        "ppl_ratio": torch.exp(log_ppl_diff),
        "seq_rho_squared": torch.exp(2.0 * seq_log_ratio),
    }
    tally = {f"{SUM}{name}": masked_sum(v, real) for name, v in per_token.items()}
    tally |= {f"{SUM}{name}": masked_sum(v, rows) for name, v in per_response.items()}
    tally[f"{PEAK}log_ppl_diff_max"] = _peak(log_ppl_diff, rows)
    tally[f"{PEAK}log_ppl_diff_min"] = _peak(-log_ppl_diff, rows)  # the minimum, negated
    return tally


def _weight_tally(weights: Tensor, raw: Tensor, mask: Tensor, settings: CorrectionSettings):
    """The applied weights' sums and extremes, and how many raw ratios (tokens, or responses
    at sequence level) fall outside ``[lower, upper]`` (lower = 1 / upper when truncating)."""
    real = mask.bool()
    lower = 1.0 / settings.upper if settings.lower is None else settings.lower
    high, low = raw > settings.upper, raw < lower  # [B, T]
    if settings.level == "sequence":  # one ratio per response
        rows = real.any(-1)
        high, low = high.any(-1) & rows, (low & real).any(-1)
    else:
        high, low = high & real, low & real
    return {
        f"{SUM}is_weight": masked_sum(weights, real),
        f"{SUM}is_weight_squared": masked_sum(weights**2, real),
        f"{SUM}is_high": high.sum().to(weights.dtype),
        f"{SUM}is_low": low.sum().to(weights.dtype),
        f"{PEAK}is_max": _peak(weights, real),
        f"{PEAK}is_min": _peak(-weights, real),  # the minimum, negated
    }


def _rejected(keep: Tensor, real: Tensor, name: str) -> dict[str, Tensor]:
    """Rejected response tokens, and responses with one rejected, under ``name``."""
    rejected = real & ~keep  # [B, T]
    return {
        f"{SUM}{name}rejected": rejected.sum().double(),
        f"{SUM}{name}seq_rejected": rejected.any(-1).sum().double(),
    }


def _peak(values: Tensor, where: Tensor) -> Tensor:
    """The largest of ``values`` where ``where`` is set (-inf where nothing is)."""
    return torch.where(where, values, torch.full_like(values, -math.inf)).amax()


def correction_metrics(tally: dict[str, Tensor], settings: CorrectionSettings) -> dict[str, float]:
    """``rollout_corr/*`` metrics from a tally (``correct``'s, or the sum of several over
    micro-batches and ranks, its peaks their maximum); {} when it counted no token.

    Means over tokens: ``kl``, ``k3_kl``, ``chi2_token`` (E[rho^2] - 1), the weights' mean,
    std and effective sample size ((E w)^2 / E[w^2]); means over responses: perplexities
    (exp of the mean -log p), ``log_ppl_diff`` (log of pi_old's perplexity over mu's),
    ``ppl_ratio``, ``chi2_seq`` (E[(prod_t rho_t)^2] - 1); rejected fractions of tokens and
    of responses (with at least one rejected token).
    """
    sums = {name[len(SUM) :]: float(v) for name, v in tally.items() if name.startswith(SUM)}
    peaks = {name[len(PEAK) :]: float(v) for name, v in tally.items() if name.startswith(PEAK)}
    tokens, seqs = sums["tokens"], sums["seqs"]
    if tokens == 0:
        return {}
    out = {
        "kl": sums["kl"] / tokens,
        "k3_kl": sums["k3"] / tokens,
        "chi2_token": sums["rho_squared"] / tokens - 1.0,
        "chi2_seq": sums["seq_rho_squared"] / seqs - 1.0,
        "log_ppl_diff_max": peaks["log_ppl_diff_max"],
        "log_ppl_diff_min": -peaks["log_ppl_diff_min"],
    }
    for name in ("training_log_ppl", "rollout_log_ppl", "training_ppl", "rollout_ppl"):
        out[name] = sums[name] / seqs
    for name in ("log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio"):
        out[name] = sums[name] / seqs
    if settings.level:
        mean = sums["is_weight"] / tokens
        square = sums["is_weight_squared"] / tokens
        counted = tokens if settings.level == "token" else seqs
        out |= {
            "rollout_is_mean": mean,
            "rollout_is_std": math.sqrt(max(square - mean**2, 0.0)),
            "rollout_is_eff_sample_size": mean**2 / square if square > 0 else 0.0,
            "rollout_is_max": peaks["is_max"],
            "rollout_is_min": -peaks["is_min"],
            "rollout_is_ratio_fraction_high": sums["is_high"] / counted,
            "rollout_is_ratio_fraction_low": sums["is_low"] / counted,
        }
        if "batch_norm_factor" in peaks:
            out["rollout_is_batch_norm_factor"] = peaks["batch_norm_factor"]
    named = ("", *(f"{r.option}_" for r in settings.rejections)) if settings.rejections else ()
    for name in named:  # all options together, then each alone
        out[f"rollout_rs_{name}masked_fraction"] = sums[f"rs_{name}rejected"] / tokens
        out[f"rollout_rs_{name}seq_masked_fraction"] = sums[f"rs_{name}seq_rejected"] / seqs
    return {f"{PREFIX}{name}": value for name, value in out.items()}


def is_tally(name: str) -> bool:
    """Whether a name is a tally's (not a metric)."""
    return name.startswith((SUM, PEAK))


def is_peak(name: str) -> bool:
    """Whether a tally entry is a maximum (reduced with max, not summed)."""
    return name.startswith(PEAK)
