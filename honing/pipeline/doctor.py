"""``honing doctor``: check every configured part, then run one step end to end.

The cold-start test of the deployment guides, as one command: the config's names, the data,
the reward functions, every verifier service's and rollout server's ``/health``, the disk
space checkpoints will need, the checkpoint mirror (a probe object written and deleted), the
GPU, the model and tokenizer (pad ≠ eos), and finally one batch through generate → score →
update in a scratch directory (nothing is written to a run directory).
Each check is a row: passed, failed (with the reason) or skipped (with why); a failed check
does not hide the ones after it, except that the one-step run needs everything before it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from honing.checkpoint.mirror import Mirror
from honing.config import Config
from honing.errors import UserError
from honing.monitor import RunLogger
from honing.pipeline.components import build_components
from honing.pipeline.inputs import build_scorer, check_ground_truths, load_datasets
from honing.pipeline.loop import TrainLoop
from honing.pipeline.rollout_engines import choose_engine
from honing.pipeline.rules import check_config
from honing.rewards.registry import describe_error
from honing.rewards.remote import score_url


@dataclass
class Check:
    name: str
    status: str  # passed | failed | skipped
    detail: str
    seconds: float = 0.0


class _Doctor:
    def __init__(self, config: Config, output_dir: Path) -> None:
        self.config, self.output_dir = config, output_dir
        self.checks: list[Check] = []

    def run(self, name: str, probe: Callable[[], str]) -> bool:
        start = time.perf_counter()
        try:
            detail, status = probe(), "passed"
        except _Skip as skip:
            detail, status = str(skip), "skipped"
        except Exception as exc:  # noqa: BLE001 - a check reports any failure as its row
            detail, status = (
                describe_error(exc) if not isinstance(exc, UserError) else str(exc),
                "failed",
            )
        self.checks.append(Check(name, status, detail, time.perf_counter() - start))
        return status != "failed"


class _Skip(Exception):
    """A check that does not apply here (the message says why)."""


def run_doctor(config: Config, output_dir: Path) -> list[Check]:
    """Every check's row, in order (module docstring)."""
    config = choose_engine(config, log=lambda message: None)  # the engine a run would take
    doctor = _Doctor(config, output_dir)
    state: dict[str, Any] = {}
    doctor.run("config", lambda: (check_config(config), "names and rules valid")[1])

    def data() -> str:
        train, val, skipped = load_datasets(config)
        state["prompts"] = train + val
        sources = sorted({p.data_source for p in train + val})
        return (
            f"{len(train)} train / {len(val)} val prompts, data sources {sources}, "
            f"{skipped} rows skipped"
        )

    data_ok = doctor.run("data", data)

    def reward() -> str:
        scorer = build_scorer(config)
        try:
            if "prompts" in state:
                check_ground_truths(state["prompts"], scorer)
            routes = {
                p.data_source: scorer.reward_fn.route(p.data_source)
                for p in state.get("prompts", [])
            }
            return f"routes {routes}" if routes else "built"
        finally:
            scorer.close()

    doctor.run("reward", reward)
    for url in filter(None, (u.strip() for u in config.reward.endpoint.split(","))):
        base = score_url(url).removesuffix("/score")
        token = os.environ.get("HONING_VERIFIER_TOKEN", "")
        check = lambda base=base, token=token: _health(base, config.reward.timeout_s, token)  # noqa: E731
        doctor.run(f"service {url}", check)
    if config.rollout.engine == "openai":
        for url in filter(None, (u.strip() for u in config.rollout.endpoints.split(","))):
            base = url.rstrip("/").removesuffix("/v1")
            token = os.environ.get("HONING_ROLLOUT_TOKEN", "")
            check = lambda base=base, token=token: _health(base, config.rollout.timeout_s, token)  # noqa: E731
            doctor.run(f"rollout server {url}", check)
    doctor.run("disk", lambda: _disk(config, output_dir))
    if config.checkpoint.mirror_url:
        doctor.run("checkpoint mirror", lambda: Mirror(config.checkpoint.mirror_url).check())
    doctor.run("gpu", _gpu)
    if data_ok and all(c.status != "failed" for c in doctor.checks):
        _model_and_step(doctor, config)
    else:
        doctor.checks.append(Check("model", "skipped", "an earlier check failed"))
        doctor.checks.append(Check("one step", "skipped", "an earlier check failed"))
    return doctor.checks


