"""The Markdown report of benchmarks/grpo_step.py: results, stages and scaling tables."""

from __future__ import annotations

from pathlib import Path

STAGES = ("gen", "reward", "ref", "old", "update", "sync", "rest")


def _spread(low_high: list[float]) -> str:
    return f"{low_high[0]:.3f}–{low_high[1]:.3f}"


def _results_rows(report: dict) -> list[str]:
    rows = [
        "| workload | params | vocab | new tokens | β | pairs × steps | TRL s/step (min–max) "
        "| honing s/step (min–max) | TRL / honing (pairs' min–max) | completion tok/s TRL / "
        "honing | mean completion length TRL / honing | peak RSS MB TRL / honing |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in report["workloads"]:
        work, trl, hon = w["workload"], w["trl"], w["honing"]
        ratio_low, ratio_high = w["ratio_min_max_over_pairs"]
        rows.append(
            f"| {work['name']} | {w['params']:,} | {w['vocab']:,} | {work['max_new_tokens']} "
            f"| {work['beta']} | {work['pairs']} × {work['steps']} "
            f"| {trl['median_step_s']:.3f} ({_spread(trl['step_s_min_max'])}) "
            f"| {hon['median_step_s']:.3f} ({_spread(hon['step_s_min_max'])}) "
            f"| **{w['ratio_trl_over_honing']:.2f}×** ({ratio_low:.2f}–{ratio_high:.2f}) "
            f"| {trl['completion_tokens_per_s']:,.0f} / {hon['completion_tokens_per_s']:,.0f} "
            f"| {trl['completion_mean_length']:.1f} / {hon['completion_mean_length']:.1f} "
            f"| {trl['peak_rss_mb']:,.0f} / {hon['peak_rss_mb']:,.0f} |"
        )
    return rows


def _stage_rows(report: dict) -> list[str]:
    rows = [
        "| workload | system | step | " + " | ".join(STAGES) + " | gen tok/s | update tok/s |",
        "|---|---|---|" + "---|" * (len(STAGES) + 2),
    ]
    for w in report["workloads"]:
        for system in ("trl", "honing"):
            summary = w[system]
            stages = summary["stages_s"]
            cells = " | ".join(f"{stages[k]:.3f}" if k in stages else "–" for k in STAGES)
            tokens = summary["completion_tokens_per_s"] * summary["median_step_s"]  # a step's
            rates = " | ".join(
                f"{tokens / stages[k]:,.0f}" if stages.get(k) else "–" for k in ("gen", "update")
            )
            rows.append(
                f"| {w['workload']['name']} | {system} | {summary['median_step_s']:.3f} "
                f"| {cells} | {rates} |"
            )
    return rows


def _scaling_rows(report: dict) -> list[str]:
    rows = [
        "| params | vocab | new tokens | TRL s/step | honing s/step | TRL ms / 1k completion "
        "tokens | honing ms / 1k completion tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    ordered = sorted(
        (w for w in report["workloads"] if w["workload"]["beta"] > 0),
        key=lambda w: (w["params"], w["workload"]["max_new_tokens"]),
    )
    for w in ordered:
        trl, hon = w["trl"], w["honing"]
        rows.append(
            f"| {w['params'] / 1e6:.1f}M | {w['vocab']:,} | {w['workload']['max_new_tokens']} "
            f"| {trl['median_step_s']:.2f} | {hon['median_step_s']:.2f} "
            f"| {1e6 / trl['completion_tokens_per_s']:.0f} "
            f"| {1e6 / hon['completion_tokens_per_s']:.0f} |"
        )
    return rows


def _revisions(report: dict) -> str:
    parts = []
    for w in report["workloads"]:
        found = sorted({r.get("revision", "unrecorded") for r in w["runs"]["honing"]})
        parts.append(f"{w['workload']['name']} {'/'.join(found)}")
    return ", ".join(parts)


def write_markdown(report: dict, path: Path) -> str:
    """Writes the report's tables to ``path`` and returns the text."""
    first = report["workloads"][0]
    trl_run = first["runs"]["trl"][0]
    versions = trl_run["versions"]
    machine = report["machine"]
    lines = [
        "# honing vs TRL GRPOTrainer, side by side",
        "",
        f"Command: `{report['command']}`, {report['wall_s'] / 60:.1f} min in all.",
        "",
        f"Machine: {machine['cpus']} CPUs, {machine['platform']}; honing: Python "
        f"{machine['python']}, torch {machine['torch']}, {report['honing_threads']} threads; "
        f"TRL {versions['trl']} (transformers {versions['transformers']}, torch "
        f"{versions['torch']}), {trl_run['threads']} threads, activation checkpointing "
        f"{'on' if trl_run['activation_checkpointing'] else 'off'} (TRL's default).",
        "",
        "Every workload: random Qwen2, 8 prompts × 8 completions, one optimizer step per "
        "generation batch, lr 1e-3 constant, temperature 1.0, reward 1 iff the completion "
        "starts with the sum; β is the k3 KL loss coefficient (0 = no reference model). Step "
        "time is the interval between consecutive step ends, logging included, first step "
        "excluded; medians pool every measured step of every pair.",
        "",
        "## Results",
        "",
        *_results_rows(report),
        "",
        "honing revisions measured: " + _revisions(report) + ".",
        "",
        "## Where the time goes (median seconds per step)",
        "",
        "gen: generation; ref: reference logprobs; old: pre-update logprobs (honing skips them "
        "when a batch is used once); update: policy forward + loss + backward + optimizer; "
        "sync: the new weights to the engines (honing's in-process engine shares the policy "
        "module; TRL generates with the trained module itself; – where not recorded); "
        "rest: the step less those (collation, advantages, logging, TRL's "
        "tokenisation). gen / update tok/s: a step's completion tokens over the median "
        "generation / update time.",
        "",
        *_stage_rows(report),
        "",
        *[f"Not run: {name}: {why}" for name, why in report.get("not_run", {}).items()],
        "",
        "## Scaling (with a reference model)",
        "",
        *_scaling_rows(report),
        "",
        *([f"- {note}." for note in report.get("notes", [])]),
        "",
    ]
    text = "\n".join(lines)
    path.write_text(text)
    return text
