"""Dynamic offload (``memory.dynamic_offload``): idle state leaves the GPU while it is idle.

Under the sync schedule generation and the update take turns on one device. When device
memory in use passes ``memory.offload_trigger_threshold`` (a fraction of the device's total,
``torch.cuda.mem_get_info``) as generation is about to start, the trainer's idle state goes to
host memory: every trainer engine's optimizer state (the policy's, the critic's, the MTP
heads'), the weights generation does not use (the critic's) and the reference model; the
gradients the last update left are dropped (the next update zeroes them before use). It
comes back before the update. After generation the engine's KV
cache is gone (it lives for one generate call) and ``torch.cuda.empty_cache`` hands its
blocks back before the update's activations are allocated. The policy's weights stay: the
in-process engine samples with them.

The time each way is a metric (``timing_s/offload``, ``timing_s/reload``), with the bytes
moved (``memory/offloaded_gb``). On CUDA the peak memory of each phase is a metric too
(``memory/peak_gen_gb``, ``memory/peak_update_gb``), with or without offload. Where it
cannot act it says so once (event ``offload_inactive``): on a machine without CUDA (the state
is in host memory already), and under ``one_step`` / ``async``, where generation and the
update overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def cuda_memory_in_use(device: torch.device) -> float:
    """The fraction of the device's memory in use (by any process)."""
    free, total = torch.cuda.mem_get_info(device)
    return 1.0 - free / total


class Offloader:
    """Moves the trainer's idle state off the device around generation (see the module).

    Args:
        settings: ``config.memory``. schedule: ``config.schedule.mode``.
        parts: the run's components (optimizer, reference, critic).
        log_event: the run logger's ``log_event``.
        probe: memory in use as a fraction of the device's (tests pass their own).
    """

    def __init__(
        self,
        settings,
        schedule: str,
        parts,
        log_event: Callable[..., None],
        probe: Callable[[torch.device], float] | None = None,
    ):
        self.parts, self.threshold = parts, settings.offload_trigger_threshold
        self.probe = probe or cuda_memory_in_use
        self.host = torch.device("cpu")
        self.moved = False
        self.active = settings.dynamic_offload
        reason = None
        if self.active and schedule != "sync":
            reason = f"schedule.mode={schedule} overlaps generation and the update"
        elif self.active and parts.device.type != "cuda" and probe is None:
            reason = "no CUDA device: the trainer's state is in host memory already"
        if reason:
            log_event("offload_inactive", reason=reason)
            self.active = False

    def mark(self) -> None:
        """Starts a phase whose peak device memory ``peak`` reports (CUDA only)."""
        if self.parts.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.parts.device)

    def peak(self, phase: str) -> dict[str, float]:
        """``memory/peak_<phase>_gb``: the most device memory allocated since ``mark``."""
        if self.parts.device.type != "cuda":
            return {}
        return {f"memory/peak_{phase}_gb": torch.cuda.max_memory_allocated(self.parts.device) / 1e9}

    def before_generation(self) -> dict[str, float]:
        if not self.active or self.moved or self.probe(self.parts.device) < self.threshold:
            return {}
        started = time.perf_counter()
        moved = self._move(self.host)
        self.moved = True
        if self.parts.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"timing_s/offload": time.perf_counter() - started, "memory/offloaded_gb": moved}

    def before_update(self) -> dict[str, float]:
        if not self.active:
            return {}
        if self.parts.device.type == "cuda":
            torch.cuda.empty_cache()  # the KV cache of the generation just done
        if not self.moved:
            return {}
        started = time.perf_counter()
        self._move(self.parts.device)
        self.moved = False
        return {"timing_s/reload": time.perf_counter() - started}

    def _move(self, device: torch.device) -> float:
        """Moves the idle state to ``device``; returns the gigabytes moved."""
        parts = self.parts
        moved = sum(trainer.offload(device) for trainer in parts.trainers.all())
        if parts.reference is not None:
            moved += sum(p.numel() * p.element_size() for p in parts.reference.parameters())
            parts.reference.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return moved / 1e9