def _health(base: str, timeout_s: float, token: str) -> str:
    """``GET base/health`` (with the bearer token when one is set, for the details)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    start = time.perf_counter()
    answer = httpx.get(f"{base}/health", timeout=min(timeout_s, 10.0), headers=headers)
    answer.raise_for_status()
    health = answer.json()
    elapsed = 1000 * (time.perf_counter() - start)
    what = health.get("isolation") or health.get("model") or "ok"
    return f"{health.get('service', 'service')} healthy in {elapsed:.0f} ms ({what})"


def _disk(config: Config, output_dir: Path) -> str:
    """Free space where checkpoints go vs what ``checkpoint.keep`` of them will take (fp32
    weights, plus AdamW's two moments when the optimizer is saved); the model is not loaded
    yet, so its size comes from its safetensors files when it is a local directory."""
    probe = output_dir if output_dir.exists() else next(p for p in output_dir.parents if p.exists())
    free = shutil.disk_usage(probe).free
    model_dir = Path(config.model.path)
    weights = (
        sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) if model_dir.is_dir() else 0
    )
    if not weights:
        return f"{free / 2**30:.1f} GiB free at {probe} (model size unknown before it is built)"
    factor = 3 if config.checkpoint.save_optimizer else 1
    needed = weights * factor * (config.checkpoint.keep + 1)
    if needed > free:
        raise RuntimeError(
            f"{free / 2**30:.1f} GiB free at {probe}, checkpoints need about "
            f"{needed / 2**30:.1f} GiB (lower checkpoint.keep or free space)"
        )
    return (
        f"{free / 2**30:.1f} GiB free at {probe}; checkpoints need about {needed / 2**30:.2f} GiB"
    )


def _gpu() -> str:
    if not torch.cuda.is_available():
        raise _Skip("no CUDA device (CPU run)")
    free, total = torch.cuda.mem_get_info()
    return f"{torch.cuda.get_device_name()}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free"


def _model_and_step(doctor: _Doctor, config: Config) -> None:

    state: dict[str, Any] = {}

    def model() -> str:
        parts = build_components(config, log=lambda message: None)
        state["parts"] = parts
        tokenizer = parts.tokenizer
        if tokenizer.pad_token_id == tokenizer.eos_token_id:
            raise RuntimeError(
                "the tokenizer's pad token equals eos (the final eos would get no gradient)"
            )
        params = sum(p.numel() for p in parts.policy.parameters())
        dtype = next(parts.policy.parameters()).dtype
        return (
            f"{parts.model_path} ({params / 1e6:.2f}M parameters, {dtype}, {parts.device}); "
            f"pad {tokenizer.pad_token!r} != eos {tokenizer.eos_token!r}"
        )

    if not doctor.run("model", model):
        doctor.checks.append(Check("one step", "skipped", "the model did not load"))
        return

    def one_step() -> str:
        parts = state["parts"]
        scratch = tempfile.mkdtemp(prefix="honing-doctor-")
        try:
            with RunLogger(scratch, total_steps=1, tensorboard=False, console=False) as logger:
                metrics = TrainLoop(config, parts, logger, checkpoints=None).step_alone(1)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            parts.scorer.close()
        m = {"critic/score/mean": float("nan"), "actor/pg_loss": float("nan")} | metrics
        return (
            f"generated {m['samples/generated']}, trained {m.get('samples/trained', 0)}, "
            f"score mean {m['critic/score/mean']:.3f}, pg_loss {m['actor/pg_loss']:.4f}, "
            f"{m['timing_s/step']:.2f} s (gen {m['timing_s/gen']:.2f}, "
            f"reward {m['timing_s/reward']:.2f}, update {m.get('timing_s/update', 0.0):.2f})"
        )

    doctor.run("one step", one_step)


def format_checks(checks: list[Check]) -> str:
    """The table ``honing doctor`` prints."""
    marks = {"passed": "ok", "failed": "FAIL", "skipped": "skip"}
    width = max(len(c.name) for c in checks)
    lines = [
        f"{marks[c.status]:<4}  {c.name:<{width}}  {c.detail}  ({c.seconds:.1f} s)" for c in checks
    ]
    failed = sum(c.status == "failed" for c in checks)
    lines.append(
        f"{len(checks) - failed} of {len(checks)} checks passed or skipped, {failed} failed"
    )
    return "\n".join(lines)
