"""How an ``OpenAIEngine`` gets new policy weights to its servers: one class per
``rollout.weight_sync``, behind one interface.

``send(endpoints, version, weights)`` sends ``weights`` (buckets of (name, tensor) pieces,
consumed once) as ``version`` to each endpoint given (the engine leaves out those set aside)
and returns the ones that failed, with their errors; each endpoint that took them records
``version``. ``catch_up(endpoint)`` brings a server that comes back holding other weights to
the newest version sent, before it serves a request; False when the sender cannot (the
server then waits for the next sync).

- ``none``: sends nothing (the servers get their weights some other way); only the version
  moves.
- ``tensors``: honing's server: each bucket, as it comes, a safetensors body to
  ``POST /update_weights/bucket`` on every endpoint still taking the update, then
  ``POST /update_weights/commit`` on each (the server applies the update only then). One
  bucket is held at a time (its host copy and its body); nothing of the model is kept, so a
  server that comes back is sent the weights made again (``WeightStream.again``) when the
  engine was given a way to, else it waits for the next sync.
- ``disk``: writes the weights bucket by bucket as safetensors shards with their index
  (``model.safetensors.index.json``, and ``model_dir``'s config and tokenizer files) to
  ``weight_dir/v<version>`` and posts ``{"model_path", "version"}`` to
  ``/update_weights_from_disk`` (SGLang's endpoint; honing's server has it too); a server that
  comes back loads the newest directory.

Tied weights (an embedding shared with the output head) go once per update, under the first
name; the server's own tie carries them to the other.

``hold(endpoint, trainer)`` has a server take weights from this trainer alone
(``honing.rollout.remote.hold``): honing's server through ``POST /update_weights/hold``
(``tensors`` and ``disk``; a server without it, as SGLang, is not held); ``none`` holds
nothing.
"""

from __future__ import annotations

import json
import shutil
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path

from honing.errors import UserError
from honing.rollout.base import WeightBucket, WeightBuckets, WeightStream
from honing.rollout.remote.http import Endpoint, EngineRequestError, Retryable

# (endpoint, path, **httpx request arguments) -> the JSON answer; raises Retryable
Post = Callable[..., dict]
Failures = list[tuple[Endpoint, str]]
INDEX = "model.safetensors.index.json"


class WeightSender(ABC):
    """Sends an ``OpenAIEngine``'s new weights to its servers (see the module)."""

    def __init__(self, post: Post) -> None:
        self.post = post

    @abstractmethod
    def send(self, endpoints: list[Endpoint], version: int, weights: WeightBuckets) -> Failures:
        """Sends ``weights`` as ``version`` to each of ``endpoints``; returns those that
        failed with a retryable error, with it."""

    @abstractmethod
    def catch_up(self, endpoint: Endpoint) -> bool:
        """Sends ``endpoint`` the newest weights sent, unless it has them (or none were sent);
        False when they cannot be sent again.

        Raises:
            Retryable: the endpoint failed again.
        """

    def hold(self, endpoint: Endpoint, trainer: str) -> bool:
        """Has ``endpoint`` take weights from ``trainer`` alone (or renews that); False
        where the server keeps no such hold.

        Raises:
            EngineRequestError: the server holds to another trainer (HTTP 409).
            Retryable: the server failed.
        """
        return False

    def renew(self, endpoint: Endpoint, trainer: str) -> None:
        """``hold`` again, from the thread that keeps the holds (``hold.Keeper``)."""
        self.hold(endpoint, trainer)

    def release(self, endpoint: Endpoint, trainer: str) -> None:
        """``endpoint`` no longer holds to ``trainer`` (its engine closes)."""
        return None

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

    def send(self, endpoints: list[Endpoint], version: int, weights: WeightBuckets) -> Failures:
        self.newest = version
        return self._to_each(endpoints, version, lambda endpoint: None)

    def catch_up(self, endpoint: Endpoint) -> bool:
        endpoint.version = self.newest
        return True


