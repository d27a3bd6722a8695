"""Build every part of a run from the config: model, trainer engines, data, scorer, settings,
and the rollout engines through ``rollout_engines``.

This is the one place that reads the config tree and hands plain values to the layers below
(the data and the scorer: ``inputs``; the rules between keys: ``rules``, checked before).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from honing.algorithms.advantage_registry import AdvantageSettings
from honing.algorithms.kl_control import KLController
from honing.config import Config
from honing.data import PromptSource, warmstart_corpus
from honing.data.solve_rates import SolveRates
from honing.errors import ConfigError
from honing.models.loading import (
    apply_lora,
    check_mergeable,
    check_model_dir,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    set_activation_checkpointing,
)
from honing.models.tiny import TINY, TINY_MOE, TINY_TOOLS, TinySpec, build_tiny_model, tools_corpus
from honing.pipeline.inputs import (
    build_scorer,
    check_ground_truths,
    keep_tokenized,
    load_datasets,
    tokenize_prompts,
)
from honing.pipeline.rollout_engines import build_rollout_engines, frozen_model, train_sampling
from honing.pipeline.rules import (
    advantage_settings,
    check_policy_routing,
    check_remote_routing,
    rollout_correction,
)
from honing.rewards import Scorer
from honing.rollout.base import Holding, RolloutEngine, SamplingParams
from honing.rollout.native.engine import TransformersEngine
from honing.rollout.remote.teacher import RemoteTeacher
from honing.trainer.critic import ValueModel
from honing.trainer.engine import TrainedModule, TrainerEngine, make_layout
from honing.trainer.layouts import Layout
from honing.trainer.optim import build_optimizer
from honing.trainer.packed import packed_supported
from honing.trainer.policy_update import UpdateSettings
from honing.types import Prompt

BUILTIN_TINY = "builtin:tiny"
BUILTIN_TINY_MOE = "builtin:tiny-moe"
BUILTIN_TINY_TOOLS = "builtin:tiny-tools"
# The embedded model's warm start: problems, operand size and the teacher's carry-slip rate.
TINY_CORPUS_SIZE = 20000
TINY_MAX_DIGITS = 2
TINY_SLIP_RATE = 0.7


@dataclass(frozen=True)
class Trainers:
    """The run's trained modules, each behind its trainer engine: the policy, and the critic
    (``algorithm.advantage=gae``) and the MTP heads (``rollout.speculative=mtp``) when present.
    Whatever concerns all of them (checkpoints, the torchrun state message, offload)
    iterates ``all()``."""

    policy: TrainerEngine
    critic: TrainerEngine | None = None
    mtp: TrainerEngine | None = None

    def all(self) -> list[TrainerEngine]:
        return [e for e in (self.policy, self.critic, self.mtp) if e is not None]


@dataclass(frozen=True)
class Components:
    """Everything the loop needs, built once per run. Frozen: a stage that needs another view
    (the producer's engine and scorers, the Ray pools, a rollback's settings) makes one with
    ``dataclasses.replace``; the objects inside keep their own state (weights, the data
    cursor, the KL controller's coefficient)."""

    model_path: Path
    device: torch.device
    tokenizer: object
    trainers: Trainers
    reference: torch.nn.Module | None  # the frozen reference (kl_coef > 0, not LoRA)
    engine: RolloutEngine  # samples the training batches (in-process or remote)
    val_engine: TransformersEngine  # in-process on the policy itself: validation
    scorer: Scorer
    train_prompts: list[Prompt]
    val_prompts: list[Prompt]
    prompt_ids: dict[str, list[int]]  # rendered and tokenized, by prompt id
    rendered: dict[str, str]
    source: PromptSource
    update_settings: UpdateSettings
    advantage_settings: AdvantageSettings
    train_sampling: SamplingParams
    kl_controller: KLController
    skipped_rows: int
    # Another scorer like ``scorer`` (the async producer's scoring threads each need one).
    make_scorer: Callable[[], Scorer] | None = None
    # on-policy distillation's teacher: frozen, or served (rollout/remote/teacher.py)
    teacher: torch.nn.Module | RemoteTeacher | None = None

    @property
    def policy(self) -> torch.nn.Module:
        """The policy module (the in-process engines sample with it)."""
        return self.trainers.policy.module


def cache_dir(config: Config) -> Path:
    if config.model.cache_dir:
        return Path(config.model.cache_dir).expanduser()
    return Path(os.environ.get("HONING_CACHE", "~/.cache/honing")).expanduser()


def resolve_model_path(config: Config, log=print) -> Path:
    """A local model directory; ``builtin:tiny``, ``-moe`` and ``-tools`` are built (or found
    in the cache) first."""
    specs = {BUILTIN_TINY: TINY, BUILTIN_TINY_MOE: TINY_MOE, BUILTIN_TINY_TOOLS: TINY_TOOLS}
    if config.model.path in specs:
        return builtin_tiny_model(cache_dir(config), log=log, spec=specs[config.model.path])
    return check_model_dir(config.model.path)


def builtin_tiny_model(directory: Path, log=print, spec: TinySpec = TINY) -> Path:
    """The embedded model (``spec``: the dense one, ``TINY_MOE`` or ``TINY_TOOLS``), warm-started
    on the arithmetic task's sloppy-teacher corpus (``TINY_TOOLS``: ``tiny.tools_corpus``).

    The warm start uses training pairs only; held-out validation pairs never appear in it.
    """
    if spec.tool_tags:
        return build_tiny_model(directory, tools_corpus(), spec, log=log)
    corpus = warmstart_corpus(
        TINY_CORPUS_SIZE, seed=0, max_digits=TINY_MAX_DIGITS, slip_rate=TINY_SLIP_RATE
    )
    return build_tiny_model(directory, corpus, spec, log=log)


def tis_level(config: Config) -> str:
    """``algorithm.tis_level`` with ``auto`` resolved: token-level truncated importance
    sampling when rollouts come from an older policy version (one_step / async), else none;
    none under rollout correction (``algorithm.rollout_is`` / ``rollout_rs``), which then
    says the whole correction."""
    level = config.algorithm.tis_level
    if level == "auto":
        sync = config.schedule.mode == "sync"
        return "none" if sync or rollout_correction(config) is not None else "token"
    return level


def update_settings(config: Config) -> UpdateSettings:
    algo, trainer = config.algorithm, config.trainer
    return UpdateSettings(
        policy_loss=algo.policy_loss,
        loss_agg=algo.loss_agg,
        clip_ratio_low=algo.clip_ratio_low,
        clip_ratio_high=algo.clip_ratio_high,
        kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef,  # a loss term, or a reward
        kl_estimator=algo.kl_estimator,
        entropy_coef=algo.entropy_coef,
        ppo_epochs=trainer.ppo_epochs,
        mini_batch_sequences=trainer.mini_batch_size * config.rollout.group_size,
        micro_batch_size=trainer.micro_batch_size,
        max_tokens_per_micro=trainer.max_tokens_per_micro,
        grad_clip=trainer.grad_clip,
        temperature=config.rollout.temperature,
        clip_ratio_c=algo.clip_ratio_c,
        loss_scale_len=config.rollout.max_new_tokens,
        autocast=trainer.autocast,
        packed=trainer.packed_forward,
        router_aux_coef=algo.router_aux_coef,
        router_z_coef=algo.router_z_coef,
        tis_level=tis_level(config),
        tis_cap=algo.tis_cap,
        correction=rollout_correction(config),
    )


def build_components(config: Config, log=print, group=None) -> Components:
    """The run's parts from ``config`` (checked by ``rules.check_config`` first). ``group``:
    the torchrun process group, when the run has several ranks; the policy and the critic
    then train replicated over it."""
    scorer = build_scorer(config)
    train, val, skipped = load_datasets(config)
    check_ground_truths(train + val, scorer)
    device = resolve_device(config.model.device)
    model_path = resolve_model_path(config, log=log)
    m, rollout = config.model, config.rollout
    tokenizer = load_tokenizer(model_path, trust_remote_code=m.trust_remote_code)
    policy = load_causal_lm(
        model_path, tokenizer, dtype=m.dtype, device=device, trust_remote_code=m.trust_remote_code
    )
    if m.gradient_checkpointing:
        set_activation_checkpointing(policy, True)
    check_policy_routing(config, policy)
    if m.lora_rank:
        policy = apply_lora(policy, m.lora_rank, m.lora_alpha, m.lora_target_modules)
        if rollout.engine in ("vllm", "openai") or config.pipeline.backend == "ray":
            check_mergeable(policy)  # engines in other processes get the adapters merged
    layout = trainer_layout(config, group, log)
    # A sharded policy cannot sample on one rank alone: generation gets a whole copy of its
    # own (the engine's generation_module), which takes the weights after each update.
    trainer = policy_trainer(config, policy, layout)
    policy, sampler = trainer.module, trainer.generation_module
    if config.trainer.packed_forward and (reason := packed_supported(policy)) is not True:
        log(f"trainer.packed_forward: logprob passes use the model's own forward ({reason})")
    reference = None
    if config.algorithm.kl_coef > 0 and not m.lora_rank:  # LoRA: the base, adapters off
        reference = trainer.lay_out_alike(frozen_model(model_path, tokenizer, m, device))
    teacher = None
    if config.algorithm.teacher_path:  # on-policy distillation's teacher, laid out alike
        teacher = trainer.lay_out_alike(load_teacher(config, tokenizer, device))
    elif config.algorithm.teacher_endpoint:  # or served
        teacher = served_teacher(config, tokenizer, [p.prompt for p in train[:4]])
    rendered, prompt_ids = tokenize_prompts(
        train + val, tokenizer, rollout.max_seq_len, config.data.on_bad_row
    )
    train, val, skipped = keep_tokenized(train, val, skipped, prompt_ids)
    holds = Holding.SHARED if sampler is policy else Holding.COPY
    engines = build_rollout_engines(
        config, sampler, tokenizer, device, holds, model_path, trainer, log=log
    )
    check_remote_routing(config, engines.train, next(iter(prompt_ids.values())))
    engine, val_engine, local = engines.with_tools(tokenizer, rollout)
    trainers = Trainers(
        policy=trainer,
        critic=critic_trainer(config, model_path, tokenizer, device, layout),
        mtp=mtp_trainer(config, local),
    )
    t = config.trainer
    return Components(
        model_path=model_path,
        device=device,
        tokenizer=tokenizer,
        trainers=trainers,
        reference=reference,
        engine=engine,
        val_engine=val_engine,
        scorer=scorer,
        train_prompts=train,
        val_prompts=val,
        prompt_ids=prompt_ids,
        rendered=rendered,
        source=PromptSource(
            train,
            rollout.batch_size,
            seed=t.seed,
            shuffle=config.data.shuffle,
            solve_rates=solve_rates(config),
        ),
        update_settings=update_settings(config),
        advantage_settings=advantage_settings(config),
        train_sampling=train_sampling(config),
        skipped_rows=skipped,
        kl_controller=KLController(
            config.algorithm.kl_coef,
            config.algorithm.kl_ctrl,
            config.algorithm.kl_target,
            config.algorithm.kl_horizon,
        ),
        make_scorer=lambda: build_scorer(config),
        teacher=teacher,
    )


def load_teacher(config: Config, tokenizer, device: torch.device) -> torch.nn.Module:
    """On-policy distillation's teacher (``algorithm.teacher_path``), frozen.

    Raises:
        ConfigError: its directory is missing, or its tokenizer is not the policy's (the two
            models' logprobs must be of the same token ids).
    """
    path = Path(config.algorithm.teacher_path).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"algorithm.teacher_path={path}: no Hugging Face model there (no config.json)"
        )
    m = config.model
    theirs = load_tokenizer(path, trust_remote_code=m.trust_remote_code)
    ours, vocab = tokenizer.get_vocab(), theirs.get_vocab()
    if ours != vocab:
        differ = len(set(ours.items()) ^ set(vocab.items()))
        raise ConfigError(
            f"algorithm.teacher_path={path}: its tokenizer is not the policy's ({len(vocab)} "
            f"tokens against {len(ours)}, {differ} entries differ); distillation compares "
            "the two models' logprobs of the same token ids: use a teacher with the policy's "
            "tokenizer"
        )
    return frozen_model(path, tokenizer, m, device)


