"""An endless, resumable stream of prompt batches over a fixed list of prompts.

Epoch ``e`` visits every prompt once, in an order shuffled by ``random.Random(f"{seed}:{e}")``
(independent of any global random state). A batch that reaches the end of an epoch is
filled from the start of the next one, so no prompt is dropped and every batch is full
(such a batch may meet a prompt of the old epoch again in the new one). A batch larger than
the dataset is refused: every batch would hold prompts twice (verl's loader, which drops an
incomplete batch, has no batch at all then). The cursor (epoch, position) is the state, so a
source restored with ``load_state_dict`` yields exactly the batches the uninterrupted one
would have; a cursor may also list prompts drawn and not trained (partial rollouts), which
the restored source serves first. With ``solve_rates`` (``data/solve_rates.py``) a prompt a
skip rule names is passed over where its turn comes (the epoch's next prompt takes its
place), and the counts behind the rules travel with the cursor.
"""

from __future__ import annotations

import random
from typing import Any

from honing.data.solve_rates import SolveRates
from honing.errors import DataError
from honing.types import Prompt


class PromptSource:
    """Serves batches of prompts, epoch after epoch.

    Args:
        prompts: the dataset; must not be empty.
        batch_size: prompts per batch (``rollout.batch_size``), at most ``len(prompts)``.
        seed: shuffling seed (``trainer.seed``).
        shuffle: ``False`` keeps file order in every epoch.
        solve_rates: the prompts' solve rates and skip rules (none: every prompt served).
    """

    def __init__(
        self,
        prompts: list[Prompt],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        solve_rates: SolveRates | None = None,
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
        self.solve_rates = solve_rates
        self._passed = 0  # prompts passed over in a row by the skip rules

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
            prompt = self._prompts[self._order[self._position]]
            self._position += 1
            if not self._passed_over(prompt):
                batch.append(prompt)
        return batch

    def _passed_over(self, prompt: Prompt) -> bool:
        """Whether a skip rule passes ``prompt`` over now (counted by its reason).

        Raises:
            DataError: the rules pass over every prompt, so no batch can be filled.
        """
        rates = self.solve_rates
        reason = rates.reason(prompt.id) if rates is not None else None
        if reason is None:
            self._passed = 0
            return False
        rates.skipped(reason)
        self._passed += 1
        if self._passed >= len(self._prompts):
            counts = rates.take_metrics()
            raise DataError(
                f"every one of the {len(self._prompts)} training prompts is skipped "
                f"({counts['data/prompts_solved']:.0f} always solved, "
                f"{counts['data/prompts_unsolved']:.0f} never): set data.skip_solved / "
                "data.skip_unsolved to false, raise data.solve_rate_min_samples, or add prompts"
            )
        return True

    def state_dict(self, requeue: list[Prompt] = ()) -> dict[str, Any]:
        """The cursor, JSON-serialisable: ``{"epoch", "position", "num_prompts"}``,
        ``requeue``: prompts drawn already that a resumed source serves again first (by
        index), with any still waiting, and under a skip rule ``solve_rates``: each prompt's
        solved and scored samples by id."""
        state = {
            "epoch": self._epoch,
            "position": self._position,
            "num_prompts": len(self._prompts),
        }
        indices = [self._index[p.id] for p in requeue] + self._requeued
        if self.solve_rates is not None and self.solve_rates.active:
            state["solve_rates"] = self.solve_rates.state_dict()
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
        if self.solve_rates is not None:
            self.solve_rates.load_state_dict(state.get("solve_rates", {}))

    def _start_epoch(self, epoch: int, position: int) -> None:
        self._epoch = epoch
        self._position = position
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self._shuffle:
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order
