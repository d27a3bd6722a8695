"""The table of transformers' mixture-of-experts families in docs/moe.md, measured: for each
top-k routed causal-LM family of the installed transformers, a tiny random model (built as
tests/models/moe_families.py builds it) and what honing makes of it: its routers found or
not, their recipe, routing replay exact (replaying the routers' own choice gives the same
logits bit for bit) or refused with the reason.

    .venv/bin/python -m benchmarks.moe_families            # transformers of .venv
    .venv-tf-5.25.0/bin/python -m benchmarks.moe_families  # another installed version

Writes benchmarks/results/moe_families_<version>.md and prints the counts.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import transformers

from honing.models.moe import routers_of
from honing.models.moe_families import NOT_ROUTED
from honing.models.moe_mixing import Mixing
from tests.models.moe_families import build, moe_families

RESULTS = Path(__file__).parent / "results"
SCORE_WORDS = {
    "softmax": "softmax over all experts",
    "softmax_topk": "softmax over the top-k logits",
    "sigmoid": "sigmoid",
    "sqrtsoftplus": "sqrt(softplus)",
    "probabilities": "the router's probabilities",
}


def describe(recipe) -> str:
    """A recipe in words."""
    extra = []
    while not isinstance(recipe, Mixing):  # a family's wrapper around a recipe
        extra.append("× a learned per-expert scale" if hasattr(recipe, "scale") else "")
        recipe = recipe.base
    words = [SCORE_WORDS[recipe.score]]
    if recipe.normalise:
        words.append("renormalised")
    if recipe.scale != 1.0:
        words.append("scaled")
    return ", ".join(words + [e for e in extra if e])


def outcome(family: str) -> tuple[str, str, str]:
    """(found, replay, how or why) for ``family``."""
    if family in NOT_ROUTED:
        return "no", "refused", NOT_ROUTED[family]
    model = build(family)
    routers = routers_of(model)
    if routers is None:
        return "no", "refused", "no top-k routed MoE layers found"
    reason = routers.check_replay()
    if reason is not None:
        return (
            "yes",
            "refused",
            reason.replace(f"the {family} family's ", "its ").replace(f"the {family} family ", ""),
        )
    recipes = {describe(m) for m in routers.mixing.values()}
    how = "; ".join(sorted(recipes))
    if any(routers.adapter.hashed(r) for r in routers.routers):
        how += "; hash-routed layers (by token id) need no plan"
    if routers.null_experts:
        how += f"; {routers.null_experts} null slot(s) counted apart"
    with torch.no_grad():
        ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
        with routers.session(record=True) as session:
            plain = model(ids).logits
        [recorded] = session.recorded_calls()
        with routers.session(replay=recorded.long()):
            again = model(ids).logits
    assert torch.equal(plain, again), family
    return "yes", "exact", how


def main() -> None:
    started = time.perf_counter()
    rows, counts = [], {"families": 0, "found": 0, "exact": 0, "refused": 0}
    for family in moe_families():
        found, replay, how = outcome(family)
        rows.append(f"| `{family}` | {found} | {replay} | {how} |")
        counts["families"] += 1
        counts["found"] += found == "yes"
        counts[replay] += 1
    version = transformers.__version__
    lines = [
        f"`python -m benchmarks.moe_families` with transformers {version} "
        f"({time.perf_counter() - started:.0f} s): {counts}",
        "",
        "| family | routers found | routing replay | recipe, or why refused |",
        "|---|---|---|---|",
        *rows,
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"moe_families_{version}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
