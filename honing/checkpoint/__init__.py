"""Atomic, verified checkpoints with retention and a mirror: ``CheckpointManager``.

The manager decides where and when a checkpoint directory becomes visible and whether it is
intact (``manifest.json``); what goes inside is written by the caller, so this package
imports no torch.
"""

from honing.checkpoint.manager import (
    MARKER,
    CheckpointManager,
    CheckpointSaveError,
    read_marker,
)
from honing.checkpoint.manifest import MANIFEST, verify

__all__ = [
    "MANIFEST",
    "MARKER",
    "CheckpointManager",
    "CheckpointSaveError",
    "read_marker",
    "verify",
]
