"""The supervisor restarts a crashed training process; a run killed with SIGKILL completes
with the same weights as one never interrupted.

The restart rules are tested with a stand-in "python" (a real process whose exit statuses
are scripted); the kill test runs the real ``honing train`` on the micro model.
"""

import contextlib
import json
import os
import random
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from honing.backends.launch import train
from honing.config import build_config
from honing.pipeline.supervise import exit_status, fixed_output_dir, is_crash, supervise

from ._configs import BASE

FAKE_PYTHON = """#!/bin/sh
# Exits with the next status listed in $STATUSES_FILE, one per start; logs its arguments.
echo "$@" >> "$CALLS_FILE"
n=$(wc -l < "$CALLS_FILE")
status=$(sed -n "${n}p" "$STATUSES_FILE")
if [ "$status" = "KILL" ]; then kill -9 $$; fi
if [ "$status" = "SLEEP" ]; then exec sleep 30; fi
exit "$status"
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    script = tmp_path / "python"
    script.write_text(FAKE_PYTHON)
    script.chmod(0o755)
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    monkeypatch.setenv("STATUSES_FILE", str(tmp_path / "statuses"))

    def run(statuses, max_restarts, argv=("--output-dir", str(tmp_path / "run")), on_start=None):
        (tmp_path / "statuses").write_text("\n".join(statuses) + "\n")
        lines = []
        status = supervise(
            list(argv),
            max_restarts,
            lines.append,
            restart_delay_s=0,
            python=str(script),
            on_start=on_start,
        )
        calls = (tmp_path / "calls").read_text().splitlines()
        return status, calls, lines

    return run


def read_events(run_dir):
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_crash_statuses():
    assert [is_crash(s) for s in (0, 2, 3, 130)] == [False] * 4
    assert [is_crash(s) for s in (1, 137, -9, -11, -15)] == [True] * 5
    assert exit_status(-9) == 137 and exit_status(1) == 1


def test_crashes_are_restarted_with_resume_auto(fake_python, tmp_path):
    status, calls, lines = fake_python(["KILL", "1", "0"], max_restarts=5)

    assert status == 0
    run = str(tmp_path / "run")
    assert calls == [
        f"-m honing.cli train --output-dir {run}",
        f"-m honing.cli train --output-dir {run} --resume auto",
        f"-m honing.cli train --output-dir {run} --resume auto",
    ]
    assert lines[0] == "training killed by SIGKILL; restart 1 of 5 with --resume auto"
    events = read_events(tmp_path / "run")
    assert [(e["kind"], e["exit_status"], e["restart"]) for e in events] == [
        ("restart", 137, 1),
        ("restart", 1, 2),
    ]


def test_restarts_are_bounded(fake_python, tmp_path):
    status, calls, lines = fake_python(["1", "1", "1", "0"], max_restarts=2)
    assert status == 1 and len(calls) == 3
    assert lines[-1] == "training exited with status 1; no restarts left (2)"


@pytest.mark.parametrize("final", ["2", "3", "130"])
def test_user_error_alert_stop_and_ctrl_c_are_not_restarted(fake_python, tmp_path, final):
    status, calls, lines = fake_python([final, "0"], max_restarts=3)
    assert status == int(final) and len(calls) == 1 and lines == []
    assert read_events(tmp_path / "run") == []


def test_sigterm_to_the_supervisor_stops_the_child_without_a_restart(fake_python, tmp_path):
    def terminate_supervisor(pid):
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()

    started = time.monotonic()
    status, calls, lines = fake_python(["SLEEP", "0"], 3, on_start=terminate_supervisor)
    assert status == 128 + signal.SIGTERM and len(calls) == 1 and lines == []
    assert time.monotonic() - started < 10  # the child's 30 s sleep was cut short
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored


def test_a_given_resume_is_replaced_by_auto_on_restart(fake_python, tmp_path):
    argv = ["cfg.yaml", "--resume", "/ckpt/step_3", "--output-dir=/r", "a.b=1"]
    status, calls, _ = fake_python(["1", "0"], max_restarts=1, argv=argv)
    assert calls == [
        "-m honing.cli train cfg.yaml --resume /ckpt/step_3 --output-dir=/r a.b=1",
        "-m honing.cli train cfg.yaml --output-dir=/r a.b=1 --resume auto",
    ]


def test_a_missing_output_dir_is_pinned_for_every_restart():
    args, run_dir = fixed_output_dir(["examples/arithmetic.yaml", "x.y=1"])
    assert args == ["examples/arithmetic.yaml", "x.y=1", "--output-dir", str(run_dir)]
    assert run_dir.name.startswith("arithmetic-")


# --- the real thing: SIGKILL during training ------------------------------------------------

RUN = BASE | {
    "trainer.total_steps": 6,
    "trainer.seed": 5,
    "trainer.lr": 1e-3,
    "trainer.threads": 1,
    "trainer.val_at_start": False,
    "checkpoint.every": 1,
}


def overrides(micro_model_dir, digit_reward):
    values = RUN | {"model.path": str(micro_model_dir), "reward.function": digit_reward}
    return [f"{key}={value}" for key, value in values.items()]


def logged_steps_since(metrics, since):
    """Steps logged in ``metrics.jsonl`` at or after unix time ``since`` (torn lines skipped)."""
    if not metrics.exists():
        return []
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
    return [m["step"] for m in records if m["time"] >= since]


def kill_during_step(run_dir, target_step, pause_s):
    """SIGKILLs a child during ``target_step``: ``pause_s`` after it logged the step before."""

    def watch(pid):
        started, deadline = time.time(), time.time() + 120
        while time.time() < deadline:
            if any(
                s >= target_step - 1 for s in logged_steps_since(run_dir / "metrics.jsonl", started)
            ):
                break
            time.sleep(0.01)
        time.sleep(pause_s)
        with contextlib.suppress(ProcessLookupError):  # it may have finished already
            os.kill(pid, signal.SIGKILL)

    return watch


@pytest.mark.slow
def test_a_run_killed_mid_step_completes_with_the_same_weights(
    micro_model_dir, digit_reward, tmp_path
):
    args = overrides(micro_model_dir, digit_reward)
    config = build_config(dict(item.split("=", 1) for item in args))
    train(config, tmp_path / "reference", log=lambda message: None)
    run_dir = tmp_path / "killed"
    starts = []

    def on_start(pid):
        starts.append(pid)
        if len(starts) == 1:  # one kill, at a random moment of step 3
            watch = kill_during_step(run_dir, 3, random.Random(7).uniform(0, 0.3))
            threading.Thread(target=watch, args=(pid,), daemon=True).start()

    status = supervise(
        [*args, "--output-dir", str(run_dir)],
        max_restarts=2,
        log=lambda message: None,
        on_start=on_start,
        restart_delay_s=0,
    )

    assert status == 0 and len(starts) == 2
    final_a = load_file(tmp_path / "reference" / "checkpoints" / "step_6" / "model.safetensors")
    final_b = load_file(run_dir / "checkpoints" / "step_6" / "model.safetensors")
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name
    events = read_events(run_dir)
    assert [e["exit_status"] for e in events if e["kind"] == "restart"] == [137]
    # Every resume names a checkpoint whose manifest was verified just before.
    verified = {e["path"] for e in events if e["kind"] == "checkpoint_verified"}
    resumed = [e for e in events if e["kind"] in ("resumed", "restarted")]
    assert len(resumed) == 1
    assert resumed[0]["checkpoint"] is None or resumed[0]["checkpoint"] in verified
