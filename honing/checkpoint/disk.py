"""Telling a save that failed for want of room from one that failed on a bug.

A full disk shows up as an ``OSError`` (``ENOSPC``, ``EDQUOT``) from Python's own writes, but
torch's serialization writer reports it as a ``RuntimeError`` naming no errno (measured on a
full tmpfs: ``basic_ios::clear: iostream error``, then ``[enforce fail at inline_container.cc]
... unexpected pos``). These helpers read the exception chain for both.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

FULL_BELOW = 1 << 20  # free bytes under which a failed save is put down to a full disk
TORCH_WRITE_HINTS = ("inline_container", "iostream error", "PytorchStreamWriter", "No space")


def is_write_failure(err: BaseException) -> bool:
    """Whether a save failed for want of room rather than from a bug in the writer.

    An ``OSError`` anywhere in the exception's chain counts, and so do the ``RuntimeError``s
    torch's writer raises on a full disk, which name no errno (measured on a full tmpfs:
    ``basic_ios::clear: iostream error``, then ``[enforce fail at inline_container.cc] ...
    unexpected pos``).
    """
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError):
            return True
        text = str(seen)
        if isinstance(seen, RuntimeError) and any(hint in text for hint in TORCH_WRITE_HINTS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def says_no_space(err: BaseException) -> bool:
    """Whether the exception's chain holds an ENOSPC or EDQUOT (quota) error."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def free_bytes(path: Path) -> int | None:
    """Bytes free on the filesystem holding ``path``; ``None`` when it cannot be read."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
