"""The other processes of a run, as the loop sees them.

The loop runs on one process (rank 0 under torchrun); work that other processes share is
announced to them with ``together(op, payload)`` and runs in its body on this process, in
step with theirs. The ops: ``update`` (the step's update), ``generate`` (a generate call
spread over the ranks) and, when the modules are sharded, ``forward`` (the passes without
gradient), ``sync`` (the new weights to the engines), ``save`` and ``load`` (checkpoints).
Which ops another process takes part in is the peers' business: the loop announces every
one. ``Alone`` is the run without others; ``honing.backends.torchrun.Leader`` is rank 0's
side of several ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from honing.rollout.base import RolloutEngine


class Peers(Protocol):
    def together(self, op: str, payload: Any) -> contextlib.AbstractContextManager: ...

    def tell(self, value: Any) -> None: ...

    def weights_changed(self) -> None: ...

    def spread(self, engine: RolloutEngine) -> RolloutEngine: ...


class Alone:
    """No other process: shared work is this process's alone."""

    @contextlib.contextmanager
    def together(self, op: str, payload: Any) -> Iterator[None]:
        yield

    def tell(self, value: Any) -> None:
        """Within shared work, a value decided on the way (a save's directory): to nobody."""
        return None

    def weights_changed(self) -> None:
        """This process loaded other weights (a resume, a rollback): nobody to tell."""
        return None

    def spread(self, engine: RolloutEngine) -> RolloutEngine:
        """The engine generation uses: ``engine`` itself."""
        return engine
