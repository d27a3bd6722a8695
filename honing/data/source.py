"""An endless, resumable stream of prompt batches over a fixed list of prompts.

Epoch ``e`` visits every prompt once, in an order shuffled by ``random.Random(f"{seed}:{e}")``
(independent of any global random state). A batch that reaches the end of an epoch is
filled from the start of the next one, so no prompt is dropped and every batch is full
(such a batch may meet a prompt of the old epoch again in the new one). A batch larger than
the dataset is refused: every batch would hold prompts twice (verl's loader, which drops an
incomplete batch, has no batch at all then). The cursor (epoch, position) is the state, so a
source restored with ``load_state_dict`` yields exactly the batches the uninterrupted one
would have; a cursor may also list prompts drawn and not trained (partial rollouts), which
the restored source serves first.
"""

from __future__ import annotations

import random
from typing import Any

from honing.errors import DataError
from honing.types import Prompt


class PromptSource:
    """Serves batches of prompts, epoch after epoch.

    Args:
        prompts: the dataset; must not be empty.
        batch_size: prompts per batch (``rollout.batch_size``), at most ``len(prompts)``.
        seed: shuffling seed (``trainer.seed``).
        shuffle: ``False`` keeps file order in every epoch.
    """

    def __init__(
        self, prompts: list[Prompt], batch_size: int, *, seed: int, shuffle: bool = True
    ) -> None:
        if not prompts:
            raise DataError("no prompts to train on; expected at least one row in data files")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > len(prompts):
            raise DataError(
                f"rollout.batch_size={batch_size} is more than the {len(prompts)} training "
                "prompts, so a batch would hold a prompt twice; lower rollout.batch_size or "
                "add training data"
            )
        self._prompts = list(prompts)
        self._batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)
        self._index = {prompt.id: i for i, prompt in enumerate(self._prompts)}
        self._requeued: list[int] = []  # drawn before a resume, not trained: served first

    @property
    def epoch(self) -> int:
        """The 0-based epoch of the last prompt served (0 before the first batch)."""
        return self._epoch

    def next_batch(self, size: int | None = None) -> list[Prompt]:
        """The next ``size`` prompts (``batch_size`` by default), continuing into the next
        epoch when needed; prompts requeued by ``load_state_dict`` come first."""
        size = self._batch_size if size is None else size
        batch = [self._prompts[i] for i in self._requeued[:size]]
        del self._requeued[:size]
        while len(batch) < size:
            if self._position == len(self._prompts):
                self._start_epoch(self._epoch + 1, 0)
            take = min(size - len(batch), len(self._prompts) - self._position)
            indices = self._order[self._position : self._position + take]
            batch.extend(self._prompts[index] for index in indices)
            self._position += take
        return batch

    def state_dict(self, requeue: list[Prompt] = ()) -> dict[str, Any]:
        """The cursor, JSON-serialisable: ``{"epoch", "position", "num_prompts"}``, and
        ``requeue``: prompts drawn already that a resumed source serves again first (by
        index), with any still waiting."""
        state = {
            "epoch": self._epoch,
            "position": self._position,
            "num_prompts": len(self._prompts),
        }
        indices = [self._index[p.id] for p in requeue] + self._requeued
        return state | ({"requeue": indices} if indices else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by ``state_dict``.

        Raises:
            DataError: the cursor was saved for a dataset of a different size, so resuming
                would silently serve different prompts.
        """
        saved = state.get("num_prompts", len(self._prompts))
        if saved != len(self._prompts):
            raise DataError(
                f"the checkpoint's data cursor was saved for {saved} prompts but the data "
                f"files now give {len(self._prompts)}; expected the same data.train_files"
            )
        position = int(state["position"])
        if not 0 <= position <= len(self._prompts):
            raise DataError(f"the checkpoint's data cursor position {position} is out of range")
        self._start_epoch(int(state["epoch"]), position)
        requeued = [int(i) for i in state.get("requeue", [])]
        if any(not 0 <= i < len(self._prompts) for i in requeued):
            raise DataError("the checkpoint's data cursor requeues prompts out of range")
        self._requeued = requeued

    def _start_epoch(self, epoch: int, position: int) -> None:
        self._epoch = epoch
        self._position = position
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self._shuffle:
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order
