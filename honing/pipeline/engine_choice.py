"""``rollout.engine=auto`` (the default): vLLM in process on a GPU where it is installed, can
run the run's settings and the policy is large enough for it to pay; honing's own engine
otherwise.

Measured side by side on a 2-core CPU (benchmarks/results/vllm_speed.md, vllm_step.md):
honing's engine generated about twice as fast as vLLM on a 0.87M-parameter model (vLLM's
per-step scheduling costs more than such a model's arithmetic); vLLM generated faster from
~40M parameters up (2.2-2.7x at 0.5B). But an engine with weights of its own costs the trainer
a logprob pass per batch (the engine/trainer gap is logged every step), and on a CPU that
forward pass costs more than vLLM saves: a step of the ~47M model took 32.8 s with vLLM
against 29.0 s with honing's engine. On a GPU generation is most of a step and vLLM's lead is
larger (paged attention, CUDA graphs), so there it is taken from 20M parameters. The choice is
made once, before the run's config is checked; for a model that large it is said in one line
(below that, honing's engine is taken without a word).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

from honing.config import Config

# vLLM in process from this many parameters up (between the 0.87M and ~40M models measured)
VLLM_FROM_PARAMETERS = 20_000_000


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
    if device_type(config) != "cuda":
        return "transformers", f"{size}; on a CPU honing's engine trains faster per step"
    rollout, algo = config.rollout, config.algorithm
    blocked = (
        (world_size > 1, "torchrun ranks"),
        (config.pipeline.backend != "local", f"pipeline.backend={config.pipeline.backend}"),
        (rollout.speculative != "off", f"rollout.speculative={rollout.speculative}"),
        (rollout.gen_timeout_s > 0, "rollout.gen_timeout_s"),
        (algo.routing_replay == "R3", "routing replay R3"),
        (config.trainer.strategy == "fsdp", "trainer.strategy=fsdp"),
        (rollout.vllm_sleep and config.schedule.mode != "sync", "vllm_sleep off sync"),
    )
    for yes, what in blocked:
        if yes:
            return "transformers", f"{size}; vLLM in process does not take {what}"
    if importlib.util.find_spec("vllm") is None:
        return "transformers", f'{size}; vLLM is not installed: pip install -e ".[vllm]"'
    from honing.rollout.vllm.engine import vllm_available

    if (problem := vllm_available()) is not None:  # installed, but it does not import
        return "transformers", f"{size}; {problem}"
    return "vllm", f"{size}: on a GPU vLLM pays from {VLLM_FROM_PARAMETERS // 10**6}M"


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
