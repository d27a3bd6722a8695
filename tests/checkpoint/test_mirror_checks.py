"""``checkpoint.mirror_url`` checked before a run writes anything: a URL that cannot work on
its face, and a mirror that cannot be reached, are one line and exit status 2."""

import time

import pytest

from honing.checkpoint import CheckpointManager
from honing.cli import main
from honing.errors import UserError
from honing.services.process import free_port
from tests.pipeline._configs import cli_args


@pytest.fixture
def train_with_mirror(micro_model_dir, digit_reward, tmp_path, capsys):
    """``honing train`` (in process) with ``checkpoint.mirror_url=URL`` and ``options``: its
    status, its stderr lines and the run directory."""
    run_dir = tmp_path / "run"

    def run(url, *options):
        settings = {"trainer.total_steps": 3, "checkpoint.mirror_url": url}
        status = main(
            ["train", *cli_args(micro_model_dir, digit_reward, run_dir, **settings), *options]
        )
        said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        return status, said, run_dir

    return run


def test_urls_that_cannot_work_are_one_line(train_with_mirror, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    cases = {
        str(a_file): f"{a_file} is a file; expected a directory path, file://PATH, s3://",
        f"file://{a_file}/under": f"{a_file} is a file; expected a directory path",
        "s3://": "names no bucket; expected s3://bucket/prefix",
        "s3:///runs/r1": "names no bucket; expected s3://bucket/prefix",
        "s3://My_Bucket/r1": "'My_Bucket' is not a valid S3 bucket name (3-63 lowercase",
        "s3://ab/r1": "'ab' is not a valid S3 bucket name",
        "nope://x/y": "nope:// is not a protocol fsspec knows; expected a directory path",
        # a protocol fsspec knows, whose filesystem connects as it is made
        "ftp://127.0.0.1:1/runs": "cannot open it (ConnectionRefusedError: ",
    }
    for url, expected in cases.items():
        status, said, run_dir = train_with_mirror(url)
        assert status == 2 and len(said) == 1, (url, said)
        assert said[0].startswith(f"honing: error: checkpoint.mirror_url={url}: "), said
        assert expected in said[0], (url, said)
        assert not run_dir.exists(), url


def test_an_unreachable_s3_endpoint_is_refused_at_the_start(train_with_mirror, monkeypatch):
    """Nothing listens at the endpoint. A fresh start (``--resume never``) does not look
    into the mirror for a checkpoint, but is refused all the same, not trained for minutes
    against a mirror that takes none of its checkpoints; botocore's own retries are bounded
    by honing (no ``AWS_MAX_ATTEMPTS`` here), so that takes about a second."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
    }.items():
        monkeypatch.setenv(name, value)
    status, said, run_dir = train_with_mirror("s3://honing-runs/r1", "--resume", "never")

    assert status == 2 and len(said) == 1, said
    assert said[0].startswith(
        "honing: error: checkpoint.mirror_url=s3://honing-runs/r1 cannot be reached "
        "(EndpointConnectionError: Could not connect to the endpoint URL"
    )
    assert said[0].endswith("or leave checkpoint.mirror_url empty to train without a mirror")
    assert not run_dir.exists()
    manager = CheckpointManager(run_dir, keep=1, mirror_url="s3://honing-runs/r1")
    started = time.monotonic()
    with pytest.raises(UserError):
        manager.check_mirror()
    assert time.monotonic() - started < 3.0  # 0.5-0.8 s; 4 s under botocore's default tries
