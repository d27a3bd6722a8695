"""The Ray backend's workers: rollout workers (each a ``TransformersEngine`` on its own copy of
the policy, or vLLM in the actor under ``rollout.engine=vllm``; in the turn loop of
``rollout.tools`` when the run has tools) behind
``RayRolloutEngine``, and reward workers (each the run's own scorer) behind ``RayScorer``;
both are pools (``ray_pools``). With ``pipeline.autoscale_max`` the rollout workers' target
follows the steps' waits (``autoscale``).
"""

from __future__ import annotations

from pathlib import Path

import ray

from honing.backends.autoscale import autoscaler_for
from honing.backends.ray_pools import Report, _Pool, _Worker
from honing.config import Config
from honing.models.loading import load_tokenizer, resolve_device
from honing.pipeline.inputs import build_scorer
from honing.pipeline.rank_rules import custom_resources
from honing.pipeline.rollout_engines import frozen_model, local_engine, vllm_engine
from honing.rollout.base import (
    EngineReport,
    GenerationRequest,
    Holding,
    RolloutEngine,
    SamplingParams,
    WeightBuckets,
    chunked,
)
from honing.rollout.native.mtp import MTP_PREFIX
from honing.rollout.native.speculative import merge_metrics
from honing.types import Rollout


@ray.remote
class RolloutWorker:
    """A ``TransformersEngine`` on its own copy of the policy."""

    def __init__(self, config: Config, model_dir: str):
        import torch

        threads = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1) or 1)
        torch.set_num_threads(max(threads, 1))
        device = resolve_device(config.model.device)
        tokenizer = load_tokenizer(model_dir, trust_remote_code=config.model.trust_remote_code)
        model = frozen_model(Path(model_dir), tokenizer, config.model, device)
        self.local = local_engine(config, model, tokenizer, device)  # its own copy
        self.engine = self.local  # with rollout.tools: the turn loop runs here, beside it
        if config.rollout.engine == "vllm":  # vLLM in this actor: the first task's weights
            self.engine = vllm_engine(config, self.local, Path(model_dir), device)
        if turns_on_workers(config):
            from honing.rollout.tools.turns import with_tools

            self.engine, _ = with_tools(self.engine, self.engine, tokenizer, config.rollout)

    def ready(self) -> bool:
        return True

    def node(self) -> str:
        """The id of the node it runs on."""
        return ray.get_runtime_context().get_node_id()

    def generate(self, version: int, buckets, requests, params):
        """The rollouts, and the engine's report (speculation, timeouts) of this call;
        ``buckets``: the object references of the weights' buckets, when this worker lacks
        ``version`` (fetched one at a time)."""
        if buckets is not None:
            heads = {}  # rollout.speculative=mtp: the heads the trainer trains

            def policy_buckets():
                for ref in buckets:
                    bucket = []
                    for name, tensor in ray.get(ref):
                        if name.startswith(MTP_PREFIX):
                            heads[name.removeprefix(MTP_PREFIX)] = tensor
                        else:
                            bucket.append((name, tensor))
                    yield bucket

            self.engine.load_weights(version, policy_buckets())
            if heads:
                self.local.speculation.draft_model.load_state_dict(heads)
        rollouts = self.engine.generate(requests, params)
        return rollouts, self.engine.take_report()


def turns_on_workers(config: Config) -> bool:
    """Whether the rollout workers run ``rollout.tools``' turn loop beside their engines. Not
    with ``schedule.partial_rollout``: a sample continued by turns and by chunks keeps its
    turns in one place, the trainer's turn loop, whose every turn the workers sample (a
    chunk may go to any worker)."""
    return bool(config.rollout.tools) and not config.schedule.partial_rollout


