"""The short-run config the pipeline tests share: micro model, a few tiny steps, no console."""

from honing.config import Config, build_config

BASE = {
    "rollout.batch_size": 2,
    "rollout.group_size": 3,
    "rollout.max_new_tokens": 3,
    "rollout.val_samples": 1,
    "data.train_size": 40,
    "data.val_size": 4,
    "trainer.val_every": 0,
    "monitor.console": False,
    "monitor.tensorboard": False,
}


def small_run_config(model_dir, reward: str, **overrides) -> Config:
    """``BASE`` for ``model_dir`` scored by ``reward``, with ``overrides`` on top."""
    values = BASE | {"model.path": str(model_dir), "reward.function": reward}
    return build_config(values | overrides)


def cli_args(model_dir, reward: str, run_dir=None, **overrides) -> list[str]:
    """``BASE`` with ``overrides`` as ``honing train`` arguments (``--output-dir`` when
    ``run_dir`` is given)."""
    values = BASE | {"model.path": str(model_dir), "reward.function": reward} | overrides
    args = [f"{key}={value}" for key, value in values.items()]
    return args if run_dir is None else [*args, "--output-dir", str(run_dir)]
