"""One typed config tree, resolved from defaults < YAML < environment < command line.

Fields whose meaning is not plain from the name carry a comment; ``Field`` metadata carries
the allowed choices or range so that validation can say exactly what is wrong. Bad input
raises ``ConfigError`` with one line naming the key and what is allowed (the CLI turns it
into exit status 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from honing.errors import ConfigError


def _opt(
    default: Any,
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    items: type | None = None,
    length: int | None = None,
    urls: bool = False,
) -> Any:
    """A config field with validation metadata: choices, bounds (of a list's items too),
    for lists the type of the items and the required length, and for ``urls`` strings a
    comma-separated list of http(s) URLs."""
    meta = {
        "urls": urls,
        "choices": choices,
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "items": items,
        "length": length,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    path: str = _opt("builtin:tiny")  # a local Hugging Face model directory, or builtin:tiny
    dtype: str = _opt("float32", choices=("float32", "bfloat16", "float16"))
    device: str = _opt("auto", choices=("auto", "cpu", "cuda"))
    cache_dir: str = _opt("")  # where builtin:tiny is built; default ~/.cache/honing
    trust_remote_code: bool = _opt(False)
    gradient_checkpointing: bool = _opt(False)
    critic_path: str = _opt("")  # gae: the critic's backbone; empty = a copy of model.path
    # LoRA adapters (PEFT): train only low-rank adapters on the frozen base (0 = off). The
    # reference model is then the base with adapters switched off (no second copy loaded).
    lora_rank: int = _opt(0, ge=0)
    lora_alpha: float = _opt(16.0, gt=0.0)
    lora_target_modules: list = _opt(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], items=str
    )


@dataclass(frozen=True)
class DataConfig:
    task: str = _opt("arithmetic", choices=("arithmetic",))  # built-in task when no files
    train_files: list = _opt([], items=str)  # JSONL / Parquet paths in verl's row schema
    val_files: list = _opt([], items=str)
    train_size: int = _opt(4000, ge=1)  # built-in task: number of training problems
    val_size: int = _opt(200, ge=1)  # built-in task: held-out validation problems
    max_digits: int = _opt(2, ge=1, le=9)  # built-in task: most digits of an operand
    min_digits: int = _opt(1, ge=1, le=9)  # built-in task: fewest digits of an operand
    on_bad_row: str = _opt("error", choices=("error", "skip"))
    shuffle: bool = _opt(True)


@dataclass(frozen=True)
class RolloutConfig:
    # transformers: in-process; openai: remote servers speaking the OpenAI completions API
    # with token ids and logprobs (vLLM, SGLang, honing serve rollout)
    engine: str = _opt("transformers", choices=("transformers", "openai"))
    endpoints: str = _opt("", urls=True)  # openai: server URLs, comma-separated
    model_name: str = _opt("")  # openai: the served model's name (default: the first served)
    timeout_s: float = _opt(600.0, gt=0.0)  # openai: one completion request
    retries: int = _opt(2, ge=0)  # openai: other endpoints tried for a failed request
    max_concurrency: int = _opt(16, ge=1)  # openai: requests in flight at once
    # openai: how new weights reach the servers: tensors (POST /update_weights, honing's
    # server), disk (write weight_dir/vN, POST /update_weights_from_disk: SGLang, honing's),
    # none (the servers keep their weights: evaluation or an external sync)
    weight_sync: str = _opt("tensors", choices=("tensors", "disk", "none"))
    weight_dir: str = _opt("")  # disk: a directory the servers can read
    batch_size: int = _opt(16, ge=1)  # prompts per step
    group_size: int = _opt(8, ge=1)  # samples per prompt
    max_new_tokens: int = _opt(8, ge=1)
    max_seq_len: int = _opt(512, ge=2)  # prompt + response cap; longer prompts are an error
    temperature: float = _opt(1.0, gt=0.0)
    top_p: float = _opt(1.0, gt=0.0, le=1.0)
    top_k: int = _opt(0, ge=0)  # 0 = off
    val_samples: int = _opt(8, ge=1)  # k of val/pass@k, sampled at `temperature`
    generation_batch: int = _opt(256, ge=1)  # sequences per generate call
    fast_decode: bool = _opt(True)  # lean exact forward for Llama-family models while sampling
    # Speculative decoding in honing's engine (exact: the policy's distribution is kept):
    # off; ngram (prompt lookup); draft (a small model at spec_draft with the same tokenizer);
    # mtp (multi-token-prediction heads on the policy's hidden states, trained online);
    # server (rollout.engine=openai: the servers speculate by their own launch options and
    # honing reads the acceptance they report)
    speculative: str = _opt("off", choices=("off", "ngram", "draft", "mtp", "server"))
    spec_tokens: int = _opt(4, ge=1, le=16)  # draft tokens proposed per verify round (k)
    spec_draft: str = _opt("")  # draft: a local Hugging Face model directory
    spec_min_accept: float = _opt(0.3, ge=0.0, le=1.0)  # below it speculation turns itself off
    spec_probe_every: int = _opt(20, ge=1)  # while off: every Nth generate call probes
    mtp_lr: float = _opt(1e-3, gt=0.0)  # mtp: the heads' learning rate (their own AdamW)
    # A generation batch running longer than this is cut: its unfinished samples end with
    # finish_reason abort (counted in rollout/gen_timeouts) and are trained as they are. 0 = off.
    gen_timeout_s: float = _opt(0.0, ge=0.0)


@dataclass(frozen=True)
class RewardConfig:
    # "auto" (route by data_source: math, code, arithmetic...), a built-in name,
    # package.module:function or path/file.py:function
    function: str = _opt("auto")
    routes: dict = _opt({}, items=str)  # data_source -> reward function; adds to / overrides auto
    weights: dict = _opt({}, items=float)  # further reward functions added with a weight
    format_weight: float = _opt(0.0)  # weight of the built-in format reward (0 = off)
    on_error: str = _opt("fail", choices=("fail", "error", "zero", "drop"))  # error = fail
    # verifier service URL(s), comma-separated (VERIFIER_ENDPOINT)
    endpoint: str = _opt("", urls=True)
    timeout_s: float = _opt(30.0, gt=0.0)  # one HTTP request to a verifier service
    retries: int = _opt(3, ge=0)  # further attempts of a failed request, on another replica
    request_items: int = _opt(64, ge=1)  # items per /score request
    max_concurrency: int = _opt(8, ge=1)  # /score requests in flight at once
    cache_size: int = _opt(100000, ge=0)  # remembered (response, ground truth) scores; 0 = off
    workers: int = _opt(0, ge=0)  # local verifier processes / sandboxes at once; 0 = cores
    math_timeout_s: float = _opt(5.0, gt=0.0)  # hard deadline of one math check
    code_timeout_s: float = _opt(10.0, gt=0.0)  # hard deadline of one program run
    overlong_buffer_len: int = _opt(0, ge=0)  # DAPO soft overlong penalty window (0 = off)
    overlong_penalty_factor: float = _opt(1.0, ge=0.0)  # penalty at max_new_tokens


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage: str = _opt("grpo")
    policy_loss: str = _opt("ppo_clip")
    loss_agg: str = _opt("token_mean")
    clip_ratio_low: float = _opt(0.2, ge=0.0, le=1.0)
    clip_ratio_high: float = _opt(0.2, ge=0.0)
    clip_ratio_c: float = _opt(0.0, ge=0.0)  # dual-clip bound for A < 0 (> 1), 0 = off
    norm_adv_by_std: bool = _opt(True)
    gamma: float = _opt(1.0, ge=0.0, le=1.0)  # discount (reinforce_plus_plus; gae)
    lam: float = _opt(1.0, ge=0.0, le=1.0)  # GAE's lambda (gae)
    value_clip: float = _opt(0.2, gt=0.0)  # gae: how far a value may move from the old one
    kl_coef: float = _opt(0.0, ge=0.0)  # 0 = no reference model is loaded
    kl_estimator: str = _opt("k3", choices=("k1", "k2", "k3"))
    kl_in_reward: bool = _opt(False)  # KL as a per-token reward penalty instead of a loss
    kl_ctrl: str = _opt("fixed", choices=("fixed", "adaptive"))  # the reward penalty's beta
    kl_target: float = _opt(0.1, gt=0.0)  # adaptive: the KL the controller steers toward
    kl_horizon: int = _opt(10000, ge=1)  # adaptive: samples over which beta adapts
    entropy_coef: float = _opt(0.0, ge=0.0)
    dynamic_sampling: bool = _opt(False)  # DAPO: drop groups whose rewards are all equal
    max_gen_rounds: int = _opt(4, ge=1)  # generation rounds per step under dynamic sampling
    mask_truncated: bool = _opt(False)  # no gradient from responses cut at max_new_tokens
    # Truncated importance sampling against the engine/trainer gap: min(pi_old / mu, tis_cap).
    # auto: token under schedule.mode one_step / async (rollouts sampled by an older
    # version), none under sync
    tis_level: str = _opt("auto", choices=("auto", "none", "token", "sequence"))
    tis_cap: float = _opt(2.0, gt=0.0)


@dataclass(frozen=True)
class TrainerConfig:
    total_steps: int = _opt(100, ge=1)
    seed: int = _opt(0, ge=0)
    lr: float = _opt(1e-5, gt=0.0)
    weight_decay: float = _opt(0.0, ge=0.0)
    betas: list = _opt([0.9, 0.999], items=float, length=2, ge=0.0, lt=1.0)
    warmup_steps: int = _opt(0, ge=0)
    lr_schedule: str = _opt("constant", choices=("constant", "cosine", "linear"))
    min_lr_ratio: float = _opt(0.0, ge=0.0, le=1.0)
    ppo_epochs: int = _opt(1, ge=1)
    mini_batch_size: int = _opt(0, ge=0)  # prompts per optimizer step; 0 = the whole batch
    micro_batch_size: int = _opt(64, ge=1)  # sequences per forward/backward
    grad_clip: float = _opt(1.0, ge=0.0)  # 0 = no clipping
    critic_lr: float = _opt(1e-5, gt=0.0)  # gae: the critic's own AdamW learning rate
    critic_warmup_steps: int = _opt(0, ge=0)  # gae: steps that train only the critic
    val_every: int = _opt(10, ge=0)  # 0 = only at start and end
    val_at_start: bool = _opt(True)
    threads: int = _opt(0, ge=0)  # torch CPU threads; 0 = torch's default
    # Mixed precision for the trainer's forward passes (weights, gradients and the optimizer
    # stay in model.dtype, float32 by default: fp32 master weights with bf16 compute)
    autocast: str = _opt("none", choices=("none", "bfloat16", "float16"))
    # Logprob passes of Llama-family models run each prompt once per group, without padding
    # (honing/trainer/packed.py); the same numbers as the model's own forward, less work
    packed_forward: bool = _opt(True)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = _opt(50, ge=0)  # 0 = only at the end
    keep: int = _opt(2, ge=1)
    save_optimizer: bool = _opt(True)
    mirror_url: str = _opt("")  # fsspec URL or path for a second copy; "" = off
    mirror_every: int = _opt(1, ge=1)  # mirror every N-th checkpoint (an archive tier)


@dataclass(frozen=True)
class MonitorConfig:
    console: bool = _opt(True)
    tensorboard: bool = _opt(True)
    log_samples: int = _opt(4, ge=0)  # generations per step written to samples.jsonl
    histograms: bool = _opt(True)  # reward and response-length histograms to TensorBoard / W&B
    system_metrics: bool = _opt(True)  # system/cpu_percent, system/rss_mb, system/gpu_mem_mb
    prometheus_port: int = _opt(0, ge=0, le=65535)  # 0 = off; else serve /metrics on it
    prometheus_host: str = _opt("127.0.0.1")  # interface the Prometheus endpoint binds
    wandb_project: str = _opt("")  # set = log to Weights & Biases (pip install wandb)
    wandb_entity: str = _opt("")  # W&B team or user; empty = the account's default
    mlflow_tracking_uri: str = _opt("")  # set = log to MLflow (pip install mlflow)
    mlflow_experiment: str = _opt("honing")  # MLflow experiment name
    # Alert rules, "CONDITION [for N steps] -> ACTION[, ...]" (honing/monitor/alerts.py):
    # too many non-finite updates in a row roll the run back to its last good checkpoint.
    alerts: list = _opt(["actor/skipped_updates > 0 for 3 steps -> rollback"], items=str)
    webhook_url: str = _opt("", urls=True)  # where the webhook action POSTs
    max_rollbacks: int = _opt(3, ge=0)  # then a rollback action stops the run instead


@dataclass(frozen=True)
class ScheduleConfig:
    # sync: generate, score, update in turn; one_step: batch k+1 is generated and scored
    # while batch k trains (sampled one version behind, deterministic); async: generation and
    # scoring run ahead with the newest weights, at most max_staleness versions behind.
    mode: str = _opt("sync", choices=("sync", "one_step", "async"))
    max_staleness: int = _opt(1, ge=0)  # async: trainer version - sampling version, at most


@dataclass(frozen=True)
class MemoryConfig:
    # Under the sync schedule on a GPU: when device memory in use passes the threshold (a
    # fraction of the device's), the trainer's idle state (optimizer state, gradients, the
    # reference model) goes to host memory during generation and comes back for the update.
    # On a machine without CUDA it does nothing (and says so once, in events.jsonl).
    dynamic_offload: bool = _opt(False)
    offload_trigger_threshold: float = _opt(0.85, gt=0.0, le=1.0)


@dataclass(frozen=True)
class PipelineConfig:
    # local: everything in this process (threads); ray: the trainer, rollout workers and reward
    # workers are Ray actors (honing/pipeline/ray_backend.py), on a local or existing cluster.
    backend: str = _opt("local", choices=("local", "ray"))
    ray_address: str = _opt("")  # "" = start a local Ray instance; "auto" or host:port = join
    rollout_workers: int = _opt(2, ge=1)  # ray: actors sampling with the policy's weights
    reward_workers: int = _opt(1, ge=0)  # ray: actors scoring (0 = score in the trainer)
    rollout_chunk: int = _opt(4, ge=1)  # ray, torchrun: prompts per rollout task
    spread_generation: bool = _opt(True)  # torchrun: every rank samples tasks (else rank 0)
    trainer_cpus: float = _opt(1.0, ge=0)  # ray: resources each actor asks for
    trainer_gpus: float = _opt(0.0, ge=0)
    rollout_cpus: float = _opt(1.0, ge=0)
    rollout_gpus: float = _opt(0.0, ge=0)
    reward_cpus: float = _opt(1.0, ge=0)
    placement: str = _opt("pack", choices=("pack", "spread"))  # ray: actors packed or spread
    actor_start_timeout_s: float = _opt(300.0, gt=0)  # ray: then an unplaceable actor is an error


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)


# Section name -> its dataclass, for key lookups.
SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}

# Deployment-guide environment variables and the keys they set.
ENV_KEYS = {
    "MODEL_PATH": "model.path",
    "ROLLOUT_BATCH_SIZE": "rollout.batch_size",
    "GROUP_SIZE": "rollout.group_size",
    "MAX_SEQ_LEN": "rollout.max_seq_len",
    "VERIFIER_ENDPOINT": "reward.endpoint",
}


def all_keys() -> list[str]:
    """Every valid dotted key, e.g. ``rollout.group_size``."""
    return [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _suggest(key: str) -> str:
    match = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    if not match:  # try the last component alone: `group_size` -> rollout.group_size
        leaf = {k.split(".")[-1]: k for k in all_keys()}
        close = difflib.get_close_matches(key.split(".")[-1], list(leaf), n=1, cutoff=0.6)
        match = [leaf[close[0]]] if close else []
    return f"; did you mean {match[0]}?" if match else ""


def _field(key: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    if section in SECTIONS and not name:
        example = dataclasses.fields(SECTIONS[section])[0].name
        raise ConfigError(
            f"{key!r} is a section, not a key; set one of its keys, e.g. {section}.{example}"
        )
    if section not in SECTIONS or not name:
        raise ConfigError(f"unknown config key {key!r}{_suggest(key)}")
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
    if name not in fields:
        raise ConfigError(f"unknown config key {key!r}{_suggest(key)}")
    return fields[name]


_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}


def _coerce(key: str, f: dataclasses.Field, value: Any) -> Any:
    """Convert a YAML/env/CLI value to the field's type and check its choices and range."""
    kind = _TYPES[f.type]
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                value = lowered in ("true", "1", "yes")
            elif not isinstance(value, bool):
                raise ValueError
        elif kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            value = int(value)
        elif kind is float:
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
        elif kind is list:
            if isinstance(value, str):
                value = _parse_value(key, value) if value.strip().startswith("[") else [value]
            if not isinstance(value, list):
                raise ValueError
            return _coerce_list(key, f.metadata, value)
        elif kind is dict:
            if isinstance(value, str):
                value = _parse_value(key, value) if value.strip() else {}
            if not isinstance(value, dict):
                raise ValueError
            return _coerce_dict(key, f.metadata, value)
        elif kind is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            value = "" if value is None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}") from None
    _check_range(key, f.metadata, value)
    return value


