"""The typed config tree: one frozen dataclass per section, each field with its default and
the metadata validation reads (choices, bounds, item types, URL lists)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


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
    # a local Hugging Face model directory, or builtin:tiny (or builtin:tiny-moe: 8 experts)
    path: str = _opt("builtin:tiny")
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
    train_files: list = _opt([], items=str)  # JSONL / Parquet paths in verl's row schema
    val_files: list = _opt([], items=str)
    train_size: int = _opt(4000, ge=1)  # built-in task: number of training problems
    val_size: int = _opt(200, ge=1)  # built-in task: held-out validation problems
    max_digits: int = _opt(2, ge=1, le=9)  # built-in task: most digits of an operand
    min_digits: int = _opt(1, ge=1, le=9)  # built-in task: fewest digits of an operand
    on_bad_row: str = _opt("error", choices=("error", "skip"))
    shuffle: bool = _opt(True)
    # Prompts by their running solve rate (raw verdicts, before reward shaping; data/
    # solve_rates.py): skip a prompt every sample of which was solved so far (skip_solved) or
    # none (skip_unsolved), once it has solve_rate_min_samples verdicts (0: rollout.group_size)
    skip_solved: bool = _opt(False)
    skip_unsolved: bool = _opt(False)
    solve_rate_min_samples: int = _opt(0, ge=0)


@dataclass(frozen=True)
class RolloutConfig:
    # auto: vllm on a GPU where it is installed, takes the run's settings and the policy has
    # 20M parameters or more, else transformers; transformers: honing's own, in process; vllm:
    # vLLM's engine in process (pip install -e ".[vllm]"); openai: remote servers speaking the
    # OpenAI completions API with token ids and logprobs (vLLM, SGLang, honing serve rollout)
    engine: str = _opt("auto", choices=("auto", "transformers", "vllm", "openai"))
    endpoints: str = _opt("", urls=True)  # openai: server URLs, comma-separated
    model_name: str = _opt("")  # openai: the served model's name (default: the first served)
    timeout_s: float = _opt(600.0, gt=0.0)  # openai: one completion request
    retries: int = _opt(2, ge=0)  # openai: other endpoints tried for a failed request
    max_concurrency: int = _opt(16, ge=1)  # openai: requests in flight at once
    # openai: how new weights reach the servers: tensors (POST /update_weights, honing's
    # server), disk (write weight_dir/vN, POST /update_weights_from_disk: SGLang, honing's),
    # vllm (vLLM's RL API: shared-memory files or NCCL, per the server's weight-transfer
    # backend), none (the servers keep their weights: evaluation or an external sync)
    weight_sync: str = _opt("tensors", choices=("tensors", "disk", "vllm", "none"))
    # disk: a directory the servers can read; vllm: where bucket files go (default /dev/shm)
    weight_dir: str = _opt("")
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
    # The policy's weights reach the rollout engines in pieces of at most this many MiB
    weight_bucket_mb: int = _opt(256, ge=1)
    # rollout.engine=vllm: the KV cache's size (0: 256 MiB on a CPU; on CUDA what
    # gpu_memory_utilization leaves), eager mode (false: torch.compile and CUDA graphs), and
    # on CUDA the GPU's share for vLLM and sleep mode (KV cache freed, weights offloaded while
    # the trainer updates; schedule.mode=sync)
    vllm_kv_cache_mb: int = _opt(0, ge=0)
    vllm_enforce_eager: bool = _opt(True)
    vllm_gpu_memory_utilization: float = _opt(0.5, gt=0.0, le=1.0)
    vllm_sleep: bool = _opt(False)
    # rollout.engine=vllm under torchrun: each rank holds a vLLM engine; with N > 1 every N
    # consecutive ranks share one, tensor-parallel (its sampling is the same on each of them)
    tensor_parallel: int = _opt(1, ge=1)
    # Multi-turn rollouts with tools (honing/rollout/tools/turns.py): python (code run in
    # honing's sandbox), calculator, package.module:function or path/file.py:function; empty =
    # one turn. A turn ends at the format's closing tag; its calls run (at most
    # max_tool_calls, each under tool_timeout_s, output cut to tool_output_bytes) and their
    # responses, which get no loss, are appended; up to max_turns turns per sample.
    tools: list = _opt([], items=str)
    max_turns: int = _opt(4, ge=1)
    max_tool_calls: int = _opt(4, ge=1)
    tool_timeout_s: float = _opt(10.0, gt=0.0)
    tool_output_bytes: int = _opt(4096, ge=64)
    tool_format: str = _opt("hermes", choices=("hermes",))


@dataclass(frozen=True)
class RewardConfig:
    # "auto" (route by data_source: math, code, arithmetic...), a built-in name,
    # package.module:function or path/file.py:function
    function: str = _opt("auto")
    routes: dict = _opt({}, items=str)  # data_source -> reward function; adds to / overrides auto
    weights: dict = _opt({}, items=float)  # further reward functions added with a weight
    format_weight: float = _opt(0.0)  # weight of the built-in format reward (0 = off)
    on_error: str = _opt("fail", choices=("fail", "zero", "drop"))
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
    # rollout.tools: subtracted from a sample's reward per tool call that errored (malformed,
    # unknown tool, raised, timed out) and per call beyond free_tool_calls (0 = off)
    tool_error_penalty: float = _opt(0.0, ge=0.0)
    tool_call_penalty: float = _opt(0.0, ge=0.0)
    free_tool_calls: int = _opt(1, ge=0)
    # reward.function=judge (or a route to judge): a generative judge behind an OpenAI-
    # compatible completions API grades each answer (honing/rewards/judge.py); timeout_s,
    # retries, request_items, max_concurrency and cache_size apply to it
    judge_endpoint: str = _opt("", urls=True)  # the judge servers, comma-separated
    judge_model: str = _opt("")  # the served model to ask ("" = the server's first)
    # the grading prompt with {question}, {answer}, {reference} ("" = the built-in one)
    judge_template: str = _opt("")
    judge_verdict: str = _opt("score", choices=("score", "label"))
    judge_score_max: float = _opt(1.0, gt=0.0)  # score: the reply's last number / this
    # label: word -> reward ({} = correct 1, incorrect 0)
    judge_labels: dict = _opt({}, items=float)
    judge_max_tokens: int = _opt(64, ge=1)
    judge_format_score: float = _opt(0.0)  # the reward of a reply the parser cannot read


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage: str = _opt("grpo")
    policy_loss: str = _opt("ppo_clip")
    loss_agg: str = _opt("token_mean")
    clip_ratio_low: float = _opt(0.2, ge=0.0, le=1.0)
    clip_ratio_high: float = _opt(0.2, ge=0.0)
    clip_ratio_c: float = _opt(0.0, ge=0.0)  # dual-clip bound for A < 0 (> 1), 0 = off
    norm_adv_by_std: bool = _opt(True)  # divide by the group's std (grpo)
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
    # advantage=distill (on-policy distillation): the teacher, a local Hugging Face directory
    # or servers of an OpenAI-compatible API with vLLM's prompt_logprobs (one of the two), with
    # the policy's tokenizer, grades each sampled token; its reward is distill_coef x
    # (log pi_teacher - log pi_student), plus distill_score_coef x the scores' GRPO advantage
    teacher_path: str = _opt("")
    teacher_endpoint: str = _opt("", urls=True)  # the teacher's servers, comma-separated
    teacher_model: str = _opt("")  # teacher_endpoint: the served model ("" = the first)
    distill_coef: float = _opt(1.0, gt=0.0)
    distill_score_coef: float = _opt(0.0, ge=0.0)
    # Truncated importance sampling against the engine/trainer gap: min(pi_old / mu, tis_cap).
    # auto: token under schedule.mode one_step / async (rollouts sampled by an older
    # version), none under sync
    tis_level: str = _opt("auto", choices=("auto", "none", "token", "sequence"))
    tis_cap: float = _opt(2.0, gt=0.0)
    # Rollout correction (verl's rollout_corr; docs/algorithms.md): importance weights at
    # token or sequence level ("" = none; set, tis_level auto means none), truncated at a
    # float or masked outside "lower_upper" (IcePop); optionally divided by their batch mean
    rollout_is: str = _opt("", choices=("", "token", "sequence"))
    rollout_is_threshold: str = _opt("2.0")
    rollout_is_batch_normalize: bool = _opt(False)
    # Rejection: comma-separated options (token_k1 .. seq_max_k3), every one must keep a
    # token; thresholds one each or one for all (k1: "lower_upper" or an upper ratio bound
    # whose reciprocal is the lower; k2 / k3: an upper bound)
    rollout_rs: str = _opt("")
    rollout_rs_threshold: str = _opt("")
    # Mixture-of-experts policies (docs/moe.md). Routing replay: the trainer's forward passes
    # use the experts the rollout engine chose (R3) or its own first pass chose (R2)
    routing_replay: str = _opt("off", choices=("off", "R2", "R3"))
    router_aux_coef: float = _opt(0.0, ge=0.0)  # the family's load-balancing loss
    router_z_coef: float = _opt(0.0, ge=0.0)  # the router z-loss (ST-MoE)


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
    # Tokens per forward/backward instead (0 = off): rows x the longest row's prompt width +
    # response, what the padded forward runs (the packed one runs no more); a longer row goes
    # alone; under torchrun each rank gets about as many tokens (the rows dealt by length)
    max_tokens_per_micro: int = _opt(0, ge=0)
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
    # Under torchrun: replicate (every rank holds the whole model, gradients all-reduced) or
    # fsdp (FSDP2: each rank holds 1/N of the parameters, gradients and optimizer state)
    strategy: str = _opt("replicate", choices=("replicate", "fsdp"))
    fsdp_reshard_after_forward: bool = _opt(True)  # fsdp: free gathered layers after forward
    # fsdp: the dtype parameters are cast to for compute (gradients reduce in float32)
    fsdp_param_dtype: str = _opt("float32", choices=("float32", "bfloat16", "float16"))
    # Under torchrun: ranks per sequence (Ulysses; honing/trainer/ulysses/parallel.py). The
    # W ranks form W/N data-parallel slots of N consecutive ranks, which share each sequence
    # of their rows: activations per rank ~1/N. 1 = off
    sequence_parallel: int = _opt(1, ge=1)
    # Under torchrun: ranks per split weight (Megatron-style tensor parallelism; honing/trainer/
    # tensor_parallel.py). Each slot of N consecutive ranks splits the attention heads and the
    # MLP over its ranks and runs the same rows; with strategy=fsdp the slots shard the rest
    # (2-D). Weights, gradients and optimizer state per rank ~1/N of the split layers. 1 = off
    tensor_parallel: int = _opt(1, ge=1, le=64)
    # Under torchrun, a mixture-of-experts policy: data-parallel slots per expert group
    # (honing/trainer/expert_parallel.py). Each of N consecutive slots holds E/N of every
    # layer's routed experts and runs its own rows; each token goes to the rank of its
    # experts (all-to-all). Expert weights, gradients and optimizer state per rank ~1/N. 1 = off
    expert_parallel: int = _opt(1, ge=1, le=1024)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = _opt(50, ge=0)  # 0 = only at the end
    keep: int = _opt(2, ge=1)
    save_optimizer: bool = _opt(True)
    mirror_url: str = _opt("")  # fsspec URL or path for a second copy; "" = off
    mirror_every: int = _opt(1, ge=1)  # mirror every N-th checkpoint (an archive tier)
    mirror_keep: int = _opt(0, ge=0)  # copies the mirror keeps, newest first; 0 = all
    mirror_retries: int = _opt(2, ge=0)  # further tries of a failed upload (1 s, 2 s, ... apart)


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
    # async: a batch takes rollout.batch_size finished groups (earliest deadline first); the
    # others go on with the next weights, which reach the engine between chunks of
    # partial_chunk_tokens tokens per sample (honing/pipeline/partial.py). A sample's
    # staleness is its oldest token's; one that would be staler than max_staleness if it
    # waited is ended (abort) and trained.
    partial_rollout: bool = _opt(False)
    partial_chunk_tokens: int = _opt(16, ge=1)
    # A continued sample's KV cache: recompute (each chunk computes it afresh with the weights
    # of the time) or keep (the cache its earlier tokens were given, by older weights, as
    # PipelineRL does; honing's engine on the fast decode path, vLLM in process).
    partial_kv: str = _opt("recompute", choices=("recompute", "keep"))


@dataclass(frozen=True)
class MemoryConfig:
    # Under the sync schedule on a GPU: when device memory in use passes the threshold (a
    # fraction of the device's), the trainer's idle state (optimizer state, gradients, the
    # reference model) goes to host memory during generation and comes back for the update.
    # On a machine without CUDA it does nothing (and says so once, in events.jsonl).
    dynamic_offload: bool = _opt(False)
    offload_trigger_threshold: float = _opt(0.85, gt=0.0, le=1.0)
    # trainer.strategy=fsdp on CUDA: parameters and gradients on the host, the optimizer step
    # there too (FSDP2's CPU offload); the optimizer's state on the host between updates.
    # On a machine without CUDA both do nothing (and say so once).
    param_offload: bool = _opt(False)
    optimizer_offload: bool = _opt(False)


@dataclass(frozen=True)
class PipelineConfig:
    # local: everything in this process (threads); ray: the trainer, rollout workers and reward
    # workers are Ray actors (honing/backends/ray_run.py), on a local or existing cluster.
    backend: str = _opt("local", choices=("local", "ray"))
    ray_address: str = _opt("")  # "" = start a local Ray instance; "auto" or host:port = join
    trainer_workers: int = _opt(1, ge=1)  # ray: trainer actors, data parallel (torch.distributed)
    rollout_workers: int = _opt(2, ge=1)  # ray: actors sampling with the policy's weights
    reward_workers: int = _opt(1, ge=0)  # ray: actors scoring (0 = score in the trainer)
    rollout_chunk: int = _opt(4, ge=1)  # ray, torchrun: prompts per rollout task
    spread_generation: bool = _opt(True)  # torchrun: every rank samples tasks (else rank 0)
    trainer_cpus: float = _opt(1.0, ge=0)  # ray: resources each actor asks for
    trainer_gpus: float = _opt(0.0, ge=0)
    rollout_cpus: float = _opt(1.0, ge=0)
    rollout_gpus: float = _opt(0.0, ge=0)
    reward_cpus: float = _opt(1.0, ge=0)
    rollout_resources: str = _opt("")  # ray: custom resources a rollout worker asks, "spot=1,..."
    # ray: 0 = rollout workers stay at rollout_workers; N = they scale between autoscale_min
    # and N by where the step waited (honing/backends/autoscale.py)
    autoscale_max: int = _opt(0, ge=0)
    autoscale_min: int = _opt(1, ge=1)
    autoscale_patience: int = _opt(2, ge=1)  # steps a wait must last before workers change
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
