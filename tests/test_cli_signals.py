"""SIGTERM (schedulers, Kubernetes, torchrun) ends a run as Ctrl-C does: the save in progress
is abandoned cleanly, the console says how to resume (or that no checkpoint was written), and
the exit status is 143."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from honing.checkpoint import CheckpointManager
from honing.cli import main, stop_on_sigterm
from honing.config import ENV_KEYS
from honing.errors import Terminated
from honing.pipeline.loop import TrainLoop
from tests.pipeline._configs import cli_args


@pytest.fixture
def sigterm_handler():
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_sigterm():
        yield
    assert signal.getsignal(signal.SIGTERM) is before  # put back for whoever ran main()


def test_sigterm_during_a_save_leaves_no_partial_checkpoint(tmp_path, sigterm_handler):
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2)
    manager.save(1, lambda directory: (directory / "weights").write_text("one"))

    def write(directory):
        (directory / "weights").write_text("half of it")
        os.kill(os.getpid(), signal.SIGTERM)  # lands mid-save
        time.sleep(5)  # the handler raises here
        (directory / "more").write_text("never written")

    with pytest.raises(Terminated):
        manager.save(2, write)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    assert manager.resolve("auto") == manager.path_for(1)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # a second one kills at once


@pytest.mark.slow
def test_sigterm_ends_a_run_that_resumes_where_it_stopped(tmp_path, micro_model_dir, digit_reward):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env["TOKENIZERS_PARALLELISM"] = "false"
    args = [
        f"model.path={micro_model_dir}",
        f"reward.function={digit_reward}",
        "rollout.batch_size=2",
        "rollout.group_size=2",
        "data.val_size=2",
        "trainer.val_every=0",
        "checkpoint.every=1",
        "monitor.console=false",
        "monitor.tensorboard=false",
        "--output-dir",
        str(run),
    ]
    command = [sys.executable, "-m", "honing.cli", "train", *args]
    child = subprocess.Popen(
        [*command, "trainer.total_steps=100000"], env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step_2").is_dir():
        assert child.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 143, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "honing: terminated (SIGTERM); resume with --resume auto"
    )
    checkpoints = run / "checkpoints"
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp-")]
    stopped_at = CheckpointManager(checkpoints, keep=2).complete_steps()[-1]
    resumed = subprocess.run(
        [*command, f"trainer.total_steps={stopped_at + 1}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [stopped_at]


@pytest.fixture
def sigterm_at_step(monkeypatch):
    """``sigterm_at_step(n)``: the process sends itself SIGTERM as step ``n`` starts; the
    CLI's own handler takes it from there."""

    def arm(at: int) -> None:
        train_step = TrainLoop.train_step

        def step_then_maybe_stop(self, step):
            if step == at:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here
            return train_step(self, step)

        monkeypatch.setattr(TrainLoop, "train_step", step_then_maybe_stop)

    return arm


@pytest.mark.parametrize(
    ("every", "then"),
    [
        (
            0,
            "no checkpoint was written (checkpoint.every=0 saves only the last step), so "
            "--resume auto starts the run again from step 0; set checkpoint.every=N to keep "
            "one every N steps",
        ),
        (
            3,
            "no checkpoint was written yet (checkpoint.every=3: the first at step 3), so "
            "--resume auto starts the run again from step 0",
        ),
        (1, "resume with --resume auto"),
    ],
)
def test_sigterm_says_whether_there_is_a_checkpoint_to_resume_from(
    tmp_path, micro_model_dir, digit_reward, sigterm_at_step, capsys, every, then
):
    """Stopped as step 2 starts: with ``checkpoint.every=0`` (only the last step saved) or
    before the first save nothing can be resumed, and the last line says so."""
    run = tmp_path / "run"
    sigterm_at_step(2)
    steps = {"trainer.total_steps": 5, "checkpoint.every": every}

    status = main(["train", *cli_args(micro_model_dir, digit_reward, run, **steps)])

    said = capsys.readouterr().err
    assert status == 143 and "Traceback" not in said, said
    assert said.strip().splitlines()[-1] == f"honing: terminated (SIGTERM); {then}"
    held = CheckpointManager(run / "checkpoints", keep=2).complete_steps()
    assert held == ([1] if every == 1 else [])
