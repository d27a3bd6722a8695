"""``train``: a run from its config, wherever its processes are to run.

One process by default; under torchrun with several ranks, data parallel over them
(``torchrun``); with ``pipeline.backend=ray``, the trainer, rollout and reward workers as Ray
actors (``ray_run``, imported only then). The config's cross-field rules and the run directory
are checked first, before anything loads.
"""

from __future__ import annotations

from pathlib import Path

from honing.backends import torchrun
from honing.config import Config
from honing.pipeline.rollout_engines import choose_engine
from honing.pipeline.rules import check_config
from honing.pipeline.run import check_run_dir, stderr_log, train_here


def train(config: Config, run_dir: Path, resume: str = "auto", log=None) -> dict:
    """Train per ``config`` into ``run_dir``; returns the summary (also in summary.json;
    empty on torchrun ranks other than 0, which write nothing)."""
    log = log or stderr_log
    world_size = torchrun.world()[1]
    config = choose_engine(config, world_size, log)
    check_config(config, world_size)
    check_run_dir(run_dir)
    if config.pipeline.backend == "ray":
        from honing.backends.ray_run import train_on_ray  # ray is imported only for Ray runs

        return train_on_ray(config, run_dir, resume)
    if world_size > 1 or torchrun.offloads_alone(config):
        return torchrun.train_ranks(config, run_dir, resume, log)
    return train_here(config, run_dir, resume, log)
