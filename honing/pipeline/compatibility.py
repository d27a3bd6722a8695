"""What combines with what: honing's features two by two, as ``pipeline/rules.py`` decides.

A feature is what turning it on means: config overrides (``section.key=value``, as ``honing
train`` takes them) and the number of torchrun ranks it is launched with (under Ray, trainer
actors). A pair runs with both features' overrides on ``BASE`` at the larger rank count, and
its verdict is what ``check_config`` says of that config: nothing (the pair combines) or its
one-line refusal.
The table in docs/compatibility.md is ``table()``, written by ``python -m
honing.pipeline.compatibility --write``; nothing here keeps a rule of its own. What is
checked only once the model has loaded (the model's family, its heads) is not in it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

from honing.config import Config, build_config, parse_overrides
from honing.errors import ConfigError
from honing.pipeline.rules import check_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
BEGIN, END = "<!-- compatibility:begin -->", "<!-- compatibility:end -->"
# What every verdict starts from: the built-in tiny model, task and reward (no file read).
BASE = ("model.path=builtin:tiny",)


@dataclass(frozen=True)
class Feature:
    name: str
    overrides: tuple[str, ...]  # section.key=value, as the command line takes them
    world_size: int = 1  # torchrun ranks; 1: one process


FEATURES = (
    Feature("vLLM", ("rollout.engine=vllm",)),
    Feature("servers", ("rollout.engine=openai", "rollout.endpoints=http://127.0.0.1:1")),
    Feature("partial rollouts", ("schedule.mode=async", "schedule.partial_rollout=true")),
    Feature("tools", ("rollout.tools=calculator",)),
    Feature("SP", ("trainer.sequence_parallel=2",), world_size=2),
    Feature("FSDP", ("trainer.strategy=fsdp",), world_size=2),
    Feature("TP", ("trainer.tensor_parallel=2",), world_size=2),
    # 4 ranks: 2 groups of 2 slots alone, and 2 slots of 2 under TP=2
    Feature("EP", ("trainer.expert_parallel=2",), world_size=4),
    Feature("torchrun", (), world_size=2),
    Feature("Ray", ("pipeline.backend=ray",)),
    Feature("R3", ("algorithm.routing_replay=R3",)),
    Feature("LoRA", ("model.lora_rank=4",)),
    Feature("MTP", ("rollout.speculative=mtp",)),
    Feature("async", ("schedule.mode=async",)),
)


def clash(a: Feature, b: Feature) -> str | None:
    """Where ``a`` and ``b`` set one key to two values, they are two choices of that key,
    not a pair: the line saying so, else None."""
    mine, theirs = parse_overrides(list(a.overrides)), parse_overrides(list(b.overrides))
    for key in sorted(mine.keys() & theirs.keys()):
        if mine[key] != theirs[key]:
            return f"{key} takes one value, {mine[key]} or {theirs[key]}"
    return None


def config_for(*features: Feature) -> tuple[Config, int]:
    """``BASE`` with every feature's overrides on top, and the torchrun ranks the largest
    asks; under Ray those ranks are trainer actors (``pipeline.trainer_workers``)."""
    overrides = [*BASE, *(item for feature in features for item in feature.overrides)]
    world_size = max((feature.world_size for feature in features), default=1)
    values = parse_overrides(overrides)
    if values.get("pipeline.backend") == "ray" and world_size > 1:
        values["pipeline.trainer_workers"] = world_size
        world_size = 1
    return build_config(values), world_size


def verdict(*features: Feature) -> str | None:
    """None where the rules take ``features`` together, else the rules' one-line refusal."""
    config, world_size = config_for(*features)
    try:
        check_config(config, world_size)
    except ConfigError as refusal:
        return str(refusal)
    return None


def pair_verdict(a: Feature, b: Feature) -> str | None:
    """None where ``a`` and ``b`` combine, else why not: the rules' refusal, or the key both
    set to different values."""
    return clash(a, b) or verdict(a, b)


def _matrix(verdicts: dict[tuple[int, int], str | None], clashes: set[tuple[int, int]]) -> str:
    names = [feature.name for feature in FEATURES]
    lines = ["| | " + " | ".join(names) + " |", "|---" + "|:-:" * len(names) + "|"]
    for i, name in enumerate(names):
        cells = []
        for j in range(len(names)):
            pair = (min(i, j), max(i, j))
            if i == j:
                cells.append("—")
            elif pair in clashes:
                cells.append("·")
            else:
                cells.append("✗" if verdicts[pair] else "✓")
        lines.append(f"| **{name}** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _features_list() -> str:
    lines = ["| feature | overrides | ranks |", "|---|---|---:|"]
    for feature in FEATURES:
        overrides = ", ".join(f"`{item}`" for item in feature.overrides) or "(none)"
        lines.append(f"| {feature.name} | {overrides} | {feature.world_size} |")
    return "\n".join(lines)


def table() -> str:
    """The generated section of docs/compatibility.md: the features, the matrix, each refused
    pair with its reason and the counts."""
    pairs = list(itertools.combinations(range(len(FEATURES)), 2))
    verdicts = {(i, j): pair_verdict(FEATURES[i], FEATURES[j]) for i, j in pairs}
    clashes = {(i, j) for i, j in pairs if clash(FEATURES[i], FEATURES[j])}
    refused = [(i, j) for i, j in pairs if verdicts[i, j] and (i, j) not in clashes]
    combine = len(pairs) - len(refused) - len(clashes)
    not_pairs = [
        f"{FEATURES[i].name} and {FEATURES[j].name}: {verdicts[i, j]}" for i, j in sorted(clashes)
    ]
    counts = f"**{len(refused)} of {len(pairs)} pairs refused**, {combine} combine"
    if not_pairs:
        counts += f", {len(not_pairs)} not a pair ({'; '.join(not_pairs)})"
    parts = [
        _features_list(),
        "✓ combines, ✗ refused by the rules, · two values of one key, — the feature itself.",
        _matrix(verdicts, clashes),
        counts + ".",
    ]
    if alone := [(f.name, reason) for f in FEATURES if (reason := verdict(f))]:
        parts.append(
            "Refused alone (so is every pair with it): "
            + "; ".join(f"{name}: {reason}" for name, reason in alone)
            + "."
        )
    if refused:
        parts.append(
            "\n".join(
                f"{n}. {FEATURES[i].name} + {FEATURES[j].name}: {verdicts[i, j]}"
                for n, (i, j) in enumerate(refused, start=1)
            )
        )
    return "\n\n".join(parts) + "\n"


def section(text: str) -> str:
    """The generated section of a page's ``text``: what lies between the markers."""
    _, begin, rest = text.partition(BEGIN)
    body, end, _ = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the page has no section between {BEGIN} and {END}")
    return body.strip("\n") + "\n"


def write(path: Path = DOC) -> None:
    """Rewrites the generated section of the page at ``path`` with ``table()``."""
    text, new = path.read_text(encoding="utf-8"), table()
    old = section(text)
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n\n{new}\n{END}{tail}", encoding="utf-8")
    print(f"{path}: {'unchanged' if old == new else 'rewritten'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m honing.pipeline.compatibility", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--write", action="store_true", help=f"rewrite the section of {DOC}")
    args = parser.parse_args(argv)
    if not args.write:
        print(table(), end="")
        return 0
    if alone := [f.name for f in FEATURES if verdict(f)]:
        print(
            f"not written: {', '.join(alone)} refused alone here (python -m "
            "honing.pipeline.compatibility says why); write it where each feature runs",
            file=sys.stderr,
        )
        return 1
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
