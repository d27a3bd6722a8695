"""Validation never counts a failed score as a wrong answer: it tries again, and what still
fails is counted and left out of the rates."""

import itertools
import json

from fastapi.responses import JSONResponse

from honing.backends.launch import train
from honing.cli import main
from honing.pipeline import evaluate
from honing.services.verifier import verifier_app
from tests.pipeline._configs import small_run_config

NO_LOG = lambda message: None  # noqa: E731
PICKY = '''
def picky(response, ground_truth, **context):
    """1.0 for an answer without digits; one with digits it cannot judge (raises)."""
    if any(c.isdigit() for c in response):
        raise ValueError("cannot judge this answer")
    return 1.0
'''


def _first(run_dir):
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


def _flaky(app):
    """Every other /score request answers 500 (a replica restarting, a crash)."""
    calls = itertools.count()

    @app.middleware("http")
    async def fail_every_other(request, call_next):
        if request.url.path == "/score" and next(calls) % 2 == 0:
            return JSONResponse({"error": "internal error"}, status_code=500)
        return await call_next(request)

    return app


def test_failed_validation_scores_are_tried_again(
    serve, micro_model_dir, digit_reward, tmp_path, monkeypatch
):
    monkeypatch.setattr(evaluate, "RESCORE_WAITS_S", (0.05, 0.05))
    healthy = serve(verifier_app(workers=1, routes={"arithmetic": digit_reward}))
    flaky = serve(_flaky(verifier_app(workers=1, routes={"arithmetic": digit_reward})))
    common = {
        "trainer.total_steps": 1,
        "data.val_size": 8,
        "rollout.val_samples": 2,
        "reward.on_error": "zero",
        "reward.retries": 0,  # the client gives up at once: validation must try again
        "reward.cache_size": 0,
    }
    for name, url in (("healthy", healthy), ("flaky", flaky)):
        config = small_run_config(micro_model_dir, "auto", **common, **{"reward.endpoint": url})
        train(config, tmp_path / name, resume="never", log=NO_LOG)
    good, got = _first(tmp_path / "healthy"), _first(tmp_path / "flaky")
    assert good["val/score_errors"] == got["val/score_errors"] == 0
    assert got["val/score_retried"] > 0 and good["val/score_retried"] == 0
    for key in ("val/accuracy", "val/pass@2", "val/mean@2"):
        assert got[key] == good[key], key


def test_scores_that_keep_failing_are_counted_and_left_out(
    micro_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(evaluate, "RESCORE_WAITS_S", (0.01,))
    reward = tmp_path / "picky.py"
    reward.write_text(PICKY)
    run = tmp_path / "run"
    args = [
        "train",
        f"model.path={micro_model_dir}",
        f"reward.function={reward}:picky",
        "reward.on_error=zero",
        "trainer.total_steps=1",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=3",
        "rollout.val_samples=2",
        "data.val_size=8",
        "monitor.tensorboard=false",
        "--output-dir",
        str(run),
    ]
    assert main(args) == 0
    first = _first(run)
    errors = first["val/score_errors"]
    assert errors > 0  # some of the micro model's answers have digits
    # Only "right" answers could be scored, so every rate over what was scored is 1 (counting
    # the failures as wrong answers would make them lower).
    assert first["val/accuracy"] == first["val/mean@2"] == first["val/pass@2"] == 1.0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    said = [e for e in events if e["kind"] == "val_score_errors"]
    assert said and said[0]["step"] == 0 and said[0]["count"] == errors
    assert "cannot judge" in said[0]["reason"] and said[0]["retried"] == errors
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_score_errors"] >= errors
    assert "validation scores failed on every try" in capsys.readouterr().out
