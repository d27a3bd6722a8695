"""Build every part of a run from the config: model, data, engine, scorer, optimizer.

This is the one place that reads the config tree and hands plain values to the layers below.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from honing.algorithms.kl_control import KLController
from honing.config import Config
from honing.data import (
    PromptSource,
    arithmetic_prompts,
    load_prompts,
    render_prompt,
    warmstart_corpus,
)
from honing.errors import ConfigError, DataError
from honing.models.loading import (
    apply_lora,
    check_mergeable,
    check_model_dir,
    load_causal_lm,
    load_tokenizer,
    plain_weights,
    resolve_device,
)
from honing.models.tiny import TinySpec, build_tiny_model
from honing.rewards import Scorer, format_reward, numeric_reward, parse_number
from honing.rollout.base import RolloutEngine, SamplingParams
from honing.rollout.mtp import MTP_PREFIX
from honing.rollout.transformers_engine import TransformersEngine
from honing.trainer.critic import ValueModel
from honing.trainer.optim import build_optimizer
from honing.trainer.packed import packed_supported
from honing.trainer.update import UpdateSettings
from honing.types import Prompt

BUILTIN_TINY = "builtin:tiny"
# The embedded model's warm start: problems, operand size and the teacher's carry-slip rate.
TINY_CORPUS_SIZE = 20000
TINY_MAX_DIGITS = 2
TINY_SLIP_RATE = 0.7


@dataclass
class Components:
    """Everything the loop needs, built once per run."""

    model_path: Path
    device: torch.device
    tokenizer: object
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    engine: RolloutEngine  # samples the training batches (in-process or remote)
    val_engine: TransformersEngine  # in-process on the policy itself: validation
    scorer: Scorer
    train_prompts: list[Prompt]
    val_prompts: list[Prompt]
    prompt_ids: dict[str, list[int]]  # rendered and tokenized, by prompt id
    rendered: dict[str, str]
    source: PromptSource
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    update: UpdateSettings
    train_sampling: SamplingParams
    kl_controller: KLController
    skipped_rows: int
    critic: torch.nn.Module | None = None  # gae: a value head on a copy of the backbone
    critic_optimizer: torch.optim.Optimizer | None = None
    # Another scorer like ``scorer`` (the async producer's scoring threads each need one).
    make_scorer: Callable[[], Scorer] | None = None
    mtp: torch.nn.Module | None = None  # rollout.speculative=mtp: the heads, trained online
    mtp_optimizer: torch.optim.Optimizer | None = None


def cache_dir(config: Config) -> Path:
    if config.model.cache_dir:
        return Path(config.model.cache_dir).expanduser()
    return Path(os.environ.get("HONING_CACHE", "~/.cache/honing")).expanduser()


def resolve_model_path(config: Config, log=print) -> Path:
    """A local model directory; ``builtin:tiny`` is built (or found in the cache) first."""
    if config.model.path == BUILTIN_TINY:
        return builtin_tiny_model(cache_dir(config), log=log)
    if not config.model.path:
        raise ConfigError("model.path is empty; give a local model directory or builtin:tiny")
    return check_model_dir(config.model.path)


def builtin_tiny_model(directory: Path, log=print) -> Path:
    """The embedded model, warm-started on the arithmetic task's sloppy-teacher corpus.

    The warm start uses training pairs only; held-out validation pairs never appear in it.
    """
    corpus = warmstart_corpus(
        TINY_CORPUS_SIZE, seed=0, max_digits=TINY_MAX_DIGITS, slip_rate=TINY_SLIP_RATE
    )
    return build_tiny_model(directory, corpus, TinySpec(), log=log)


def load_datasets(config: Config) -> tuple[list[Prompt], list[Prompt], int]:
    """Training and validation prompts, from files when given, else the built-in task."""
    data = config.data
    if data.train_files:
        if not data.val_files:
            raise ConfigError(
                "data.val_files is empty; validation needs held-out prompts "
                "(set data.val_files with data.train_files)"
            )
        train, skipped = load_prompts(data.train_files, on_bad_row=data.on_bad_row)
        val, skipped_val = load_prompts(data.val_files, on_bad_row=data.on_bad_row)
        # Ids name file and row; the prefix keeps a validation row from ever being taken for
        # a training row of a file with the same name.
        val = [dataclasses.replace(p, id=f"val/{p.id}") for p in val]
        return train, val, skipped + skipped_val
    if data.val_files:
        raise ConfigError("data.val_files is set but data.train_files is empty; set both")
    seed = config.trainer.seed
    digits = {"max_digits": data.max_digits, "min_digits": data.min_digits}
    train = arithmetic_prompts("train", data.train_size, seed, **digits)
    val = arithmetic_prompts("val", data.val_size, seed, **digits)
    return train, val, 0


# Characters of a prompt tokenized before the whole of it: any real vocabulary averages
# far fewer characters per token, so a prefix this long that is already too long settles it.
CHARS_PER_TOKEN_BOUND = 32


def tokenize_prompts(prompts: list[Prompt], tokenizer, max_seq_len: int):
    """Render (chat template when the tokenizer has one) and tokenize each distinct prompt.

    A prompt of ``rollout.max_seq_len`` tokens or more is a DataError naming its file and line;
    a very long one is found from its first ``CHARS_PER_TOKEN_BOUND * max_seq_len`` characters,
    without tokenizing all of it."""
    rendered, ids = {}, {}
    special = not getattr(tokenizer, "chat_template", None)  # templates carry their own
    prefix_chars = CHARS_PER_TOKEN_BOUND * max_seq_len
    for prompt in prompts:
        if prompt.id in ids:
            continue
        text = render_prompt(prompt, tokenizer)
        if len(text) > prefix_chars:
            head = tokenizer.encode(text[:prefix_chars], add_special_tokens=special)
            if len(head) >= max_seq_len:
                _too_long(
                    prompt, f"at least {len(head)} tokens ({len(text)} characters)", max_seq_len
                )
        tokens = tokenizer.encode(text, add_special_tokens=special)
        if len(tokens) >= max_seq_len:
            _too_long(prompt, f"{len(tokens)} tokens", max_seq_len)
        rendered[prompt.id], ids[prompt.id] = text, tokens
    return rendered, ids


def _too_long(prompt: Prompt, size: str, max_seq_len: int) -> None:
    where = prompt.origin or f"prompt {prompt.id}"
    raise DataError(
        f"{where}: the prompt has {size}, not less than rollout.max_seq_len={max_seq_len}; "
        "raise it or shorten the prompt"
    )


def build_scorer(config: Config) -> Scorer:
    """The run's scorer: the routed main reward (or the verifier service's client) plus the
    weighted components (``reward.weights``, ``reward.format_weight``)."""
    from honing.rewards.routing import VerifierSettings, build_builtin, build_router

    r = config.reward
    settings = VerifierSettings(r.workers, r.math_timeout_s, r.code_timeout_s)
    client = None
    if r.endpoint:
        from honing.rewards.remote import VerifierClient

        client = VerifierClient(
            r.endpoint,
            timeout_s=r.timeout_s,
            retries=r.retries,
            request_items=r.request_items,
            max_concurrency=r.max_concurrency,
            cache_size=r.cache_size,
        )
    router = build_router(r.function, r.routes, settings, fallback=client)
    weighted = [(spec, build_builtin(spec, settings), w) for spec, w in r.weights.items()]
    return Scorer(
        router,
        weighted=weighted,
        format_fn=format_reward if r.format_weight else None,
        format_weight=r.format_weight,
        on_error=r.on_error,
    )


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
        grad_clip=trainer.grad_clip,
        temperature=config.rollout.temperature,
        clip_ratio_c=algo.clip_ratio_c,
        loss_scale_len=config.rollout.max_new_tokens,
        autocast=trainer.autocast,
        packed=trainer.packed_forward,
    )


def check_names(config: Config) -> None:
    """Registry names in the config exist (a clear error before anything heavy loads)."""
    from honing.algorithms import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES

    for key, value, registry in (
        ("algorithm.advantage", config.algorithm.advantage, ADVANTAGE_ESTIMATORS),
        ("algorithm.policy_loss", config.algorithm.policy_loss, POLICY_LOSSES),
        ("algorithm.loss_agg", config.algorithm.loss_agg, LOSS_AGGREGATIONS),
    ):
        if value not in registry:
            raise ConfigError(
                f"{key}: {value!r} is not known; choose one of: {', '.join(sorted(registry))}"
            )
    if 0 < config.algorithm.clip_ratio_c <= 1:
        raise ConfigError(
            "algorithm.clip_ratio_c: the dual-clip bound must be > 1 (e.g. 3), or 0 for off"
        )
    if config.algorithm.clip_ratio_c and config.algorithm.policy_loss != "ppo_clip":
        raise ConfigError("algorithm.clip_ratio_c: dual clip applies to ppo_clip only")
    if config.reward.overlong_buffer_len >= config.rollout.max_new_tokens:
        raise ConfigError(
            f"reward.overlong_buffer_len: {config.reward.overlong_buffer_len} must be less "
            f"than rollout.max_new_tokens={config.rollout.max_new_tokens}"
        )
    if config.algorithm.kl_in_reward and config.algorithm.kl_coef == 0:
        raise ConfigError(
            "algorithm.kl_in_reward needs algorithm.kl_coef > 0 (the penalty's "
            "starting coefficient)"
        )
    from honing.pipeline.alerting import parse_rules

    rules = parse_rules(config.monitor)
    if config.algorithm.kl_coef == 0 and any("kl_coef" in r.rollback for r in rules):
        raise ConfigError(
            "monitor.alerts: rollback(kl_coef=...) needs algorithm.kl_coef > 0 (a reference "
            "model is loaded only then)"
        )
    if config.algorithm.advantage == "grpo" and config.rollout.group_size < 2:
        raise ConfigError(
            "rollout.group_size: grpo compares samples within a group; with group_size="
            f"{config.rollout.group_size} every advantage is 0. Use group_size >= 2"
        )


def check_ground_truths(prompts: list[Prompt], scorer: Scorer) -> None:
    """Every prompt has a reward function, and those scored by the numeric check have numeric
    ground truths: found at load time, not hours into the run when the prompt is drawn."""
    router = scorer.reward_fn
    sources = {p.data_source for p in prompts}
    unrouted = router.unrouted(sources)
    if unrouted:
        raise DataError(
            f"no reward function for data_source {unrouted[0]!r}; add it to reward.routes "
            f"(e.g. reward.routes={{{unrouted[0]!r}: math}}) or set reward.function"
        )
    for prompt in prompts:
        spec = router.route(prompt.data_source)
        if spec != "numeric" and not (spec is None and router.fallback is numeric_reward):
            continue
        truths = (
            prompt.ground_truth if isinstance(prompt.ground_truth, list) else [prompt.ground_truth]
        )
        if not truths or any(parse_number(str(t)) is None for t in truths):
            raise DataError(
                f"{prompt.id}: ground truth {prompt.ground_truth!r} is not a number; the numeric "
                "reward needs one (or set reward.function to your own verifier)"
            )


def frozen_model(path: Path, tokenizer, config: Config, device: torch.device):
    """A causal LM that is only read (the reference, a draft): eval mode, no gradients."""
    m = config.model
    model = load_causal_lm(
        path, tokenizer, dtype=m.dtype, device=device, trust_remote_code=m.trust_remote_code
    ).eval()
    return model.requires_grad_(False)


def build_components(config: Config, log=print) -> Components:
    check_names(config)
    scorer = build_scorer(config)
    train, val, skipped = load_datasets(config)
    check_ground_truths(train + val, scorer)
    device = resolve_device(config.model.device)
    model_path = resolve_model_path(config, log=log)
    m = config.model
    tokenizer = load_tokenizer(model_path, trust_remote_code=m.trust_remote_code)
    policy = load_causal_lm(
        model_path, tokenizer, dtype=m.dtype, device=device, trust_remote_code=m.trust_remote_code
    )
    if m.gradient_checkpointing:  # transformers 5 renamed it; the old name warns (gone in 6)
        enable = getattr(policy, "activation_checkpointing_enable", None)
        (enable or policy.gradient_checkpointing_enable)()
    if m.lora_rank:
        policy = apply_lora(policy, m.lora_rank, m.lora_alpha, m.lora_target_modules)
        if config.rollout.engine != "transformers" or config.pipeline.backend == "ray":
            check_mergeable(policy)  # engines in other processes get the adapters merged
    if config.trainer.packed_forward and (reason := packed_supported(policy)) is not True:
        log(f"trainer.packed_forward: logprob passes use the model's own forward ({reason})")
    reference = None
    if config.algorithm.kl_coef > 0 and not m.lora_rank:  # LoRA: the base, adapters off
        reference = frozen_model(model_path, tokenizer, config, device)
    critic = critic_optimizer = None
    if config.algorithm.advantage == "gae":
        critic_dir = (
            check_model_dir(m.critic_path, "model.critic_path") if m.critic_path else model_path
        )
        backbone = load_causal_lm(
            critic_dir,
            tokenizer,
            dtype=m.dtype,
            device=device,
            trust_remote_code=m.trust_remote_code,
        )
        critic = ValueModel(backbone).to(device)
        critic_optimizer = torch.optim.AdamW(
            critic.parameters(),
            lr=config.trainer.critic_lr,
            weight_decay=config.trainer.weight_decay,
        )
    rollout = config.rollout
    rendered, prompt_ids = tokenize_prompts(train + val, tokenizer, rollout.max_seq_len)
    t = config.trainer
    optimizer, scheduler = build_optimizer(
        policy,
        lr=t.lr,
        weight_decay=t.weight_decay,
        betas=t.betas,
        warmup_steps=t.warmup_steps,
        total_steps=t.total_steps,
        schedule=t.lr_schedule,
        min_ratio=t.min_lr_ratio,
    )
    local = local_engine(config, policy, tokenizer, device)
    if rollout.engine == "transformers" and rollout.fast_decode and not local.fast_decode:
        reason = local.fast_decode_reason
        log(f"rollout.fast_decode: generation uses the model's own forward ({reason})")
    mtp = local.speculation.draft_model if rollout.speculative == "mtp" else None
    engine = local if rollout.engine == "transformers" else remote_engine(config, local, model_path)
    parts = Components(
        model_path=model_path,
        device=device,
        tokenizer=tokenizer,
        policy=policy,
        reference=reference,
        engine=engine,
        val_engine=local,
        scorer=scorer,
        train_prompts=train,
        val_prompts=val,
        prompt_ids=prompt_ids,
        rendered=rendered,
        source=PromptSource(train, rollout.batch_size, seed=t.seed, shuffle=config.data.shuffle),
        optimizer=optimizer,
        scheduler=scheduler,
        update=update_settings(config),
        train_sampling=train_sampling(config),
        skipped_rows=skipped,
        critic=critic,
        critic_optimizer=critic_optimizer,
        kl_controller=KLController(
            config.algorithm.kl_coef,
            config.algorithm.kl_ctrl,
            config.algorithm.kl_target,
            config.algorithm.kl_horizon,
        ),
        make_scorer=lambda: build_scorer(config),
        mtp=mtp,
        mtp_optimizer=torch.optim.AdamW(mtp.parameters(), lr=rollout.mtp_lr) if mtp else None,
    )
    if config.pipeline.backend == "ray":  # rollout and reward workers as Ray actors
        from honing.pipeline import ray_backend

        parts = ray_backend.attach(config, parts, model_path)
    return parts


def engine_weights(
    policy: torch.nn.Module, engine: RolloutEngine, mtp: torch.nn.Module | None = None
) -> dict[str, torch.Tensor]:
    """The policy's weights as ``engine`` loads them. An in-process engine's model is a copy of
    the policy module (a LoRA policy's too), and it shares the MTP heads: the state dict.
    Engines in other processes (Ray rollout workers, inference servers) hold the plain model:
    a LoRA policy's adapters reach them merged into the base weights, and the MTP heads
    trained here (``mtp``) come along under ``MTP_PREFIX``."""
    if isinstance(engine, TransformersEngine):
        return policy.state_dict()
    weights = plain_weights(policy)
    if mtp is not None:
        weights |= {MTP_PREFIX + k: v for k, v in mtp.state_dict().items()}
    return weights


def local_engine(config: Config, model, tokenizer, device: torch.device) -> TransformersEngine:
    """Honing's in-process engine on ``model`` with the config's rollout settings (batching,
    fast decode, speculation, generation timeout): the run's, a Ray worker's, ``honing
    eval``'s."""
    rollout = config.rollout
    return TransformersEngine(
        model,
        tokenizer,
        device=device,
        generation_batch=rollout.generation_batch,
        fast_decode=rollout.fast_decode,
        speculation=speculation(config, tokenizer, device, model),
        gen_timeout_s=rollout.gen_timeout_s,
    )


def train_sampling(config: Config) -> SamplingParams:
    """How the training batches are sampled (validation changes n, greedy and the seed)."""
    rollout = config.rollout
    return SamplingParams(
        n=rollout.group_size,
        max_new_tokens=rollout.max_new_tokens,
        max_seq_len=rollout.max_seq_len,
        temperature=rollout.temperature,
        top_k=rollout.top_k,
        top_p=rollout.top_p,
    )


def speculation(config: Config, tokenizer, device: torch.device, policy=None):
    """``rollout.speculative``'s settings, with the draft model loaded or the MTP heads made
    for ``policy`` (None when off)."""
    from honing.rollout.fast_decode import supports
    from honing.rollout.speculative import Speculation

    rollout = config.rollout
    if rollout.speculative == "server":
        if rollout.engine != "openai":
            raise ConfigError(
                "rollout.speculative=server reads the acceptance remote servers report; it "
                "needs rollout.engine=openai (for honing's own engine: ngram, draft or mtp)"
            )
        return None
    if rollout.speculative == "off":
        return None
    if rollout.engine != "transformers":
        raise ConfigError(
            "rollout.speculative applies to honing's own engine; for vLLM or SGLang servers "
            "start them with their speculative options and set rollout.speculative=server"
        )
    if not rollout.fast_decode:
        raise ConfigError("rollout.speculative needs rollout.fast_decode=true")
    reason = supports(policy) if policy is not None else True
    if reason is not True:
        raise ConfigError(
            f"rollout.speculative needs the fast decode path, which this policy lacks: {reason}"
        )
    draft = None
    if rollout.speculative == "mtp":
        from honing.rollout.mtp import MtpHeads

        draft = MtpHeads(policy.config.hidden_size, rollout.spec_tokens).to(device)
    if rollout.speculative == "draft":
        if not rollout.spec_draft:
            raise ConfigError("rollout.speculative=draft needs rollout.spec_draft (a model dir)")
        draft = frozen_model(
            check_model_dir(rollout.spec_draft, "rollout.spec_draft"), tokenizer, config, device
        )
        reason = supports(draft)
        if reason is not True:
            raise ConfigError(f"rollout.spec_draft: the draft must be Llama-family ({reason})")
    return Speculation(
        rollout.speculative,
        rollout.spec_tokens,
        rollout.spec_min_accept,
        rollout.spec_probe_every,
        draft,
    )


def remote_engine(config: Config, local: TransformersEngine, model_dir: Path):
    """``rollout.engine=openai``: the servers at ``rollout.endpoints``; they must serve the
    policy's weights (``model.path``) and tokenizer."""
    from honing.rollout.openai_engine import OpenAIEngine

    rollout = config.rollout
    endpoints = [url for url in rollout.endpoints.split(",") if url.strip()]
    if not endpoints:
        raise ConfigError("rollout.engine=openai needs rollout.endpoints (server URLs)")
    if rollout.weight_sync == "disk" and not rollout.weight_dir:
        raise ConfigError("rollout.weight_sync=disk needs rollout.weight_dir")
    return OpenAIEngine(
        endpoints,
        local.tokenizer,
        model=rollout.model_name,
        timeout_s=rollout.timeout_s,
        retries=rollout.retries,
        max_concurrency=rollout.max_concurrency,
        token=os.environ.get("HONING_ROLLOUT_TOKEN", ""),
        stop_ids=local.stop_ids,
        weight_sync=rollout.weight_sync,
        weight_dir=rollout.weight_dir,
        model_dir=str(model_dir),
        spec_metrics=rollout.speculative == "server",
    )