def served_teacher(config: Config, tokenizer, texts: list) -> RemoteTeacher:
    """On-policy distillation's teacher behind ``algorithm.teacher_endpoint``, its tokenizer
    checked against the policy's on ``texts`` (a few prompts)."""
    algo, rollout = config.algorithm, config.rollout
    teacher = RemoteTeacher(
        algo.teacher_endpoint,
        model=algo.teacher_model,
        timeout_s=rollout.timeout_s,
        retries=rollout.retries,
    )
    teacher.check_tokenizer(tokenizer, [t if isinstance(t, str) else str(t) for t in texts])
    return teacher


def solve_rates(config: Config) -> SolveRates | None:
    """The prompts' solve rates under ``data.skip_solved`` / ``skip_unsolved`` (else None)."""
    data = config.data
    if not (data.skip_solved or data.skip_unsolved):
        return None
    least = data.solve_rate_min_samples or config.rollout.group_size
    return SolveRates(data.skip_solved, data.skip_unsolved, least)


def trainer_layout(config: Config, group, log=print):
    """How the trained modules are laid out: whole in this process; under torchrun
    (``group``) replicated on every rank, or sharded over them (``trainer.strategy=fsdp``),
    split over tensor-parallel slots (``trainer.tensor_parallel``), the experts shared by
    expert-parallel slots (``trainer.expert_parallel``)."""
    t, memory = config.trainer, config.memory
    if (memory.param_offload or memory.optimizer_offload) and resolve_device(
        config.model.device
    ).type != "cuda":
        log("memory.param_offload / optimizer_offload: no CUDA device, nothing to offload")
    if group is None and t.strategy == "fsdp":
        log("trainer.strategy=fsdp: one process (not launched by torchrun): trains whole")
    return make_layout(
        t.strategy,
        group,
        reshard_after_forward=t.fsdp_reshard_after_forward,
        param_dtype=t.fsdp_param_dtype,
        param_offload=memory.param_offload,
        sequence=t.sequence_parallel,
        tensor=t.tensor_parallel,
        expert=t.expert_parallel,
    )