def _coerce_list(key: str, meta: Any, value: list) -> list:
    """Check a list's length and convert / range-check each item."""
    kind, length = meta.get("items"), meta.get("length")
    what = f"a list of {length or 'any number of'} {kind.__name__ if kind else 'value'}s"
    if length is not None and len(value) != length:
        raise ConfigError(f"{key}: expected {what}, got {value!r}")
    if kind is None:
        return value
    if kind is str:
        if any(isinstance(v, (list, dict)) or v is None for v in value):
            raise ConfigError(f"{key}: expected {what}, got {value!r}")
        return [str(v) for v in value]
    try:
        if any(isinstance(v, bool) for v in value):
            raise ValueError
        converted = [kind(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {what}, got {value!r}") from None
    for item in converted:
        _check_range(key, meta, item)
    return converted


def _coerce_dict(key: str, meta: Any, value: dict) -> dict:
    """A mapping with string keys; each value converted to ``items`` and range-checked."""
    kind = meta.get("items")
    out = {}
    for name, item in value.items():
        if not isinstance(name, str) or isinstance(item, (list, dict)) or item is None:
            raise ConfigError(
                f"{key}: expected a mapping of names to {kind.__name__ if kind else 'value'}s, "
                f"got {value!r}"
            )
        try:
            if kind is not None and (isinstance(item, bool) and kind is not bool):
                raise ValueError
            out[name] = kind(item) if kind is not None else item
        except (TypeError, ValueError):
            raise ConfigError(f"{key}.{name}: expected {kind.__name__}, got {item!r}") from None
        _check_range(f"{key}.{name}", meta, out[name])
    return out


def _check_urls(key: str, value: str) -> None:
    """Each comma-separated item of ``value`` is an http(s) URL with a host."""
    from urllib.parse import urlsplit

    for item in filter(None, (part.strip() for part in value.split(","))):
        try:
            parts = urlsplit(item)
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"{key}: {item!r} is not an http(s) URL; expected e.g. http://host:8080 "
                "(several: comma-separated)"
            )


def _check_range(key: str, meta: Any, value: Any) -> None:
    if meta.get("urls") and isinstance(value, str) and value.strip():
        _check_urls(key, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {value!r} is not allowed; expected a finite number")
    if meta.get("choices") and value not in meta["choices"]:
        allowed = ", ".join(map(str, meta["choices"]))
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of: {allowed}")
    bounds = [
        ("ge", ">=", lambda a, b: a >= b),
        ("gt", ">", lambda a, b: a > b),
        ("le", "<=", lambda a, b: a <= b),
        ("lt", "<", lambda a, b: a < b),
    ]
    for name, symbol, ok in bounds:
        if meta.get(name) is not None and not ok(value, meta[name]):
            raise ConfigError(f"{key}: {value!r} is out of range; must be {symbol} {meta[name]}")


def _flatten(tree: Any, prefix: str = "", source: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(tree).__name__}")
    flat = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if not prefix and isinstance(value, dict):
            flat.update(_flatten(value, f"{key}.", source))
        elif not prefix and name in SECTIONS:
            if value is not None:  # `rollout:` with nothing under it is an empty section
                example = dataclasses.fields(SECTIONS[name])[0].name
                raise ConfigError(
                    f"{source}: {name}: a section must be a mapping of its keys (such as "
                    f"'{example}: ...' on the lines under it), got {type(value).__name__} "
                    f"{value!r}"
                )
        else:
            flat[key] = value
    return flat


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error
    (plain PyYAML keeps the last value silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"duplicate key {key!r} (also at line {seen[key]}); keep one",
                    problem_mark=key_node.start_mark,
                )
            seen.setdefault(key, line)
        return super().construct_mapping(node, deep=deep)


def _load(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config into dotted keys; a missing or unreadable file, invalid YAML or a
    key given twice is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = _load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f"{path}:{line + 1}" if line is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read as UTF-8 text ({err})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(tree).__name__}")
    return _flatten(from_guide_shape(tree, str(path)), source=str(path))


# The deployment guide's configuration shape (top-level schedule_mode, modules,
# memory_management), mapped onto honing's sections. Keys honing cannot honour are errors.
GUIDE_ENGINES = {
    "transformers": "transformers",
    "vllm": "openai",
    "sglang": "openai",
    "openai": "openai",
}
GUIDE_UPDATE_STRATEGIES = ("full", "lora")  # every parameter, or LoRA adapters
GUIDE_LORA_RANK = 16  # update_strategy: lora without model.lora_rank


def from_guide_shape(tree: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """``tree`` with the guide's keys turned into honing's sections (see docs/deployment.md):

    schedule_mode -> schedule.mode; modules.rollout.engine (transformers | vllm | sglang |
    openai) -> rollout.engine; modules.rollout.batch_size -> rollout.batch_size;
    modules.inference.models (URLs, or mappings with url/endpoint and name) ->
    rollout.endpoints and rollout.model_name; modules.training.update_strategy full ->
    model.lora_rank 0, lora -> model.lora_rank (16 unless set);
    modules.rollout.mtp_enabled -> rollout.speculative (mtp, or off);
    memory_management.{dynamic_offload, offload_trigger_threshold} -> memory.*. A key both
    here and in honing's sections must agree.
    """
    tree = dict(tree)
    mapped: dict[str, Any] = {}

    def unknown(where: str, keys) -> None:
        if keys:
            raise ConfigError(f"{source}: unknown config key {where}.{sorted(keys)[0]}")

    def not_yet(key: str, why: str) -> None:
        raise ConfigError(f"{source}: {key} is not supported by honing yet ({why})")

    if "schedule_mode" in tree:
        mapped["schedule.mode"] = tree.pop("schedule_mode")
    modules = tree.pop("modules", None) or {}
    if not isinstance(modules, dict):
        raise ConfigError(f"{source}: modules: expected a mapping")
    unknown("modules", set(modules) - {"rollout", "inference", "training"})
    rollout = modules.get("rollout") or {}
    unknown("modules.rollout", set(rollout) - {"engine", "mtp_enabled", "batch_size"})
    if "engine" in rollout:
        engine = str(rollout["engine"]).lower()
        if engine not in GUIDE_ENGINES:
            raise ConfigError(
                f"{source}: modules.rollout.engine: {rollout['engine']!r} is not allowed; "
                f"choose one of: {', '.join(GUIDE_ENGINES)}"
            )
        mapped["rollout.engine"] = GUIDE_ENGINES[engine]
    if "batch_size" in rollout:
        mapped["rollout.batch_size"] = rollout["batch_size"]
    if "mtp_enabled" in rollout:  # MTP self-speculative decoding (off: no speculation)
        mapped["rollout.speculative"] = "mtp" if rollout["mtp_enabled"] else "off"
    inference = modules.get("inference") or {}
    unknown("modules.inference", set(inference) - {"models"})
    if inference.get("models"):
        urls, names = [], []
        for entry in inference["models"]:
            if isinstance(entry, str):
                urls.append(entry)
            elif isinstance(entry, dict) and (entry.get("url") or entry.get("endpoint")):
                urls.append(str(entry.get("url") or entry.get("endpoint")))
                names += [str(entry["name"])] if entry.get("name") else []
            else:
                raise ConfigError(
                    f"{source}: modules.inference.models: expected server URLs or mappings "
                    f"with url (and name), got {entry!r}"
                )
        if len(set(names)) > 1:
            not_yet("modules.inference.models with several model names", "one policy")
        mapped["rollout.endpoints"] = ",".join(urls)
        if names:
            mapped["rollout.model_name"] = names[0]
    training = modules.get("training") or {}
    unknown("modules.training", set(training) - {"update_strategy"})
    strategy = training.get("update_strategy")
    if strategy is not None and strategy not in GUIDE_UPDATE_STRATEGIES:
        not_yet(
            f"modules.training.update_strategy={strategy!r}",
            f"choose one of: {', '.join(GUIDE_UPDATE_STRATEGIES)}",
        )
    if strategy == "full":
        mapped["model.lora_rank"] = 0
    elif strategy == "lora":
        given = (
            (tree.get("model") or {}).get("lora_rank")
            if isinstance(tree.get("model"), dict)
            else None
        )
        mapped["model.lora_rank"] = given if given else GUIDE_LORA_RANK
    memory = tree.pop("memory_management", None) or {}
    unknown("memory_management", set(memory) - {"dynamic_offload", "offload_trigger_threshold"})
    for name in ("dynamic_offload", "offload_trigger_threshold"):
        if name in memory:
            mapped[f"memory.{name}"] = memory[name]
    for key, value in mapped.items():
        section, _, name = key.partition(".")
        here = tree.setdefault(section, {})
        if not isinstance(here, dict):
            raise ConfigError(f"{source}: {section}: expected a mapping")
        if name in here and here[name] != value:
            raise ConfigError(
                f"{source}: {key} is {here[name]!r} but the guide's key says {value!r}"
            )
        here[name] = value
    return tree


def _parse_value(key: str, raw: str) -> Any:
    """A command-line or environment value, read as a YAML scalar or list."""
    try:
        return _load(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{key}: {raw!r} is not a valid value ({problem})") from None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``section.key=value`` strings from the command line; values are parsed as YAML scalars."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"bad override {item!r}: expected section.key=value")
        out[key.strip()] = _parse_value(key.strip(), raw) if raw.strip() else ""
    return out


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    return {key: environ[var] for var, key in ENV_KEYS.items() if environ.get(var, "") != ""}


def build_config(*layers: dict[str, Any]) -> Config:
    """Apply dotted-key layers, later ones winning, onto the defaults; validate every value."""
    values: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for key, value in layer.items():
            f = _field(key)
            section, _, name = key.partition(".")
            values.setdefault(section, {})[name] = _coerce(key, f, value)
    return Config(**{name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()})


def resolve_config(
    path: str | None, overrides: list[str], environ: dict[str, str] | None = None
) -> Config:
    """defaults < YAML file < deployment environment variables < command-line overrides."""
    file_layer = load_yaml(path) if path else {}
    return build_config(file_layer, env_overrides(environ), parse_overrides(overrides))


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