class _HeldOverHTTP(WeightSender):
    """The hold of ``honing serve rollout``: ``POST /update_weights/hold`` and
    ``/update_weights/release``, the trainer named in the engine's ``X-Honing-Trainer``
    header."""

    def hold(self, endpoint: Endpoint, trainer: str) -> bool:
        try:
            self.post(endpoint, "/update_weights/hold")
        except EngineRequestError as err:
            if err.status in (404, 405):  # a server that keeps no hold (SGLang)
                return False
            raise
        return True

    def release(self, endpoint: Endpoint, trainer: str) -> None:
        self.post(endpoint, "/update_weights/release")


class TensorSender(_HeldOverHTTP):
    """``tensors``: each bucket posted as it comes to honing's server, then a commit (see
    the module)."""

    def __init__(self, post: Post) -> None:
        super().__init__(post)
        self.newest: int | None = None
        self._again: Callable[[], WeightBuckets] | None = None

    def send(self, endpoints: list[Endpoint], version: int, weights: WeightBuckets) -> Failures:
        self._again = None  # the last version's way: not these weights
        failures = self._stream(endpoints, version, weights)
        self.newest = version
        self._again = weights.again if isinstance(weights, WeightStream) else None
        return failures

    def catch_up(self, endpoint: Endpoint) -> bool:
        if self.newest is None or endpoint.version == self.newest:
            return True  # nothing sent yet, or it has them
        if self._again is None:
            return False
        failures = self._stream([endpoint], self.newest, self._again())
        if failures:
            raise Retryable(failures[0][1])
        return True

    def _stream(self, endpoints: list[Endpoint], version: int, weights: WeightBuckets):
        upload, untied = _Upload(self.post, endpoints), _Untied()
        for bucket in weights:  # every bucket is read, also when no server is left
            upload.bucket(untied.tensors(bucket))
            del bucket  # let go before the next is made
        return upload.commit(version)


class _Upload:
    """One update streamed to several servers: each bucket to every server still taking it,
    then the commit on each. A server that fails is left out of the rest; one that refuses
    the update (4xx) stops it everywhere: nothing is committed and the refusal is raised
    once every bucket was read (under a sharded layout the other ranks gather with them)."""

    def __init__(self, post: Post, endpoints: list[Endpoint]) -> None:
        self.post, self.live, self.failures = post, list(endpoints), []
        self.update, self.parts = uuid.uuid4().hex, 0
        self.refused: EngineRequestError | None = None

    def bucket(self, tensors: dict) -> None:
        from safetensors.torch import save

        if not tensors or self.refused is not None:
            return
        body = save(tensors)
        del tensors  # the host copies go: the body alone is held while it is posted
        path = f"/update_weights/bucket?update={self.update}&part={self.parts}"
        headers = {"Content-Length": str(len(body))}
        for endpoint in list(self.live):
            self._try(endpoint, path, content=_once(body), headers=headers)
        self.parts += 1

    def commit(self, version: int) -> Failures:
        if self.refused is not None:
            raise self.refused
        path = f"/update_weights/commit?update={self.update}&parts={self.parts}&version={version}"
        for endpoint in list(self.live):
            if self._try(endpoint, path):
                endpoint.version = version
        if self.refused is not None:
            raise self.refused
        return self.failures

    def _try(self, endpoint: Endpoint, path: str, **kwargs) -> bool:
        try:
            self.post(endpoint, path, **kwargs)
            return True
        except Retryable as err:
            self.failures.append((endpoint, str(err)))
        except EngineRequestError as err:
            self.refused = self.refused or err
        self.live.remove(endpoint)
        return False


def drain(stream: Iterator) -> None:
    """Reads the buckets left of a sync that failed: under a sharded layout each is a gather
    every rank takes part in."""
    for bucket in stream:
        del bucket


def _once(body: bytes) -> Iterator[bytes]:
    """``body`` as a request's content that lets go of it once sent: httpx keeps a request's
    content in a reference cycle with its response, which only the garbage collector frees
    (bytes given as they are would stay until then, bucket after bucket)."""
    yield body


