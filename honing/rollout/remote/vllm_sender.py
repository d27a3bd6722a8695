"""``rollout.weight_sync=vllm``: new weights to vLLM servers through vLLM's RL API.

Each sync, on every server: ``POST /pause?mode=wait`` (requests in flight finish on the
weights they started with), ``/start_weight_update``, one ``/update_weights`` per bucket,
``/finish_weight_update`` with the version (``GET /weight_info`` then says it), ``/resume``.
How a bucket travels is the server's weight-transfer backend (its ``--weight-transfer-config``,
read from ``GET /server_info``):

- ``honing`` (any device, CPUs included): the bucket as a safetensors file in ``bucket_dir``
  (``/dev/shm`` by default, or ``rollout.weight_dir``: a directory the server sees), named in
  ``{"path": ...}``; the server's worker loads it and deletes it
  (``honing.rollout.vllm.weights``, ``honing.rollout.vllm.transfer``).
- ``nccl`` (CUDA on both sides): vLLM's own engine. The first sync opens an NCCL group with
  the server's workers (this process as rank 0, on an address that routes to the server and
  a free port); each bucket's names, dtypes and shapes go in ``/update_weights`` while its
  tensors are broadcast, one by one, from this process's GPU.

A server that fails on the way is left out of the rest of the sync and reported (the engine
sets it aside); a restarted one holds its own weights again and is sent the newest before it
serves (``catch_up``), when the weights can be made again (``WeightStream.again``).

A sync that fails on this side (a bucket file that cannot be written: a full disk; an error
while making a bucket) never leaves a server in the middle of an update. The first bucket's
file is written before any server is paused, so a directory without room ends the sync with
every server as it was. Past that, the update is abandoned on each server (``_abandon``):
honing's backend puts back every layer still waiting for tensors; a server whose model is then
as before serves its old weights again, one where layers had got all theirs (and hold them:
vLLM's reload cannot put them back) is left paused with its version marked ``INCOMPLETE``: it
needs a restart. A bucket that cannot be written ends the run with one line naming the directory,
the cause and what each server holds.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from honing.errors import UserError
from honing.rollout.base import WeightBuckets, WeightStream
from honing.rollout.remote.hold import HELD
from honing.rollout.remote.http import Endpoint, EngineRequestError, Retryable
from honing.rollout.remote.senders import Failures, Post, WeightSender, _Untied, drain
from honing.rollout.remote.vllm_checks import INCOMPLETE, transfer_backend
from honing.rollout.vllm.weights import LACKS, PART_NEW, WONT_FIT, write_bucket

SHARED_MEMORY = "/dev/shm"
# For the calls whose refusal is a worker's error: vLLM's server answers it with HTTP 500,
# then closes the connection, which the client would otherwise try to use again.
ONE_REQUEST = {"Connection": "close"}


class VLLMWeightSender(WeightSender):
    """Sends weight buckets to vLLM servers (see the module).

    Args:
        post, get: the engine's requests (``(endpoint, path, **httpx arguments)`` -> the JSON
            answer; ``Retryable`` when the server fails).
        bucket_dir: where bucket files go for the ``honing`` backend.
    """

    def __init__(self, post: Post, get: Callable[..., dict], bucket_dir: str = "") -> None:
        super().__init__(post)
        self.get = get
        self.bucket_dir = Path(bucket_dir or SHARED_MEMORY)
        self.weight_dir_set = bool(bucket_dir)
        self._channels: dict[str, _Files | _Nccl] = {}  # by endpoint URL, opened on first use
        self._newest: tuple[int, Callable | None] | None = None
        self._names = itertools.count()

    def send(self, endpoints: list[Endpoint], version: int, weights: WeightBuckets) -> Failures:
        self._newest = (version, weights.again if isinstance(weights, WeightStream) else None)
        return self._send(endpoints, version, weights)

    def catch_up(self, endpoint: Endpoint) -> bool:
        """The newest weights again to ``endpoint`` unless ``GET /weight_info`` says it has
        them; True without a word when none were sent (it holds ``model.path``'s, version 0)."""
        if self._newest is None:
            endpoint.version = 0
            return True
        version, again = self._newest
        if self.get(endpoint, "/weight_info").get("weight_version") == str(version):
            endpoint.version = version
            return True
        if again is None:
            return False
        failures = self._send([endpoint], version, again())
        if failures:
            raise Retryable(failures[0][1])
        return True

    def hold(self, endpoint: Endpoint, trainer: str) -> bool:
        """Through honing's backend (``/init_weight_transfer_engine`` with the trainer's
        id), before a sync pauses the server; vLLM's NCCL engine keeps no hold."""
        self._open(endpoint)
        return self._hold(endpoint, {"trainer": trainer})

    def renew(self, endpoint: Endpoint, trainer: str) -> None:
        self._hold(endpoint, {"trainer": trainer})  # no channel opened from the keeper

    def release(self, endpoint: Endpoint, trainer: str) -> None:
        self._hold(endpoint, {"trainer": trainer, "release": True})

    def _hold(self, endpoint: Endpoint, init: dict) -> bool:
        if not isinstance(self._channels.get(endpoint.url), _Files):
            return False
        try:
            self.post(
                endpoint,
                "/init_weight_transfer_engine",
                json={"init_info": init},
                headers=ONE_REQUEST,
            )
        except Retryable as err:  # vLLM answers a worker's error with HTTP 500
            if HELD in str(err):
                raise EngineRequestError(f"{endpoint.url}: {err}", 409) from None
            raise
        return True

    def _send(self, endpoints: list[Endpoint], version: int, buckets) -> Failures:
        """Every bucket to every endpoint that keeps answering (see ``_Round``). The first
        bucket's file is written before any server is paused: a directory without room
        fails the sync while every server still has its weights. A sync that fails here
        (a bucket that cannot be written, an error making one) is abandoned on every server
        (``_abandon``)."""
        sync = _Round(endpoints, self._forget)
        sync.each(self._open)
        stream, untied = iter(buckets), _Untied()
        bucket = next(stream, None)
        files = any(isinstance(self._channels[e.url], _Files) for e in sync.live)
        tensors = untied.tensors(bucket) if files and bucket is not None else {}
        try:
            ready = self._write_first(tensors, endpoints)
        except UserError:
            drain(stream)
            raise
        try:
            sync.each(self._start)
            while bucket is not None:
                sync.each(lambda e, b=bucket, t=tensors: self._update(e, b, t, ready, version))
                bucket = next(stream, None)
                files = any(isinstance(self._channels[e.url], _Files) for e in sync.live)
                tensors = untied.tensors(bucket) if files and bucket is not None else {}
        except BaseException as err:
            outcome = self._abandon(sync, version)
            if isinstance(err, OSError):
                drain(stream)
                raise self._unwritable(err, outcome) from None
            raise
        finally:
            for path in ready:
                path.unlink(missing_ok=True)
        sync.each(lambda e: self._finish(e, version))
        for endpoint in sync.live:
            endpoint.version = version
        return sync.end()

    def _write_first(self, tensors: dict, endpoints: list[Endpoint]) -> list[Path]:
        """The first bucket's file, for the first server that reads files (none when no
        server does)."""
        if not tensors:
            return []
        try:
            return [write_bucket(self.bucket_dir, self._file_name(), tensors)]
        except OSError as err:
            kept = "; ".join(f"{e.url} keeps version {e.version}" for e in endpoints)
            raise self._unwritable(err, f"no server was touched ({kept})") from None

    def _update(self, endpoint: Endpoint, bucket: list, tensors: dict, ready: list, version: int):
        """One bucket to ``endpoint``: a file (the one written ahead, for the first server
        that takes it) or vLLM's NCCL broadcast.

        Raises:
            EngineRequestError: honing's backend refused the bucket (``WONT_FIT``); the
                server serves its old weights again, or is marked and left paused when
                layers had come whole before (the message says which).
        """
        channel = self._channels[endpoint.url]
        if not isinstance(channel, _Files):
            channel.update(endpoint, bucket, tensors)
            return
        try:
            channel.update(endpoint, tensors, ready.pop() if ready else None)
        except Retryable as err:  # vLLM answers a worker's error with HTTP 500
            if WONT_FIT not in str(err):
                raise
            if PART_NEW in str(err):
                said = self._mark(endpoint, version)
            else:
                self._calls(endpoint, "/resume")
                said = f"it keeps version {endpoint.version}"
            raise EngineRequestError(f"{endpoint.url} refused the weights: {err}; {said}") from None

    def _finish(self, endpoint: Endpoint, version: int) -> None:
        """``/finish_weight_update`` as ``version``, then (honing's backend) the confirmation
        that the update held every tensor of the served model, and ``/resume``.

        Raises:
            EngineRequestError: it lacked one (``LACKS``); the server is marked and left
                paused.
        """
        self._calls(endpoint, ("/finish_weight_update", {"weight_version": str(version)}))
        if isinstance(self._channels.get(endpoint.url), _Files):
            try:
                self._confirm(endpoint)
            except Retryable as err:
                if LACKS not in str(err):
                    raise
                said = self._mark(endpoint, version)
                raise EngineRequestError(f"{endpoint.url}: {err}; {said}") from None
        self._calls(endpoint, "/resume")

    def _confirm(self, endpoint: Endpoint) -> None:
        init = {"init_info": {"confirm": True}}
        self.post(endpoint, "/init_weight_transfer_engine", json=init, headers=ONE_REQUEST)

    def _mark(self, endpoint: Endpoint, version: int) -> str:
        """Marks a server left holding part of ``version`` over its own ``INCOMPLETE``;
        what it holds, said."""
        old = endpoint.version
        marked = {"new_version": f"{INCOMPLETE}: part of {version} over {old}"}
        self._calls(endpoint, ("/update_weight_version", marked))
        return (
            f"it holds part of version {version} over version {old} and is left paused: restart it"
        )

    def _abandon(self, sync: _Round, version: int) -> str:
        """Ends the update on every server still in ``sync``, unfinished: honing's backend
        puts back each layer still waiting for tensors. A server whose model is then as
        before the update finishes it with its old version and serves again; one whose
        backend says that layers hold new tensors (``PART_NEW``: the update already ended
        there) is left paused with its version marked ``INCOMPLETE``, which the start-up check
        refuses. (vLLM's NCCL engine has no way to abandon an update: such a server is left
        paused in the middle of it.) Returns what each server holds now."""
        said = []
        for endpoint in sync.live:
            old = endpoint.version
            try:
                if not isinstance(self._channels.get(endpoint.url), _Files):
                    said.append(f"{endpoint.url} is left paused in the middle of it: restart it")
                elif self._abandoned_whole(endpoint):
                    finish = {"weight_version": str(old)}
                    self._calls(endpoint, ("/finish_weight_update", finish), "/resume")
                    said.append(f"{endpoint.url} keeps version {old}")
                else:
                    said.append(f"{endpoint.url}: {self._mark(endpoint, version)}")
            except (Retryable, EngineRequestError) as err:
                said.append(f"{endpoint.url} could not end the update ({err}): restart it")
            finally:
                self._forget(endpoint)
        return "; ".join(said) or "no server was left in the sync"

    def _abandoned_whole(self, endpoint: Endpoint) -> bool:
        """Abandons the update on ``endpoint``: whether its model is as before it.

        Raises:
            Retryable, EngineRequestError: the server failed otherwise.
        """
        abandon = {"update_info": {"abandon": True}}
        try:
            self.post(endpoint, "/update_weights", json=abandon, headers=ONE_REQUEST)
        except Retryable as err:
            if PART_NEW not in str(err):
                raise
            return False
        return True

    def _unwritable(self, err: OSError, outcome: str) -> UserError:
        unset = "" if self.weight_dir_set else " (rollout.weight_dir unset)"
        where = f"{self.bucket_dir}{unset}"
        return UserError(
            f"rollout.weight_sync=vllm: cannot write a weight bucket to {where} "
            f"({err.strerror or err}); {outcome}. Make room there, or set rollout.weight_dir "
            "to a directory with room that the servers read"
        )

    def _file_name(self) -> str:
        return f"{os.getpid()}-{next(self._names)}"

    def _forget(self, endpoint: Endpoint) -> None:
        """Closes the channel of a server that failed: one that comes back is a new one."""
        channel = self._channels.pop(endpoint.url, None)
        if channel is not None:
            channel.close()

    def _open(self, endpoint: Endpoint) -> None:
        """The channel to ``endpoint``, opened on first use."""
        if endpoint.url not in self._channels:
            info = self.get(endpoint, "/server_info?config_format=json")
            if transfer_backend(info) == "nccl":
                self._channels[endpoint.url] = _Nccl(self.post, self.get, endpoint)
            else:
                self._channels[endpoint.url] = _Files(self.post, self.bucket_dir, self._file_name)

    def _start(self, endpoint: Endpoint) -> None:
        self._calls(endpoint, "/pause?mode=wait", "/start_weight_update")

    def _calls(self, endpoint: Endpoint, *calls) -> None:
        for call in calls:
            path, body = call if isinstance(call, tuple) else (call, None)
            self.post(endpoint, path, json=body)


class _Round:
    """One sync to several servers, step by step on each server still in it. One that fails
    (``Retryable``) leaves it and is reported; one that refuses a request (HTTP 4xx) leaves it
    and the refusal is raised at the end, once every bucket was read (under a sharded layout
    each bucket is a gather every rank takes part in)."""

    def __init__(self, endpoints: list[Endpoint], forget: Callable[[Endpoint], None]) -> None:
        self.live, self.forget = list(endpoints), forget
        self.failures: Failures = []
        self.refused: EngineRequestError | None = None

    def each(self, step: Callable[[Endpoint], None]) -> None:
        for endpoint in list(self.live):
            try:
                step(endpoint)
                continue
            except Retryable as err:
                self.failures.append((endpoint, str(err)))
            except EngineRequestError as err:
                self.refused = self.refused or err
            self.live.remove(endpoint)
            self.forget(endpoint)

    def end(self) -> Failures:
        if self.refused is not None:
            raise self.refused
        return self.failures


class _Files:
    """The ``honing`` backend: a bucket file per ``/update_weights``, which the server deletes
    once read (this side, when the request failed)."""

    def __init__(self, post: Post, directory: Path, name: Callable[[], str]) -> None:
        self.post, self.directory, self.name = post, directory, name

    def update(self, endpoint: Endpoint, tensors: dict, written: Path | None = None) -> None:
        """``tensors``: the bucket on the CPU, a tied weight once; ``written``: their file,
        when it was written ahead."""
        if not tensors:
            return
        path = written or write_bucket(self.directory, self.name(), tensors)
        try:
            update = {"update_info": {"path": str(path)}}  # refused by a worker: HTTP 500
            self.post(endpoint, "/update_weights", json=update, headers=ONE_REQUEST)
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        pass


class _Nccl:
    """vLLM's ``nccl`` backend: an NCCL group with one server's workers, this process rank 0
    (unpacked: each tensor broadcast alone, the buckets bound the memory)."""

    def __init__(self, post: Post, get: Callable[..., dict], endpoint: Endpoint) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.post = post
        workers = int(get(endpoint, "/get_world_size")["world_size"])
        address, port = _address_towards(urlsplit(endpoint.url).hostname or ""), _free_port()
        init = {
            "master_address": address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": workers + 1,
            "packed": False,
        }
        with ThreadPoolExecutor(1) as pool:  # the workers wait in it for the rendezvous
            joined = pool.submit(
                post, endpoint, "/init_weight_transfer_engine", json={"init_info": init}
            )
            self.group = trainer_init(init)
            joined.result()

    def update(self, endpoint: Endpoint, bucket: list, tensors: dict) -> None:
        """The bucket as it is, on the GPU (a tied weight twice: vLLM's model loads it
        once)."""
        import torch

        info = {
            "names": [name for name, _ in bucket],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
        }
        with ThreadPoolExecutor(1) as pool:  # the workers receive inside the request
            received = pool.submit(
                self.post, endpoint, "/update_weights", json={"update_info": info}
            )
            stream = torch.cuda.current_stream()
            for _, tensor in bucket:
                self.group.broadcast(tensor.cuda().contiguous(), src=0, stream=stream)
            stream.synchronize()
            received.result()

    def close(self) -> None:
        self.group.destroy()


def _address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
