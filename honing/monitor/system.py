"""Process signals per step: CPU use, resident memory and (with CUDA) peak GPU memory.

    system/cpu_percent   CPU time of this process (all threads, user + system) over wall
                         time since the previous sample, in percent: 200 = two busy cores
    system/rss_mb        resident set size now, MiB (read from /proc/self/statm)
    system/gpu_mem_mb    torch.cuda.max_memory_allocated() of the current device, MiB: the
                         peak since the process started (or since someone reset it)

No psutil: CPU time comes from ``os.times`` and memory from ``/proc``, so RSS is left out
where ``/proc`` does not exist (macOS). The GPU figure is read only when torch is already
imported and CUDA is available; this module never imports torch itself. Worker processes
(scoring sandboxes, a vLLM server) are not counted.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

_MIB = 2**20
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_cpu_seconds() -> float:
    """User + system CPU time of this process so far (children excluded), in seconds."""
    times = os.times()
    return times.user + times.system


def rss_mb(statm: Path = Path("/proc/self/statm")) -> float | None:
    """Resident memory of this process in MiB, or ``None`` where ``/proc`` is missing."""
    try:
        resident_pages = int(statm.read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * _PAGE_SIZE / _MIB


def gpu_mem_mb() -> float | None:
    """Peak GPU memory allocated by torch on the current device, MiB; ``None`` without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / _MIB


class SystemSampler:
    """Samples the process signals; CPU percent is measured between consecutive samples.

    The first sample measures from construction. Calling it once per training step gives
    the CPU use over that step.
    """

    def __init__(self) -> None:
        self._last_cpu = process_cpu_seconds()
        self._last_wall = time.monotonic()

    def sample(self) -> dict[str, float]:
        """Returns ``system/cpu_percent``, ``system/rss_mb`` and, with CUDA,
        ``system/gpu_mem_mb``; a signal the platform lacks is left out."""
        cpu, wall = process_cpu_seconds(), time.monotonic()
        elapsed = wall - self._last_wall
        percent = 100.0 * (cpu - self._last_cpu) / elapsed if elapsed > 0 else math.nan
        self._last_cpu, self._last_wall = cpu, wall
        metrics = {"system/cpu_percent": percent}
        resident = rss_mb()
        if resident is not None:
            metrics["system/rss_mb"] = resident
        gpu = gpu_mem_mb()
        if gpu is not None:
            metrics["system/gpu_mem_mb"] = gpu
        return metrics


_PROCESS_SAMPLER = SystemSampler()


def system_metrics() -> dict[str, float]:
    """Samples the process signals since the previous call (the loop calls it once a step).

    One sampler serves the whole process; its first call measures CPU since this module was
    imported. Use a ``SystemSampler`` of your own for an independent window.
    """
    return _PROCESS_SAMPLER.sample()
