"""The names of the metrics a run logs, so that an alert rule on a name no run logs (a typo:
``actor/ppo_kll``) is refused when the config is read instead of never firing.

``KNOWN`` and ``PATTERNS`` list every name ``metrics.jsonl`` can hold (docs/monitoring.md).
Under ``HONING_CHECK_METRIC_NAMES=1`` (the test suite sets it) the logger refuses a name
they do not match, so a metric added without its entry here fails the tests that log it.
"""

from __future__ import annotations

import difflib
import re

KNOWN = frozenset(
    {
        # the policy's update
        *(
            f"actor/{name}"
            for name in (
                "pg_loss",
                "pg_clipfrac",
                "pg_clipfrac_lower",
                "ppo_kl",
                "entropy",
                "kl_loss",
                "kl_coef",
                "grad_norm",
                "lr",
                "skipped_updates",
            )
        ),
        # scores, advantages and the critic (gae)
        *(f"critic/score/{s}" for s in ("mean", "std", "max", "min")),
        "critic/advantages/mean",
        "critic/advantages/var",
        "critic/kl",
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/grad_norm",
        "critic/vf_explained_var",
        "critic/values/mean",
        "critic/returns/mean",
        *(f"response_length/{s}" for s in ("mean", "max", "min", "clip_ratio")),
        *(
            f"samples/{name}"
            for name in (
                "generated",
                "trained",
                "filtered",
                "failed",
                "stale",
                "score_errors",
                "gen_rounds",
                "regenerated",
            )
        ),
        *(
            f"reward/{name}"
            for name in (
                "latency_p50_ms",
                "latency_p99_ms",
                "requests",
                "errors",
                "retries",
                "cache_hits",
                "ejections",
                "failed_items",
                "judge_format_errors",
            )
        ),
        *(
            f"timing_s/{part}"
            for part in (
                "gen",
                "reward",
                "ref",
                "old",
                "prepare",
                "update",
                "sync",
                "step",
                "val",
                "mtp",
                "offload",
                "reload",
                "engine_idle",
                "trainer_idle",
                "teacher",
            )
        ),
        "distill/reverse_kl",
        "perf/throughput",
        "perf/gen_tokens_per_s",
        "perf/train_tokens_per_s",
        "perf/sync_mb",
        "perf/token_imbalance",
        "perf/micro_batches",
        "system/cpu_percent",
        "system/rss_mb",
        "system/gpu_mem_mb",
        "dist/world_size",
        "dist/strategy",
        "memory/model_state_mb",
        "memory/offloaded_gb",
        "memory/activation_peak_mb",
        "memory/expert_state_mb",
        *(f"data/{name}" for name in ("skipped_solved", "skipped_unsolved")),
        *(f"data/{name}" for name in ("prompts_solved", "prompts_unsolved")),
        "ep/load_imbalance/max",
        "ep/load_imbalance/mean",
        "async/weight_version",
        "async/staleness",
        "async/queue_depth",
        "rollout/gen_timeouts",
        "rollout/generation_ranks",
        *(
            f"rollout/spec_{name}"
            for name in (
                "enabled",
                "accept_rate",
                "accepted_len",
                "drafts",
                "draft_tokens",
                "accepted_tokens",
            )
        ),
        "rollout_mismatch/prob_diff_mean",
        "rollout_mismatch/prob_diff_max",
        "rollout_mismatch/logprob_diff_max",
        "rollout_mismatch/kl",
        # rollout correction (algorithm.rollout_is / rollout_rs): diagnostics, weights, rejection
        *(
            f"rollout_corr/{name}"
            for name in (
                "kl",
                "k3_kl",
                "chi2_token",
                "chi2_seq",
                "training_ppl",
                "rollout_ppl",
                "training_log_ppl",
                "rollout_log_ppl",
                "log_ppl_diff",
                "log_ppl_abs_diff",
                "log_ppl_diff_max",
                "log_ppl_diff_min",
                "ppl_ratio",
                "rollout_is_mean",
                "rollout_is_std",
                "rollout_is_max",
                "rollout_is_min",
                "rollout_is_eff_sample_size",
                "rollout_is_ratio_fraction_high",
                "rollout_is_ratio_fraction_low",
                "rollout_is_batch_norm_factor",
                "rollout_rs_masked_fraction",
                "rollout_rs_seq_masked_fraction",
            )
        ),
        "mtp/loss",
        "mtp/accuracy",
        "moe/load_violation/max",
        "moe/load_violation/mean",
        "moe/router_entropy",
        "moe/null_expert_share",
        "moe/rollout_router_match",
        "moe/aux_loss",
        "moe/z_loss",
        *(f"checkpoint/mirror_{name}" for name in ("upload_s", "upload_mb", "pending", "failures")),
        "val/accuracy",
        "val/score_errors",
        "val/score_retried",
        "val/generation_ranks",
        "val/gen_timeouts",
    }
)

PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (
        r"(critic/score|response_length)/p\d+",  # percentiles
        r"samples/filtered_\w+",  # by reason
        r"val/(pass|mean)@\d+",
        r"moe/layer\d+/(load_violation|router_entropy)",
        r"memory/peak_\w+_gb",
        r"ray/\w+_workers(_target)?",  # live workers; the autoscaler's target
        r"val/spec_\w+",  # speculation while validating
        r"partial/\w+",  # partial rollouts (schedule.partial_rollout)
        r"tool/\w+",  # multi-turn rollouts with tools (rollout.tools)
        r"val/tool_\w+",  # the same while validating
        # each rejection option's share (algorithm.rollout_rs)
        r"rollout_corr/rollout_rs_(token|seq_sum|seq_mean)_k[123]_(seq_)?masked_fraction",
        r"rollout_corr/rollout_rs_seq_max_k[23]_(seq_)?masked_fraction",
    )
)


def known_metric(name: str) -> bool:
    """Whether a run can log a metric of this name."""
    return name in KNOWN or any(p.fullmatch(name) for p in PATTERNS)


def closest_metric(name: str) -> str | None:
    """The known name nearest to ``name`` (a suggestion for a typo), if one is near."""
    match = difflib.get_close_matches(name, sorted(KNOWN), n=1, cutoff=0.6)
    return match[0] if match else None
