"""``honing serve`` refuses bad options with one line and status 2, before any server starts."""

import resource
import socket

import pytest

from honing.cli import main

BAD_OPTIONS = [
    (["verifier", "--port", "99999"], "--port: expected 0..65535, got 99999"),
    (["verifier", "--port", "-1"], "--port: expected 0..65535, got -1"),
    (["verifier", "--max-concurrency", "0"], "--max-concurrency: expected >= 1, got 0"),
    (["verifier", "--max-queue", "-1"], "--max-queue: expected >= 0, got -1"),
    (["verifier", "--max-body-mb", "-1"], "--max-body-mb: expected > 0, got -1.0"),
    (["verifier", "--max-body-mb", "0"], "--max-body-mb: expected > 0, got 0.0"),
    (["verifier", "--workers", "-2"], "--workers: expected >= 0, got -2"),
    (["verifier", "--delay-ms", "-5"], "--delay-ms: expected >= 0, got -5.0"),
    (["verifier", "--delay-ms", "inf"], "--delay-ms: expected >= 0, got inf"),
    (["verifier", "--math-timeout-s", "0"], "--math-timeout-s: expected > 0, got 0.0"),
    (["verifier", "--code-timeout-s", "nan"], "--code-timeout-s: expected > 0, got nan"),
    (["verifier", "--header-timeout-s", "0"], "--header-timeout-s: expected > 0, got 0.0"),
    (["verifier", "--max-connections", "0"], "--max-connections: expected >= 1, got 0"),
    (["verifier", "--keep-alive-s", "-1"], "--keep-alive-s: expected > 0, got -1.0"),
    (["reward-model", "--model", "m", "--max-batch", "0"], "--max-batch: expected >= 1, got 0"),
    (
        ["reward-model", "--model", "m", "--max-wait-ms", "-1"],
        "--max-wait-ms: expected >= 0, got -1.0",
    ),
    (["reward-model", "--model", "m", "--max-length", "0"], "--max-length: expected >= 1, got 0"),
    (["reward-model", "--model", "m", "--port", "70000"], "--port: expected 0..65535, got 70000"),
    (["rollout", "--model", "m", "--threads", "-1"], "--threads: expected >= 0, got -1"),
    (["rollout", "--model", "m", "--max-seq-len", "1"], "--max-seq-len: expected >= 2, got 1"),
    (["rollout", "--model", "m", "--spec-tokens", "0"], "--spec-tokens: expected >= 1, got 0"),
    (["rollout", "--model", "m", "--exit-after", "-1"], "--exit-after: expected >= 0, got -1"),
    (["rollout", "--model", "m", "--max-tokens", "0"], "--max-tokens: expected >= 1, got 0"),
    (
        ["rollout", "--model", "m", "--max-sequences", "-1"],
        "--max-sequences: expected >= 1, got -1",
    ),
    (
        ["rollout", "--model", "m", "--max-connections", "-3"],
        "--max-connections: expected >= 1, got -3",
    ),
]


@pytest.fixture
def taken_port():
    """A port something listens on: a bad option that slipped through fails to listen there
    instead of serving for ever."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "message"), BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS]
)
def test_a_bad_number_is_one_line_and_status_2(args, message, taken_port, capsys):
    service, *options = args
    assert main(["serve", service, "--port", str(taken_port), *options]) == 2
    assert capsys.readouterr().err == f"honing: error: {message}\n"


def test_a_port_in_use_is_one_line_and_status_2(taken_port, capsys):
    assert main(["serve", "verifier", "--host", "127.0.0.1", "--port", str(taken_port)]) == 2
    assert capsys.readouterr().err == (
        f"honing: error: --port: 127.0.0.1:{taken_port} is already in use; "
        "choose another port (0: a free one)\n"
    )


def test_more_connections_than_open_files_allowed_is_one_line(taken_port, capsys):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    args = ["serve", "verifier", "--port", str(taken_port), "--max-connections", str(hard)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"honing: error: --max-connections: {hard} connections need ")
    assert err.count("\n") == 1
