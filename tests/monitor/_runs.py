"""Short real runs for the monitor tests: the micro model trained through ``honing train``."""

import json
from pathlib import Path

from honing.cli import main
from tests.pipeline._configs import BASE


def train(model_dir: Path, reward: str, run_dir: Path, *overrides: str, steps: int = 3) -> int:
    """Trains ``steps`` steps of ``BASE`` (validation at the start and end) into ``run_dir``;
    returns the exit status. ``overrides`` are ``section.key=value`` arguments."""
    settings = BASE | {"model.path": model_dir, "reward.function": reward}
    args = [f"{key}={value}" for key, value in settings.items()]
    args.append(f"trainer.total_steps={steps}")
    return main(["train", *args, *overrides, "--output-dir", str(run_dir)])


def logged(run_dir: Path, name: str) -> dict[int, float]:
    """Step -> value of ``name`` in the run's ``metrics.jsonl``."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {record["step"]: record[name] for record in records if name in record}
