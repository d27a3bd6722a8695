"""The rules that tie the launch (torchrun ranks, Ray's actors) to the keys that lay the run
out over them: the backend, the data-parallel ranks a mini-batch is dealt to, the ranks
sharing each sequence, weight or expert group, vLLM in the ranks. Part of ``check_config``
(``pipeline/rules.py``): each is a one-line ``ConfigError`` naming the keys and the launch.
"""

from __future__ import annotations

from honing.config import Config
from honing.errors import ConfigError


def check_ranks(config: Config, world_size: int) -> None:
    """Raises ``ConfigError`` for the first rule the launch of ``world_size`` torchrun ranks
    (or, under Ray, ``pipeline.trainer_workers`` actors) breaks."""
    _backend(config, world_size)
    if config.pipeline.backend == "ray":  # the trainer actors are the ranks
        world_size = config.pipeline.trainer_workers
    _trainer_parallel(config, world_size)
    t = config.trainer
    _ranks(config, world_size // (t.sequence_parallel * t.tensor_parallel))
    _vllm(config, world_size)


def _ranks(config: Config, world_size: int) -> None:
    """Under torchrun each rank trains on its share of every mini-batch's sequences
    (``replicate`` and ``fsdp`` alike, the critic's mini-batches being the policy's), so the
    smallest mini-batch needs one per rank. Dynamic sampling may train a batch of a single
    group; a batch that ``reward.on_error=drop`` shrinks is not known before it is scored."""
    if world_size <= 1:
        return
    r, mini = config.rollout, config.trainer.mini_batch_size
    ranks = "trainer actors" if config.pipeline.backend == "ray" else "torchrun ranks"
    if config.algorithm.dynamic_sampling and r.group_size < world_size:
        raise ConfigError(
            f"algorithm.dynamic_sampling may train a batch of one group, whose rollout."
            f"group_size={r.group_size} sequences {world_size} {ranks} cannot share; "
            f"raise rollout.group_size to {world_size} or run at most {r.group_size} ranks"
        )
    if not mini or mini >= r.batch_size:  # the whole batch in one mini-batch
        smallest, fix = r.batch_size * r.group_size, "raise rollout.batch_size or group_size"
    elif mini * r.group_size < world_size:
        smallest, fix = mini * r.group_size, "raise trainer.mini_batch_size"
    else:  # the batch's last mini-batch is what is left over
        smallest = (r.batch_size % mini or mini) * r.group_size
        fix = "make trainer.mini_batch_size divide rollout.batch_size"
    if smallest < world_size:
        raise ConfigError(
            f"a mini-batch of {smallest} sequences (rollout.batch_size={r.batch_size}, "
            f"group_size={r.group_size}, trainer.mini_batch_size={mini}) cannot be shared by "
            f"{world_size} {ranks}; {fix}, or run at most {smallest} ranks"
        )


def _trainer_parallel(config: Config, world_size: int) -> None:
    """``trainer.sequence_parallel=N`` (N torchrun ranks share each sequence),
    ``trainer.tensor_parallel=N`` (N ranks split each weight) and ``trainer.expert_parallel=N``
    (N data-parallel slots share the routed experts): the ranks come in whole groups of N;
    tensor and expert parallelism do not combine with LoRA or dynamic offload yet, nor with
    SP. What the model must be (heads N divides, its family, full causal attention, experts
    N divides) is checked when it has loaded."""
    t = config.trainer
    ray = config.pipeline.backend == "ray"
    ranks = "trainer actors" if ray else "torchrun ranks"
    for name, n, what in (
        ("sequence_parallel", t.sequence_parallel, "share each sequence"),
        ("tensor_parallel", t.tensor_parallel, "split each weight"),
        ("expert_parallel", t.expert_parallel, "share the experts"),
    ):
        key = f"trainer.{name}={n}"
        launch = (
            f"set pipeline.trainer_workers={n}"
            if ray
            else f"launch with torchrun --nproc_per_node {n}"
        )
        if n > 1 and world_size <= 1:
            raise ConfigError(
                f"{key} needs {ranks} to {what}; {launch} (or a multiple), or set trainer.{name}=1"
            )
        if world_size % n:
            raise ConfigError(
                f"{key}: {world_size} {ranks} do not split into groups of {n}; {launch} or a "
                "multiple of it"
            )
    slots = world_size // (t.sequence_parallel * t.tensor_parallel)
    if slots % t.expert_parallel:
        raise ConfigError(
            f"trainer.expert_parallel={t.expert_parallel}: {world_size} {ranks} make {slots} "
            f"data-parallel slots (of trainer.sequence_parallel x tensor_parallel ranks), which "
            f"do not split into groups of {t.expert_parallel}"
        )
    for key, n in (("tensor_parallel", t.tensor_parallel), ("expert_parallel", t.expert_parallel)):
        for other, value, off in (
            ("trainer.sequence_parallel", t.sequence_parallel, 1),
            ("model.lora_rank", config.model.lora_rank, 0),
            ("memory.dynamic_offload", config.memory.dynamic_offload, False),
        ):
            if n > 1 and value != off:
                raise ConfigError(
                    f"trainer.{key}={n} does not combine with {other}={str(value).lower()} "
                    f"yet: set {other}={str(off).lower()} or trainer.{key}=1"
                )


def custom_resources(text: str) -> dict[str, float]:
    """``pipeline.rollout_resources`` as Ray takes it: ``"spot=1,zone_a=0.5"`` ->
    ``{"spot": 1.0, "zone_a": 0.5}``; a ``ConfigError`` naming the piece that is not
    ``NAME=AMOUNT`` with a positive amount."""
    out: dict[str, float] = {}
    for piece in filter(None, (p.strip() for p in text.split(","))):
        name, _, amount = piece.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not name.strip() or value <= 0 or name.strip() in ("CPU", "GPU", "memory"):
            raise ConfigError(
                f"pipeline.rollout_resources: {piece!r} is not NAME=AMOUNT with a custom "
                "resource's name and an amount > 0 (e.g. spot=1; CPUs and GPUs have "
                "pipeline.rollout_cpus / rollout_gpus)"
            )
        out[name.strip()] = value
    return out


def _backend(config: Config, world_size: int) -> None:
    """``pipeline.backend=ray``: ``pipeline.trainer_workers`` trainer actors, their rollout
    workers running honing's engine or vLLM (``rollout.engine=vllm``), or the servers they
    sample from; the ``pipeline.*`` keys only Ray reads set only with it."""
    settings = config.pipeline
    if settings.backend != "ray":
        for key, default in (
            ("trainer_workers", 1),
            ("autoscale_max", 0),
            ("rollout_resources", ""),
        ):
            if getattr(settings, key) != default:
                raise ConfigError(f"pipeline.{key} applies to pipeline.backend=ray")
        return
    if world_size > 1:
        raise ConfigError(
            "pipeline.backend=ray does not run under torchrun; start one process and set "
            "pipeline.trainer_workers=N for N trainer ranks"
        )
    custom_resources(settings.rollout_resources)
    if settings.autoscale_max and not (
        settings.autoscale_min <= settings.rollout_workers <= settings.autoscale_max
    ):
        raise ConfigError(
            f"pipeline.autoscale_max={settings.autoscale_max}: the rollout workers scale "
            f"between pipeline.autoscale_min={settings.autoscale_min} and it, starting at "
            f"pipeline.rollout_workers={settings.rollout_workers}, which must lie between them"
        )


def _vllm(config: Config, world_size: int) -> None:
    """``rollout.engine=vllm``: vLLM is installed and the settings honing's own engine alone
    has are off; under torchrun every rank holds an engine, shared by
    ``rollout.tensor_parallel`` consecutive ranks."""
    rollout = config.rollout
    _vllm_tensor_parallel(config, world_size)
    if rollout.engine != "vllm":
        return
    from honing.rollout.vllm.engine import vllm_available

    if (hint := vllm_available()) is not None:
        raise ConfigError(hint)
    if rollout.vllm_sleep and config.schedule.mode != "sync":
        raise ConfigError(
            "rollout.vllm_sleep frees vLLM's memory while the trainer updates, which under "
            f"schedule.mode={config.schedule.mode} it does while vLLM generates: use sync"
        )
    if rollout.gen_timeout_s:
        raise ConfigError(
            "rollout.gen_timeout_s cuts honing's own engine's generation; vLLM's has no such "
            "cut: set it to 0, or bound responses with rollout.max_new_tokens"
        )
    if config.algorithm.routing_replay == "R3":
        raise ConfigError(
            "algorithm.routing_replay=R3 needs the experts the engine routed to; vLLM "
            "returns them only from its V2 model runner, which needs Triton (a GPU), and "
            "honing does not ask it for them: use R2 (the trainer's own first pass), "
            "rollout.engine=transformers, or vLLM servers started with "
            "--enable-return-routed-experts"
        )


def _vllm_tensor_parallel(config: Config, world_size: int) -> None:
    """``rollout.tensor_parallel=N``: vLLM in each torchrun rank, shared by N consecutive
    ranks that make every generate call together."""
    n = config.rollout.tensor_parallel
    if n == 1:
        return
    key = f"rollout.tensor_parallel={n}"
    if config.pipeline.backend == "ray":
        raise ConfigError(
            f"{key} shares vLLM between torchrun ranks; under pipeline.backend=ray each "
            "rollout worker holds a whole engine: set rollout.tensor_parallel=1"
        )
    if config.rollout.engine != "vllm":
        raise ConfigError(
            f"{key} applies to rollout.engine=vllm (vLLM in each torchrun rank); start servers "
            "with their own --tensor-parallel-size, or set rollout.tensor_parallel=1"
        )
    if world_size % n or world_size < n:
        raise ConfigError(
            f"{key}: vLLM is shared by groups of {n} torchrun ranks; {world_size} rank(s) do "
            f"not split into them: launch a multiple of {n} ranks"
        )
    if not config.pipeline.spread_generation:
        raise ConfigError(
            f"{key}: the ranks that share an engine generate together; set "
            "pipeline.spread_generation=true"
        )
    if config.schedule.mode != "sync":
        raise ConfigError(
            f"{key}: schedule.mode={config.schedule.mode} generates on rank 0's thread alone, "
            "and a tensor-parallel engine needs its other ranks in every call; use "
            "schedule.mode=sync or rollout.tensor_parallel=1"
        )
