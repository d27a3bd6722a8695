"""Atomic checkpoints with retention: ``CheckpointManager`` over ``RUN_DIR/checkpoints``.

The manager decides where and when a checkpoint directory becomes visible; what goes inside
is written by the caller, so this package imports no torch.
"""

from honing.checkpoint.manager import MARKER, CheckpointManager, read_marker

__all__ = ["MARKER", "CheckpointManager", "read_marker"]
