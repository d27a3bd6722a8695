"""A training run scored by a verifier service on loopback scores exactly as in-process."""

import json

from honing.backends.launch import train
from honing.services.verifier import verifier_app
from tests.pipeline._configs import small_run_config


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_remote_scores_equal_local_scores(serve, micro_model_dir, digit_reward, tmp_path):
    url = serve(verifier_app(workers=1, routes={"arithmetic": digit_reward}))
    common = {"trainer.total_steps": 3, "rollout.max_new_tokens": 4, "trainer.lr": 1e-3}
    routes = {"reward.routes": {"arithmetic": digit_reward}}  # graded: varies within groups
    local = small_run_config(micro_model_dir, "auto", **common, **routes)
    remote = small_run_config(micro_model_dir, "auto", **common, **{"reward.endpoint": url})
    train(local, tmp_path / "local", resume="never", log=lambda message: None)
    train(remote, tmp_path / "remote", resume="never", log=lambda message: None)
    local_steps, remote_steps = _metrics(tmp_path / "local"), _metrics(tmp_path / "remote")
    key = "critic/score/mean"
    assert [m.get(key) for m in remote_steps] == [m.get(key) for m in local_steps]
    assert len({m.get(key) for m in remote_steps if m["step"] > 0}) > 1  # not all equal
    trained = [m for m in remote_steps if m["step"] > 0]
    assert all(m["reward/requests"] >= 1 and m["samples/score_errors"] == 0 for m in trained)
    assert all(m["reward/latency_p50_ms"] > 0 for m in trained)