class RayRolloutEngine(_Pool, RolloutEngine):
    """A ``RolloutEngine`` over rollout-worker actors (``honing.backends.ray_run``)."""

    kind = "rollout"

    def __init__(self, config: Config, model_dir: Path, control, rid: str, report: Report):
        settings = config.pipeline
        resources = {"num_cpus": settings.rollout_cpus, "num_gpus": settings.rollout_gpus}
        if wanted := custom_resources(settings.rollout_resources):  # e.g. spot nodes' label
            resources["resources"] = wanted
        super().__init__(config, control, rid, report, RolloutWorker, resources)
        RolloutEngine.__init__(self, Holding.REMOTE)  # the workers' models, elsewhere
        self.computes_here = False
        self.model_dir, self.chunk = str(model_dir), settings.rollout_chunk
        self._latest = None  # (version, the ObjectRefs of its buckets)
        self.autoscaler = autoscaler_for(config)  # None: the count is the control's alone
        if self.autoscaler is not None:
            report.gauges["ray/rollout_workers_target"] = float(self.autoscaler.workers)
        self.reconcile(quiet=True)

    def _actor_args(self) -> tuple:
        return (self.config, self.model_dir)

    def take_report(self) -> EngineReport:
        """The pools' gauges now and their events since the last call."""
        return self.report.drain()

    def detached_copy(self) -> RayRolloutEngine:
        return self  # the workers hold their own models

    def step_done(self, metrics: dict[str, float]) -> None:
        """``pipeline.autoscale_max`` > 0: the step's waits may change the control actor's
        target (``autoscale``), which the pool meets before its next task. A target that
        someone else set meanwhile (``honing scale``) overrides it: the autoscaler stops for
        the rest of the run."""
        if self.autoscaler is None:
            return
        target = self._target()
        if target != self.autoscaler.workers:
            self.report.event(
                "autoscale_overridden", target=target, autoscaled=self.autoscaler.workers
            )
            self.autoscaler = None
            return
        change = self.autoscaler.observe(metrics)
        if change is None:
            return
        ray.get(self.control.set.remote(change.after, None))
        self.report.gauges["ray/rollout_workers_target"] = float(change.after)
        self.report.event(
            "rollout_workers_autoscaled",
            before=change.before,
            after=change.after,
            reason=change.reason,
        )

    def load_weights(self, version: int, weights: WeightBuckets | None = None) -> None:
        """Puts the weights in Ray's object store, one object per bucket as it comes (a host
        copy of one bucket at once); each worker fetches them once, a bucket at a time,
        before its next task."""
        if weights is not None:
            refs = [ray.put(_on_host(bucket)) for bucket in weights]
            self._latest = (version, refs)
        self.weight_version = version

    def generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[Rollout]:
        tasks = chunked(requests, params, self.chunk)

        def submit(worker: _Worker, task):
            version, ref = self._latest if self._latest else (self.weight_version, None)
            weights = ref if worker.version != version else None  # sent once per worker
            worker.version = version
            return worker.handle.generate.remote(version, weights, task[0], task[1])

        def lost(task):
            with self.lock:
                self.regenerated += len(task[0]) * params.n

        results = self.run_tasks(tasks, submit, lost)
        self._merge_reports([results[index][1] for index in sorted(results)])
        return [rollout for index in sorted(results) for rollout in results[index][0]]

    def _merge_reports(self, reports) -> None:
        """The workers' engine reports as one (counts summed, acceptance recomputed)."""
        for _, events in reports:
            for kind, fields in events:
                self.report.event(kind, **fields)
        merged = merge_metrics([metrics for metrics, _ in reports])
        with self.report.lock:
            self.report.once = merge_metrics([self.report.once, merged])


def _on_host(bucket: list) -> list:
    """A copy of ``bucket``'s tensors in host memory, for the object store."""
    return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in bucket]


@ray.remote
class RewardWorker:
    """The run's scorer, in its own process."""

    def __init__(self, config: Config):
        self.scorer = build_scorer(config)

    def ready(self) -> bool:
        return True

    def score(self, prompts_by_id, rollouts, rendered, on_error=None):
        scores = self.scorer.score(prompts_by_id, rollouts, rendered, on_error)
        return scores, self.scorer.last_latencies_ms, self.scorer.last_metrics


class RewardPool(_Pool):
    kind = "reward"

    def __init__(self, config: Config, control, rid: str, report: Report):
        resources = {"num_cpus": config.pipeline.reward_cpus}
        super().__init__(config, control, rid, report, RewardWorker, resources)
        self.reconcile(quiet=True)

    def _target(self) -> int:
        return max(super()._target(), 1)  # set to 0 while running: keep one


class RayScorer:
    """A ``Scorer`` whose work runs on the reward workers: each call's rollouts are split
    into one shard per live worker; a shard whose worker died is scored again elsewhere."""

    def __init__(self, pool: RewardPool, local, owner: bool = True):
        self.pool, self.local, self.owner = pool, local, owner
        self.reward_fn = local.reward_fn  # load-time checks read it
        self.on_error, self.failure = local.on_error, local.failure  # validation reads them
        self.last_latencies_ms: list[float] = []
        self.last_metrics: dict[str, float] = {}

    def sibling(self) -> RayScorer:
        """Another view on the same workers (each scoring thread records its own calls)."""
        return RayScorer(self.pool, self.local, owner=False)

    def score(self, prompts_by_id, rollouts, rendered_prompts=None, on_error=None):
        rendered_prompts = rendered_prompts or {}
        count = max(len(self.pool.workers), 1)
        size = -(-len(rollouts) // count) or 1
        shards = [rollouts[i : i + size] for i in range(0, len(rollouts), size)]

        def submit(worker: _Worker, shard):
            ids = {r.prompt_id for r in shard}
            return worker.handle.score.remote(
                {i: prompts_by_id[i] for i in ids},
                shard,
                {i: rendered_prompts[i] for i in ids if i in rendered_prompts},
                on_error,
            )

        results = self.pool.run_tasks(shards, submit)
        scores, self.last_latencies_ms, self.last_metrics = [], [], {}
        for index in sorted(results):
            part, latencies, metrics = results[index]
            scores += part
            self.last_latencies_ms += latencies
            for key, value in metrics.items():
                self.last_metrics[key] = self.last_metrics.get(key, 0.0) + value
        return scores

    def close(self) -> None:
        if self.owner:
            self.pool.close()
            self.local.close()