def policy_trainer(config: Config, policy, layout: Layout) -> TrainedModule:
    """The policy laid out by ``layout``, with its AdamW (over its trainable parameters) and
    learning-rate schedule."""
    t = config.trainer

    def optimizer(module):
        return build_optimizer(
            module,
            lr=t.lr,
            weight_decay=t.weight_decay,
            betas=t.betas,
            warmup_steps=t.warmup_steps,
            total_steps=t.total_steps,
            schedule=t.lr_schedule,
            min_ratio=t.min_lr_ratio,
        )

    return TrainedModule.laid_out(
        "policy",
        policy,
        layout,
        optimizer,
        serves_generation=True,
        bucket_bytes=config.rollout.weight_bucket_mb << 20,
        optimizer_offload=config.memory.optimizer_offload,
    )


def critic_trainer(config: Config, model_path: Path, tokenizer, device, layout):
    """``algorithm.advantage=gae``: a value head on a copy of the backbone
    (``model.critic_path``, default ``model.path``) with its own AdamW; else None."""
    if config.algorithm.advantage != "gae":
        return None
    m = config.model
    critic_dir = model_path
    if m.critic_path:
        critic_dir = check_model_dir(m.critic_path, "model.critic_path")
    backbone = load_causal_lm(
        critic_dir, tokenizer, dtype=m.dtype, device=device, trust_remote_code=m.trust_remote_code
    )
    t = config.trainer

    def optimizer(module):
        return torch.optim.AdamW(
            module.parameters(), lr=t.critic_lr, weight_decay=t.weight_decay
        ), None

    return TrainedModule.laid_out(
        "critic",
        ValueModel(backbone).to(device),
        layout,
        optimizer,
        optimizer_offload=config.memory.optimizer_offload,
    )


def mtp_trainer(config: Config, local: TransformersEngine):
    """``rollout.speculative=mtp``: the heads the engine drafts with, trained online in this
    process (under torchrun: on rank 0, which alone drafts with them); else None."""
    if config.rollout.speculative != "mtp":
        return None
    heads = local.speculation.draft_model
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.rollout.mtp_lr)
    bucket_bytes = config.rollout.weight_bucket_mb << 20
    return TrainedModule("mtp", heads, optimizer, serves_generation=True, bucket_bytes=bucket_bytes)
