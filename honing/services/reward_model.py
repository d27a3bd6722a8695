"""``honing serve reward-model``: a Hugging Face sequence-classification model as a scorer.

Each item's text is its ``prompt`` (or ``extra_info["prompt"]``) followed by its
``response``, the one field an item must have (no ``ground_truth``); the score is the
model's single logit (``num_labels == 1``, the usual reward model), or for a classifier the
probability of its last label. A checkpoint without the weights of every layer (a causal-LM
checkpoint has no reward head, which transformers would start at random) is refused at start
with one line saying what it lacks. Dynamic batching: items of all concurrent requests go to one
queue; a batcher thread takes up to ``max_batch`` of them, waiting at most ``max_wait_ms``
for more once the first arrives, runs one forward pass, and hands each request its scores.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI

from honing.services.app import create_app


class RewardModelScorer:
    """Scores items with a sequence-classification model under dynamic batching.

    Args:
        model_path: a local Hugging Face model directory.
        device: ``cpu``, ``cuda`` or ``auto``.
        max_batch: items per forward pass.
        max_wait_ms: how long a batch waits to fill once its first item arrived.
        max_length: tokens kept per item (truncated from the left, keeping the response end).
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "auto",
        max_batch: int = 32,
        max_wait_ms: float = 5.0,
        max_length: int = 2048,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from honing.errors import ConfigError

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            with _quiet_loading():
                self.model, loaded = AutoModelForSequenceClassification.from_pretrained(
                    model_path, output_loading_info=True
                )
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot load a sequence-classification model from {model_path}: "
                f"{' '.join(str(exc).split())[:300]}"
            ) from None
        _check_complete(model_path, self.model, loaded["missing_keys"])
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.truncation_side = "left"
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval()
        self.device, self.max_batch, self.max_length = device, max_batch, max_length
        self.max_wait_s = max_wait_ms / 1000.0
        self.batch_sizes: list[int] = []  # forward-pass sizes, for tests and /health
        self._queue: queue.Queue[tuple[str, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def score_batch(self, items: list[dict[str, Any]]) -> list[Any]:
        """One ``{"score"}`` per item (or the exception that failed it), in order."""
        futures = []
        for item in items:
            prompt = item.get("prompt") or (item.get("extra_info") or {}).get("prompt") or ""
            future: Future = Future()
            self._queue.put((prompt + item["response"], future))
            futures.append(future)
        out: list[Any] = []
        for future in futures:
            try:
                out.append({"score": future.result()})
            except Exception as exc:  # noqa: BLE001 - the forward pass failed for the batch
                out.append(exc)
        return out

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch:
                try:
                    entry = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if entry is None:  # closing: finish this batch, then stop
                    self._queue.put(None)
                    break
                batch.append(entry)
            self._run(batch)

    def _run(self, batch: list[tuple[str, Future]]) -> None:
        import torch

        texts = [text for text, _ in batch]
        try:
            encoded = self.tokenizer(
                texts,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            with torch.inference_mode():
                logits = self.model(**encoded).logits.float()  # [B, num_labels]
            scores = logits[:, 0] if logits.shape[-1] == 1 else logits.softmax(-1)[:, -1]
            self.batch_sizes.append(len(batch))
            for (_, future), score in zip(batch, scores.tolist(), strict=True):
                future.set_result(score)
        except Exception as exc:  # noqa: BLE001 - every waiting request learns why
            for _, future in batch:
                future.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


def _check_complete(model_path: str, model, missing) -> None:
    """Raises ``ConfigError`` when the checkpoint lacks weights the model needs (a causal-LM
    checkpoint has no reward head): transformers would start them at random, and the service
    would answer random scores."""
    from honing.errors import ConfigError

    if not missing:
        return
    architectures = ", ".join(model.config.architectures or []) or "another kind of model"
    raise ConfigError(
        f"--model: {model_path} has no weights for {', '.join(sorted(missing)[:3])} (the "
        f"reward head would start at random): it was saved as {architectures}. Serve a "
        "sequence-classification reward model (saved from AutoModelForSequenceClassification "
        "with num_labels=1)"
    )


@contextlib.contextmanager
def _quiet_loading():
    """transformers' load report and progress bar off: a missing weight is reported by
    ``_check_complete`` in one line."""
    from transformers.utils import logging

    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()


def reward_model_app(
    model_path: str,
    *,
    device: str = "auto",
    max_batch: int = 32,
    max_wait_ms: float = 5.0,
    max_length: int = 2048,
    **guards: Any,
) -> FastAPI:
    """The reward-model service app; ``guards`` go to ``create_app`` (token, limits)."""
    scorer = RewardModelScorer(
        model_path,
        device=device,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        max_length=max_length,
    )

    def health() -> dict[str, Any]:
        return {
            "model": model_path,
            "device": scorer.device,
            "max_batch": max_batch,
            "forward_passes": len(scorer.batch_sizes),
            "items_scored": sum(scorer.batch_sizes),
        }

    return create_app(
        scorer, service="reward-model", required=("response",), health=health, **guards
    )
