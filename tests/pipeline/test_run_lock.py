"""One writer per run directory: a second ``honing train`` into it is refused with one line
before it writes anything, under ``--max-restarts`` and torchrun too; a run that died holding
the lock leaves it free."""

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest

from honing.backends.launch import train
from honing.errors import UserError
from honing.pipeline.run_lock import LOCK_FILE, RunLock
from honing.pipeline.supervise import supervise
from tests import warm
from tests.sandbox._processes import processes_with

from ._configs import cli_args, small_run_config
from ._warm_python import warm_python

REFUSED = "is being written by another honing train (pid "


def wait_for(condition, what, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.02)


def holder_of(run_dir):
    """The note of the process holding the run directory's lock, once it has written it."""
    path, note = run_dir / LOCK_FILE, {}

    def written():
        try:
            note.update(json.loads(path.read_text()))
        except (OSError, ValueError):
            return False
        return True

    wait_for(written, "lock")
    return note


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("honing: error: ")]


def test_a_second_run_into_a_running_runs_directory_is_refused(
    micro_model_dir, digit_reward, tmp_path
):
    """Two real runs, seeds 1 and 2, into one directory: the second exits 2 with one line and
    writes nothing; the first's history is whole."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        warm.honing(
            "train",
            *cli_args(
                micro_model_dir,
                digit_reward,
                run_dir,
                **{"trainer.total_steps": 6, "trainer.seed": 1},
            ),
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    holder = holder_of(run_dir)
    second = subprocess.run(
        warm.honing(
            "train",
            *cli_args(micro_model_dir, digit_reward, run_dir, **{"trainer.seed": 2}),
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    running = first.poll() is None  # the refusal came while the first run was still at it
    _, first_err = first.communicate(timeout=300)

    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert lines[0].startswith(
        f"honing: error: --output-dir {run_dir} {REFUSED}{holder['pid']} on "
    )
    assert lines[0].endswith("wait for it to end, or choose another --output-dir")
    assert "run:" not in second.stdout  # no accuracy printed for a run that did not train
    assert running and first.returncode == 0, first_err
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert steps == list(range(7))  # the first run's, once each
    assert "seed: 1" in (run_dir / "config.yaml").read_text()
    assert not (run_dir / LOCK_FILE).exists()  # released at the end


def test_a_supervised_run_refused_the_directory_is_not_restarted(
    micro_model_dir, digit_reward, tmp_path, capfd
):
    run_dir = tmp_path / "run"
    holder = RunLock(run_dir)
    holder.acquire()
    lines, starts = [], []
    try:
        status = supervise(
            cli_args(micro_model_dir, digit_reward, run_dir),
            3,
            lines.append,
            on_start=starts.append,
            restart_delay_s=0,
            python=warm_python(tmp_path),
        )
    finally:
        holder.release()
    said = error_lines(capfd.readouterr().err)
    assert status == 2 and len(starts) == 1 and lines == []
    assert len(said) == 1 and f"{REFUSED}{os.getpid()} on " in said[0]
    assert not run_dir.exists()  # nothing written; the directory made for the lock is gone


def test_the_lock_of_a_killed_run_is_taken_over(micro_model_dir, digit_reward, tmp_path):
    """SIGKILL leaves the lock file behind, but the kernel released the lock: the next run
    takes it over (``lock_taken_over``, naming the dead holder) and resumes."""
    run_dir = tmp_path / "run"
    args = cli_args(micro_model_dir, digit_reward, run_dir, **{"trainer.total_steps": 40})
    killed = subprocess.Popen(warm.honing("train", *args), stderr=subprocess.DEVNULL)
    holder = holder_of(run_dir)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists(), "metrics")
    killed.send_signal(signal.SIGKILL)  # the warm client takes its command with it
    wait_for(lambda: not _alive(holder["pid"]), "end of the killed run", 30)
    assert (run_dir / LOCK_FILE).exists()

    config = small_run_config(micro_model_dir, digit_reward, **{"trainer.total_steps": 2})
    train(config, run_dir, log=lambda message: None)

    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    [taken] = [e for e in events if e["kind"] == "lock_taken_over"]
    assert json.loads(taken["previous"]) == holder
    assert not (run_dir / LOCK_FILE).exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_torchrun_rank_0_takes_the_lock(micro_model_dir, digit_reward, tmp_path):
    """Rank 0 is refused with one line. Rank 1 is then waiting for it in the process group's
    start, where torchrun's SIGTERM cannot reach it for 30 s: the test stops there."""
    run_dir = tmp_path / "run"
    holder = RunLock(run_dir)
    holder.acquire()
    command = warm.torchrun(2, "train", *cli_args(micro_model_dir, digit_reward, run_dir))
    launcher = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        said = next((line for line in launcher.stderr if line.startswith("honing: error: ")), "")
        left = sorted(p.name for p in run_dir.iterdir())
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        # torchrun starts each rank in a session of its own, which the launcher's kill
        # misses: rank 1 would wait for rank 0 until its store times out. A killed warm
        # client takes its rank along.
        for pid in processes_with(str(run_dir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=60)
        holder.release()
    assert REFUSED in said
    assert left == [LOCK_FILE]  # the holder's, and nothing of the refused run


@pytest.mark.parametrize("made", [True, False])
def test_a_run_that_fails_before_writing_leaves_the_directory_as_it_was(
    micro_model_dir, tmp_path, made
):
    run_dir = tmp_path / "out" / "run"
    if not made:
        run_dir.mkdir(parents=True)
    config = small_run_config(micro_model_dir, str(tmp_path / "nowhere.py") + ":score")
    with pytest.raises(UserError, match="nowhere.py"):  # the reward fails to load
        train(config, run_dir, log=lambda message: None)
    if made:  # the directories made for the lock are gone
        assert not (tmp_path / "out").exists()
    else:
        assert list(run_dir.iterdir()) == []
