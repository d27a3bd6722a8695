"""Placement on a cluster of several nodes (Ray's own multi-node test cluster, on this
machine): ``pipeline.placement=spread`` puts the rollout workers on different nodes."""

import signal

import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from honing.backends import ray_pools, ray_run, ray_workers  # noqa: E402

from ._configs import small_run_config  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with ray_run.on_loopback():  # two nodes of this machine, reachable from it alone
        cluster = cluster_utils.Cluster(
            initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
        )
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
