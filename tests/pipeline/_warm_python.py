"""A stand-in "python" for the supervisor's children: ``python -m MODULE ARGS`` started warm
(``tests/warm.py``), so a test of ``--max-restarts`` does not pay a fresh interpreter's
imports per child."""

import shlex
from pathlib import Path

from tests import warm


def warm_python(folder: Path) -> str:
    """Writes the stand-in into ``folder`` and returns its path (``supervise(python=...)``)."""
    shim = Path(folder) / "python"
    prefix = shlex.join(warm.command("honing.cli")[:-1])  # the client, without the module
    shim.write_text(f'#!/bin/sh\n# python -m MODULE ARGS, warm\nshift\nexec {prefix} "$@"\n')
    shim.chmod(0o755)
    return str(shim)
