"""Telling a save that failed for want of room from one that failed on a bug.

A full disk shows up as an ``OSError`` (``ENOSPC``, ``EDQUOT``) from Python's own writes, but
torch's serialization writer reports it as a ``RuntimeError`` naming no errno (measured on a
full tmpfs: ``basic_ios::clear: iostream error``, then ``[enforce fail at inline_container.cc]
... unexpected pos``), and safetensors' writer as a ``SafetensorError`` (an ``Exception``)
whose text carries the OS's message: ``I/O error: No space left on device (os error 28)``.
These helpers read the exception chain for all three.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

FULL_BELOW = 1 << 20  # free bytes under which a failed save is put down to a full disk
TORCH_WRITE_HINTS = ("inline_container", "iostream error", "PytorchStreamWriter", "No space")
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how writers that wrap the OS's error in their own type (safetensors, Rust's io::Error) say it
NO_SPACE_TEXTS = tuple(os.strerror(code) for code in NO_SPACE_ERRNOS) + tuple(
    f"(os error {code})" for code in NO_SPACE_ERRNOS
)
OS_ERROR_TEXTS = ("I/O error", "(os error ")


def _chain(err: BaseException):
    seen: BaseException | None = err
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def is_write_failure(err: BaseException) -> bool:
    """Whether a save failed for want of room or on the filesystem rather than from a bug in
    the writer.

    An ``OSError`` anywhere in the exception's chain counts; so do the ``RuntimeError``s
    torch's writer raises on a full disk, which name no errno, and any error whose text
    carries the OS's own (safetensors: ``I/O error: ... (os error 28)``).
    """
    for seen in _chain(err):
        if isinstance(seen, OSError) or _no_space(seen):
            return True
        text = str(seen)
        if isinstance(seen, RuntimeError) and any(hint in text for hint in TORCH_WRITE_HINTS):
            return True
        if any(hint in text for hint in OS_ERROR_TEXTS):
            return True
    return False


def says_no_space(err: BaseException) -> bool:
    """Whether the exception's chain holds an ENOSPC or EDQUOT (quota) error, as an
    ``OSError`` or in the text of a writer's own error type."""
    return any(_no_space(seen) for seen in _chain(err))


def _no_space(err: BaseException) -> bool:
    """Whether this one exception (not its chain) says the disk or quota is full."""
    if isinstance(err, OSError) and err.errno in NO_SPACE_ERRNOS:
        return True
    return any(text in str(err) for text in NO_SPACE_TEXTS)


def free_bytes(path: Path) -> int | None:
    """Bytes free on the filesystem holding ``path``; ``None`` when it cannot be read."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def nearest_existing(path: Path) -> Path:
    """``path`` made absolute, or its nearest ancestor that exists (``/`` at worst)."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it is missing)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
