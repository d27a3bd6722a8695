"""Placement on a cluster of several nodes (Ray's own multi-node test cluster, on this
machine): ``pipeline.placement=spread`` puts the rollout workers on different nodes;
``pipeline.rollout_resources`` puts them on the nodes that have it, and the loss of such a node
is one event for its workers, whose tasks run again on a new node with the same samples."""

import signal

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from honing.backends import ray_pools, ray_run, ray_workers  # noqa: E402
from honing.models.loading import load_tokenizer  # noqa: E402
from honing.rollout.base import GenerationRequest, SamplingParams  # noqa: E402

from ._configs import small_run_config  # noqa: E402

pytestmark = pytest.mark.slow


# The GCS marks a lost node dead after 3 missed health checks of a second (Ray's default: 5 of
# 3 s); the pool starts the lost workers' replacements once it has.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
HEAD = {"num_cpus": 2, "include_dashboard": False, "_system_config": HEALTH_CHECKS}
SPOT = {"num_cpus": 2, "resources": {"spot": 2}}


@pytest.fixture(scope="module")
def two_nodes():
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with ray_run.on_loopback():  # two nodes of this machine, reachable from it alone
        cluster = cluster_utils.Cluster(initialize_head=True, head_node_args=HEAD)
        cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, namespace=ray_pools.NAMESPACE, log_to_driver=False)
        cluster.wait_for_nodes()
    assert cluster.address.startswith("127.0.0.1:")
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    for sig, handler in handlers.items():  # ray.init installs its own
        signal.signal(sig, handler)


def test_spread_places_rollout_workers_on_different_nodes(two_nodes, micro_model_dir, digit_reward):
    config = small_run_config(micro_model_dir, digit_reward, **{"pipeline.placement": "spread"})
    control = ray_pools.Control.remote(2, 0)
    engine = ray_workers.RayRolloutEngine(
        config, micro_model_dir, control, "spread", ray_pools.Report()
    )
    try:
        nodes = ray.get([worker.handle.node.remote() for worker in engine.workers])
        assert len(set(nodes)) == 2
    finally:
        engine.close()


def test_a_lost_spot_node_is_one_event_and_its_tasks_run_again(
    two_nodes, micro_model_dir, digit_reward
):
    """Both rollout workers ask for ``spot``, which one node has; that node is killed (its
    raylet and agents, ungracefully) and another with ``spot`` joins. The next call's tasks
    fail there and run again on the new node's workers: the same samples as before the loss,
    counted as regenerated, and one ``rollout_node_lost`` event names the node and both
    workers. A worker killed on a live node is replaced alone, as before."""
    overrides = {"pipeline.rollout_resources": "spot=1", "pipeline.rollout_chunk": 1}
    config = small_run_config(micro_model_dir, digit_reward, **overrides)
    tokenizer = load_tokenizer(micro_model_dir)
    requests = [GenerationRequest(f"p{i}", tokenizer.encode(f"{i} ="), i) for i in range(2)]
    params = SamplingParams(n=2, max_new_tokens=4, seed=3)
    spot = two_nodes.add_node(**SPOT)
    report = ray_pools.Report()
    engine = ray_workers.RayRolloutEngine(
        config, micro_model_dir, ray_pools.Control.remote(2, 0), "lost", report
    )
    new_spot = None
    try:
        before = engine.generate(requests, params)
        assert _nodes(engine) == {spot.node_id}  # both started there
        lost = sorted(worker.name for worker in engine.workers)
        two_nodes.remove_node(spot, allow_graceful=False)
        new_spot = two_nodes.add_node(**SPOT)
        after = engine.generate(requests, params)
        assert _key(after) == _key(before)
        assert engine.regenerated == len(requests) * params.n
        _, events = report.drain()
        assert [kind for kind, _ in events] == ["rollout_node_lost"], events
        fields = events[0][1]
        assert fields["node"] == spot.node_id and sorted(fields["workers"]) == lost
        assert fields["tasks"] == len(requests) and len(fields["new"]) == 2
        assert _nodes(engine) == {new_spot.node_id}

        victim = engine.workers[0]
        ray.kill(victim.handle)
        assert _key(engine.generate(requests, params)) == _key(before)
        _, events = report.drain()
        assert [kind for kind, _ in events] == ["rollout_worker_replaced"], events
        assert events[0][1]["dead"] == victim.name
    finally:
        engine.close()
        if new_spot is not None:
            two_nodes.remove_node(new_spot)


def _nodes(engine) -> set[str]:
    return set(ray.get([worker.handle.node.remote() for worker in engine.workers]))


def _key(rollouts):
    return [(r.prompt_id, r.group_index, r.response_ids) for r in rollouts]