class DiskSender(_HeldOverHTTP):
    """``disk``: a model directory per version under ``weight_dir``, its path posted to
    ``/update_weights_from_disk``; the newest directory stays (a server that comes back loads
    it), older ones are removed once the live servers have the newest."""

    def __init__(self, post: Post, weight_dir: str, model_dir: str) -> None:
        super().__init__(post)
        self.weight_dir, self.model_dir = Path(weight_dir), model_dir
        self._latest: tuple[int, Path] | None = None

    def send(self, endpoints: list[Endpoint], version: int, weights: WeightBuckets) -> Failures:
        self._latest = (version, self._write(version, weights))
        failures = self._to_each(endpoints, version, self._post_latest)
        if len(failures) < len(endpoints):
            current = self._latest[1]
            for old in current.parent.glob("v*"):  # the live servers have the new one
                if old != current and old.name[1:].isdigit():
                    shutil.rmtree(old, ignore_errors=True)
        return failures

    def catch_up(self, endpoint: Endpoint) -> bool:
        if self._latest is None:
            return True  # nothing sent yet
        if endpoint.version != self._latest[0]:
            self._post_latest(endpoint)
            endpoint.version = self._latest[0]
        return True

    def _post_latest(self, endpoint: Endpoint) -> None:
        version, path = self._latest
        body = {"model_path": str(path), "version": version}
        self.post(endpoint, "/update_weights_from_disk", json=body)

    def _write(self, version: int, weights: WeightBuckets) -> Path:
        """``weight_dir/v<version>``: a shard per bucket, their index and the model's other
        files, complete before it takes its name."""
        final, partial = self.weight_dir / f"v{version}", self.weight_dir / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        if self.model_dir:
            for item in Path(self.model_dir).iterdir():
                weights_file = item.name.endswith((".safetensors", ".bin", ".pt", ".index.json"))
                if item.is_file() and not weights_file:
                    shutil.copy2(item, partial / item.name)
        index, untied, stream = _Index(partial), _Untied(), iter(weights)
        try:
            for bucket in stream:
                index.shard(untied.tensors(bucket))
                del bucket  # let go before the next is made
            index.write()
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
        except OSError as err:  # a full disk: the servers keep the weights they have
            shutil.rmtree(partial, ignore_errors=True)
            drain(stream)
            raise UserError(
                f"rollout.weight_dir: cannot write the weights to {self.weight_dir} "
                f"({err.strerror or err}); the servers keep the weights they have. Make room "
                "there, or set rollout.weight_dir to a directory with room that they read"
            ) from None
        return final


class _Index:
    """Safetensors shards written one at a time into ``directory``, and their index (the
    Hugging Face layout: ``weight_map`` from each name to its shard)."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.weight_map, self.total = directory, {}, 0

    def shard(self, tensors: dict) -> None:
        from safetensors.torch import save_file

        if not tensors:
            return
        name = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        save_file(tensors, self.directory / name)
        for key, tensor in tensors.items():
            self.weight_map[key] = name
            self.total += tensor.numel() * tensor.element_size()

    def write(self) -> None:
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.directory / INDEX).write_text(json.dumps(index, indent=1))


class _Untied:
    """A bucket's tensors on the CPU, contiguous, each storage once per update: a tensor
    that shares the storage of one already taken (a tied weight) is left out. A storage is
    known by a weak reference to the tensor that had it: the memory of a tensor made for the
    stream and freed since may hold a later one, which is no tie."""

    def __init__(self) -> None:
        self.seen: dict[tuple, weakref.ref] = {}

    def tensors(self, bucket: WeightBucket) -> dict:
        taken = {}
        for name, tensor in bucket:
            storage = tensor.untyped_storage().data_ptr()
            key = (tensor.device, storage, tensor.storage_offset(), tensor.shape, tensor.dtype)
            earlier = self.seen.get(key)
            if earlier is not None and earlier() is not None:
                continue
            self.seen[key] = weakref.ref(tensor)
            taken[name] = tensor.detach().contiguous().cpu()
        return taken


def make_sender(weight_sync: str, post: Post, weight_dir: str = "", model_dir: str = ""):
    """The sender of ``rollout.weight_sync`` (``tensors``, ``disk`` or ``none``)."""
    if weight_sync == "disk":
        return DiskSender(post, weight_dir, model_dir)
    if weight_sync == "none":
        return NoSender(post)
    return TensorSender(post)
