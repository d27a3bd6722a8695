"""The run's rollout engines, built from the config: honing's own engine on the policy
(``local_engine``, with its speculation), vLLM in this process (``vllm_engine``), the servers
at ``rollout.endpoints`` (``remote_engine``), wrapped for ``rollout.tools``; and what
``rollout.engine=auto`` (the default) resolves to (``choose_engine``).

``auto``: vLLM in process where it is installed, can run the run's settings and the policy is
large enough for it to pay (20M parameters); honing's own engine otherwise. On a CPU it also
takes the update to give the engine/trainer gap (one optimizer step per batch, no KL in the
reward): where a separate logprob pass runs, honing's engine (which shares the policy and
needs none) is taken.

Measured side by side on a 2-core CPU (benchmarks/results/vllm_speed.md, vllm_step.md):
honing's engine generated about twice as fast as vLLM on a 0.87M-parameter model (vLLM's
per-step scheduling costs more than such a model's arithmetic); vLLM generated faster from
~40M parameters up (2.2-2.7x at 0.5B). With one optimizer step per batch the update's forward
gives the gap, and a step with vLLM costs its generation, the update and a sync: 29.1 s against
33.9 s with honing's engine at ~47M parameters, 72.0 s against 94.2 s at 0.5B (generation
8.2 s against 11.1 s, and 18.0 s against 32.1 s). With a separate logprob pass the ~47M step
took 32.8 s with vLLM against 29.0 s with honing's engine. On a GPU generation is most of a
step and vLLM's lead is larger (paged attention, CUDA graphs). The choice is made once, before
the run's config is checked; for a model that large it is said in one line (below that,
honing's engine is taken without a word).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from honing.config import Config
from honing.config.tree import ModelConfig, RolloutConfig
from honing.errors import ConfigError
from honing.models.loading import check_model_dir, load_causal_lm, plain_weight_items
from honing.pipeline.rules import check_config, rollout_correction
from honing.rollout.base import Holding, RolloutEngine, SamplingParams
from honing.rollout.native.engine import TransformersEngine
from honing.trainer.engine import TrainerEngine

# vLLM in process from this many parameters up (between the 0.87M and ~40M models measured)
VLLM_FROM_PARAMETERS = 20_000_000
STEP_RESULTS = "benchmarks/results/vllm_step.md"


def choose_engine(config: Config, world_size: int = 1, log=print) -> Config:
    """``config`` with ``rollout.engine=auto`` resolved to ``vllm`` or ``transformers``; the
    choice is said when the model is large enough for vLLM (which engine, and why)."""
    if config.rollout.engine != "auto":
        return config
    engine, why = _choice(config, world_size)
    if why:
        log(f"rollout.engine=auto: {engine} ({why})")
    return replace(config, rollout=replace(config.rollout, engine=engine))


def _choice(config: Config, world_size: int) -> tuple[str, str]:
    count = parameters(config)
    if count is None or count < VLLM_FROM_PARAMETERS:
        return "transformers", ""  # honing's is the faster engine (or the load will say why)
    size = f"{count / 1e6:.0f}M parameters"
    if importlib.util.find_spec("vllm") is None:
        return "transformers", f'{size}; vLLM is not installed: pip install -e ".[vllm]"'
    separate = logprob_pass(config) if device_type(config) != "cuda" else ""
    if separate:
        return "transformers", (
            f"{size}; with {separate} an engine with weights of its own costs the "
            "trainer a logprob pass per batch, which on a CPU outweighs what vLLM saves "
            f"({STEP_RESULTS})"
        )
    try:  # what vLLM in process takes is the rules' to say
        check_config(replace(config, rollout=replace(config.rollout, engine="vllm")), world_size)
    except ConfigError as err:
        return "transformers", f"{size}; vLLM in process does not take this run: {err}"
    return "vllm", f"{size}: vLLM pays from {VLLM_FROM_PARAMETERS // 10**6}M ({STEP_RESULTS})"


def logprob_pass(config: Config) -> str:
    """What makes the trainer run a logprob pass over each batch an engine with weights of its
    own sampled (``experience.needs_old_logprobs``, from the config alone): several
    optimizer steps per batch, the KL in the reward, or a rollout correction that needs the
    whole batch; "" when the update's forward gives the gap."""
    trainer, algo = config.trainer, config.algorithm
    rows = config.rollout.batch_size * config.rollout.group_size
    mini = trainer.mini_batch_size * config.rollout.group_size or rows
    if trainer.ppo_epochs * -(-rows // mini) > 1:
        return "several optimizer steps per batch (trainer.ppo_epochs, trainer.mini_batch_size)"
    if algo.kl_in_reward and algo.kl_coef > 0:
        return "the KL in the reward (algorithm.kl_in_reward)"
    if (correction := rollout_correction(config)) is not None and correction.needs_whole_batch:
        return "rollout correction over the whole batch (algorithm.rollout_rs, batch-normalised)"
    return ""


def parameters(config: Config) -> int | None:
    """The policy's parameter count from its config alone (built on the meta device), or
    None where the model directory cannot be read (its load says why later); 0 for the
    built-in models (well below the threshold) and what is not a local directory."""
    path = config.model.path
    if path.startswith("builtin:") or not Path(path).is_dir():  # no hub: local directories
        return 0
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        model_config = AutoConfig.from_pretrained(
            path, trust_remote_code=config.model.trust_remote_code
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                model_config, trust_remote_code=config.model.trust_remote_code
            )
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001 - any unreadable model: honing's own engine
        return None


def device_type(config: Config) -> str:
    """Where the policy runs: ``cuda`` or ``cpu`` (``model.device``, ``auto`` resolved)."""
    from honing.models.loading import resolve_device

    return resolve_device(config.model.device).type


@dataclass(frozen=True)
class RolloutEngines:
    """What samples a run: ``train`` the training batches (honing's engine, vLLM or the
    servers), ``local`` honing's engine on the policy itself (validation, ``honing eval``)."""

    train: RolloutEngine
    local: TransformersEngine

    def with_tools(
        self, tokenizer, rollout: RolloutConfig
    ) -> tuple[RolloutEngine, RolloutEngine, TransformersEngine]:
        """(training engine, validation engine, local engine), the first two calling the run's
        tools turn by turn under ``rollout.tools``."""
        if not rollout.tools:
            return self.train, self.local, self.local
        from honing.rollout.tools.turns import with_tools

        train, val = with_tools(self.train, self.local, tokenizer, rollout)
        return train, val, self.local


def build_rollout_engines(
    config: Config,
    sampler: torch.nn.Module,
    tokenizer,
    device: torch.device,
    holds: Holding,
    model_path: Path,
    trainer: TrainerEngine,
    log=print,
) -> RolloutEngines:
    """The engines ``rollout.engine`` names, on ``sampler`` (the policy itself when ``holds``
    is ``SHARED``, else the trainer's generation copy); ``auto`` must be resolved already
    (``choose_engine``; where nothing chose, honing's engine)."""
    rollout = config.rollout
    local = local_engine(config, sampler, tokenizer, device, holds)
    if config.pipeline.backend == "ray" and rollout.engine != "openai":
        engine = local  # the rollout workers hold the engine (the Ray backend swaps them in)
    elif rollout.engine == "vllm":
        weights = trainer.weights(plain_weight_items)
        engine = vllm_engine(config, local, model_path, device, weights, trainer.world_size)
    elif rollout.engine == "openai":
        engine = remote_engine(config, local, model_path)
    else:  # transformers, or auto where nothing chose (launch.train chooses)
        engine = local
    if engine is local and rollout.fast_decode and not local.fast_decode:
        reason = local.fast_decode_reason
        log(f"rollout.fast_decode: generation uses the model's own forward ({reason})")
    return RolloutEngines(engine, local)


def frozen_model(path: Path, tokenizer, model: ModelConfig, device: torch.device):
    """A causal LM that is only read (the reference, a draft): eval mode, no gradients."""
    loaded = load_causal_lm(
        path, tokenizer, dtype=model.dtype, device=device, trust_remote_code=model.trust_remote_code
    ).eval()
    return loaded.requires_grad_(False)


def local_engine(
    config: Config, model, tokenizer, device: torch.device, holds: Holding = Holding.COPY
) -> TransformersEngine:
    """Honing's in-process engine on ``model`` with the config's rollout settings (batching,
    fast decode, speculation, generation timeout): the run's (``holds``: ``SHARED`` when
    ``model`` is the trained policy itself), a Ray worker's, ``honing eval``'s."""
    rollout = config.rollout
    return TransformersEngine(
        model,
        tokenizer,
        device=device,
        holds=holds,
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
    for ``policy`` (None when off, or when the servers speculate)."""
    from honing.rollout.native.fast_decode import supports
    from honing.rollout.native.speculative import Speculation

    rollout = config.rollout
    if rollout.speculative in ("off", "server"):
        return None
    reason = supports(policy) if policy is not None else True
    if reason is not True:
        raise ConfigError(
            f"rollout.speculative needs the fast decode path, which this policy lacks: {reason}"
        )
    draft = None
    if rollout.speculative == "mtp":
        from honing.rollout.native.mtp import MtpHeads

        draft = MtpHeads(policy.config.hidden_size, rollout.spec_tokens).to(device)
    if rollout.speculative == "draft":
        draft = frozen_model(
            check_model_dir(rollout.spec_draft, "rollout.spec_draft"),
            tokenizer,
            config.model,
            device,
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


def vllm_engine(
    config: Config,
    local: TransformersEngine,
    model_dir: Path,
    device,
    weights=None,
    ranks: int = 1,
):
    """``rollout.engine=vllm``: vLLM in this process, built from ``model_dir``'s config with
    the rollout settings, the policy's stop tokens and ``weights`` (the policy's as the trainer
    holds them: LoRA merged, embeddings grown for an added pad token included; None: the
    directory's, until the first load), one engine in each of ``ranks`` torchrun ranks. On
    CUDA it samples in the trainer's autocast dtype where one is set."""
    from honing.rollout.vllm.engine import CPU_KV_CACHE_MB, VLLMEngine, VLLMSettings, model_problem

    rollout, policy = config.rollout, local.model
    problem = model_problem(policy.config, device.type)
    if problem is not None:
        raise ConfigError(f"rollout.engine=vllm: {problem}; use rollout.engine=transformers")
    dtype, kv_cache_mb = config.model.dtype, rollout.vllm_kv_cache_mb
    if device.type == "cuda" and config.trainer.autocast != "none":
        dtype = config.trainer.autocast
    if device.type != "cuda":
        kv_cache_mb = kv_cache_mb or CPU_KV_CACHE_MB
    settings = VLLMSettings(
        kv_cache_mb=kv_cache_mb,
        enforce_eager=rollout.vllm_enforce_eager,
        gpu_memory_utilization=rollout.vllm_gpu_memory_utilization,
        sleep=rollout.vllm_sleep,
        max_num_seqs=rollout.generation_batch,
        dtype=dtype,
        seed=config.trainer.seed,
        # partial rollouts keeping a sample's cache keep its vLLM request alive instead
        prefix_caching=config.schedule.partial_kv != "keep",
        torchrun=ranks > 1,  # an engine in every rank
        tensor_parallel=rollout.tensor_parallel,
    )
    try:
        return VLLMEngine(
            model_dir,
            local.tokenizer,
            stop_ids=local.stop_ids,
            # vLLM refuses a length past the model's positions (honing's engine stops there)
            max_seq_len=min(
                rollout.max_seq_len,
                getattr(policy.config, "max_position_embeddings", None) or rollout.max_seq_len,
            ),
            settings=settings,
            device_type=device.type,
            weights=weights,
            vocab_size=policy.get_input_embeddings().weight.shape[0],
        )
    except ValueError as err:  # the policy's weights do not fit vLLM's model
        why = str(err).splitlines()[0].split(". ")[0].rstrip(".")
        if "rollout.engine=transformers" not in why:
            why = f"vLLM's model does not take the policy's weights ({why}); use " + (
                "rollout.engine=transformers"
            )
        raise ConfigError(f"rollout.engine=vllm: {why}") from None


def remote_engine(config: Config, local: TransformersEngine, model_dir: Path):
    """``rollout.engine=openai``: the servers at ``rollout.endpoints``; they must serve the
    policy's weights (``model.path``) and tokenizer."""
    from honing.rollout.remote.engine import OpenAIEngine

    rollout = config.rollout
    endpoints = [url for url in rollout.endpoints.split(",") if url.strip()]
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
        routing=_routing_shape(local.model) if config.algorithm.routing_replay == "R3" else None,
    )


def _routing_shape(policy):
    """What the servers' routed experts describe for R3: the policy's MoE routers."""
    from honing.models.moe import routers_of
    from honing.rollout.remote.routed_experts import RoutingShape

    routers = routers_of(policy)
    if routers is None:
        return None
    total = routers.model.config.num_hidden_layers
    return RoutingShape(tuple(routers.layer_numbers), total, routers.top_k)
