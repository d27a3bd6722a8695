"""The uvicorn that ``honing.services.server`` builds on: its private ``H11Protocol`` is
checked when the module loads, and a uvicorn without it is one line, not a traceback."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from honing.errors import UserError
from honing.services import server

ROOT = Path(__file__).resolve().parents[2]


def _refusal(missing: str) -> str:
    return (
        f"honing's services need uvicorn{server.UVICORN_VERSIONS}: uvicorn {uvicorn.__version__} "
        f"lacks {missing}, a private API of uvicorn that honing.services.server builds on; "
        f"install 'uvicorn{server.UVICORN_VERSIONS}'"
    )


def test_the_installed_uvicorn_passes_and_pyproject_pins_the_range_checked():
    server.check_uvicorn()
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"uvicorn{server.UVICORN_VERSIONS}" in dependencies


class _Bare:
    """An H11Protocol as a later uvicorn might have it: the methods, not the h11 state."""

    def __init__(self, config, server_state, app_state, _loop=None):
        self.parser = None

    connection_made = data_received = eof_received = connection_lost = H11Protocol.connection_made
    pause_writing = resume_writing = H11Protocol.pause_writing


@pytest.mark.parametrize(
    ("patch", "missing"),
    [
        (lambda mp: mp.setattr(server, "H11Protocol", None), "H11Protocol"),
        (lambda mp: mp.delattr(H11Protocol, "eof_received"), "H11Protocol.eof_received"),
        (lambda mp: mp.setattr(server, "H11Protocol", _Bare), "H11Protocol.conn"),
        (lambda mp: mp.setattr(server, "ServerState", None), "ServerState"),
    ],
    ids=["no H11Protocol", "no eof_received", "no conn", "no ServerState"],
)
def test_a_uvicorn_without_what_the_guards_use_is_refused_naming_it(monkeypatch, patch, missing):
    patch(monkeypatch)
    with pytest.raises(UserError) as refused:
        server.check_uvicorn()
    assert str(refused.value) == _refusal(missing)


def test_honing_serve_on_such_a_uvicorn_is_one_line_and_status_2():
    program = (
        "import sys, uvicorn.protocols.http.h11_impl as h11_impl\n"
        "del h11_impl.H11Protocol\n"
        "from honing import cli\n"
        "sys.exit(cli.main(['serve', 'verifier', '--port', '0']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"honing: error: {_refusal('H11Protocol')}\n"
