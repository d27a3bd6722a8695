"""How an ``OpenAIEngine`` gets new policy weights to its servers: one class per
``rollout.weight_sync``, behind one interface.

``send(endpoints, version, weights)`` sends ``weights`` as ``version`` to each endpoint given
(the engine leaves out those set aside) and returns the ones that failed, with their errors;
each endpoint that took them records ``version``. ``catch_up(endpoint)`` brings a server
that comes back holding other weights to the newest version sent, before it serves a request;
False when the sender cannot (the server then waits for the next sync).

- ``none``: sends nothing (the servers get their weights some other way); only the version
  moves.
- ``tensors``: honing's server: the weights as a safetensors body to
  ``POST /update_weights?version=V``.
- ``disk``: writes the weights (with ``model_dir``'s config and tokenizer files) to
  ``weight_dir/v<version>`` and posts ``{"model_path", "version"}`` to
  ``/update_weights_from_disk`` (SGLang's endpoint; honing's server has it too).
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from honing.rollout.base import WeightPieces, weight_items
from honing.rollout.openai_http import Endpoint, Retryable

# (endpoint, path, **httpx request arguments) -> the JSON answer; raises Retryable
Post = Callable[..., dict]
Failures = list[tuple[Endpoint, str]]


class WeightSender(ABC):
    """Sends an ``OpenAIEngine``'s new weights to its servers (see the module)."""

    def __init__(self, post: Post) -> None:
        self.post = post

    @abstractmethod
    def send(self, endpoints: list[Endpoint], version: int, weights: WeightPieces) -> Failures:
        """Sends ``weights`` as ``version`` to each of ``endpoints``; returns those that
        failed with a retryable error, with it."""

    @abstractmethod
    def catch_up(self, endpoint: Endpoint) -> bool:
        """Sends ``endpoint`` the newest weights sent, unless it has them; False when they
        cannot be sent again.

        Raises:
            Retryable: the endpoint failed again.
        """

    def _to_each(self, endpoints: list[Endpoint], version: int, send_one) -> Failures:
        failures = []
        for endpoint in endpoints:
            try:
                send_one(endpoint)
            except Retryable as err:
                failures.append((endpoint, str(err)))
                continue
            endpoint.version = version
        return failures


class NoSender(WeightSender):
    """``none``: the servers' weights come from elsewhere; every endpoint takes the version."""

    def __init__(self, post: Post) -> None:
        super().__init__(post)
        self.newest = 0

    def send(self, endpoints: list[Endpoint], version: int, weights: WeightPieces) -> Failures:
        self.newest = version
        return self._to_each(endpoints, version, lambda endpoint: None)

    def catch_up(self, endpoint: Endpoint) -> bool:
        endpoint.version = self.newest
        return True


class _KeepsNewest(WeightSender):
    """A sender that keeps what it sent last (``_latest``: version first) and sends it again
    to a server that comes back (``_post_latest``)."""

    _latest: tuple | None = None

    def catch_up(self, endpoint: Endpoint) -> bool:
        if self._latest is None:
            return False
        if endpoint.version != self._latest[0]:
            self._post_latest(endpoint)
            endpoint.version = self._latest[0]
        return True

    @abstractmethod
    def _post_latest(self, endpoint: Endpoint) -> None: ...


class TensorSender(_KeepsNewest):
    """``tensors``: a safetensors body to ``/update_weights`` (honing's server); the newest
    body is kept for a server that comes back."""

    def __init__(self, post: Post) -> None:
        super().__init__(post)
        self._latest: tuple[int, bytes] | None = None

    def send(self, endpoints: list[Endpoint], version: int, weights: WeightPieces) -> Failures:
        from safetensors.torch import save

        self._latest = (version, save(unshared(weight_items(weights))))
        return self._to_each(endpoints, version, self._post_latest)

    def _post_latest(self, endpoint: Endpoint) -> None:
        version, body = self._latest
        self.post(endpoint, f"/update_weights?version={version}", content=body)


class DiskSender(_KeepsNewest):
    """``disk``: a model directory per version under ``weight_dir``, its path posted to
    ``/update_weights_from_disk``; the newest directory stays (a server that comes back loads
    it), older ones are removed once the live servers have the newest."""

    def __init__(self, post: Post, weight_dir: str, model_dir: str) -> None:
        super().__init__(post)
        self.weight_dir, self.model_dir = Path(weight_dir), model_dir
        self._latest: tuple[int, Path] | None = None

    def send(self, endpoints: list[Endpoint], version: int, weights: WeightPieces) -> Failures:
        self._latest = (version, self._write(version, unshared(weight_items(weights))))
        failures = self._to_each(endpoints, version, self._post_latest)
        if len(failures) < len(endpoints):
            current = self._latest[1]
            for old in current.parent.glob("v*"):  # the live servers have the new one
                if old != current and old.name[1:].isdigit():
                    shutil.rmtree(old, ignore_errors=True)
        return failures

    def _post_latest(self, endpoint: Endpoint) -> None:
        version, path = self._latest
        body = {"model_path": str(path), "version": version}
        self.post(endpoint, "/update_weights_from_disk", json=body)

    def _write(self, version: int, tensors: dict) -> Path:
        """``weight_dir/v<version>``: the weights and the model's other files, complete
        before it takes its name."""
        from safetensors.torch import save_file

        final, partial = self.weight_dir / f"v{version}", self.weight_dir / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        if self.model_dir:
            for item in Path(self.model_dir).iterdir():
                if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".pt")):
                    shutil.copy2(item, partial / item.name)
        save_file(tensors, partial / "model.safetensors")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        return final


def make_sender(weight_sync: str, post: Post, weight_dir: str = "", model_dir: str = ""):
    """The sender of ``rollout.weight_sync`` (``tensors``, ``disk`` or ``none``)."""
    if weight_sync == "disk":
        return DiskSender(post, weight_dir, model_dir)
    if weight_sync == "none":
        return NoSender(post)
    return TensorSender(post)


def unshared(pieces) -> dict:
    """The tensors on the CPU, one name per storage: tied weights (an embedding shared with the
    output head) are sent once; the server's own tie carries them to the other name."""
    tensors, seen = {}, set()
    for name, tensor in pieces:
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().contiguous().cpu()
    return tensors
