"""Tests for the per-step process signals: CPU percent, RSS, GPU memory."""

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from honing.monitor.system import SystemSampler, gpu_mem_mb, rss_mb, system_metrics

HAS_PROC = Path("/proc/self/statm").exists()


def busy(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


# Process-wide figures are read in a fresh interpreter: in the suite's own process, threads
# left by earlier tests use CPU and free memory between two reads (a 64 MiB block once grew
# RSS by only 47.8 MiB).
def fresh_interpreter(code: str) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    return [float(x) for x in out.split()]


_CPU_CHECK = """
import time
from honing.monitor.system import SystemSampler
sampler = SystemSampler()
end = time.process_time() + 0.2
while time.process_time() < end:
    pass
loaded = sampler.sample()["system/cpu_percent"]
time.sleep(0.2)
print(loaded, sampler.sample()["system/cpu_percent"])
"""


def test_cpu_percent_of_a_busy_then_an_idle_window():
    loaded, idle = fresh_interpreter(_CPU_CHECK)
    # One thread spinning uses one core: ~100%, less when other processes share the cores.
    assert 20 < loaded < 110
    assert 0 <= idle < 25


_RSS_CHECK = """
from pathlib import Path
from honing.monitor.system import rss_mb
status = Path("/proc/self/status").read_text()
vm_rss_kib = int(next(l for l in status.splitlines() if l.startswith("VmRSS")).split()[1])
before = rss_mb()
block = bytearray(64 * 2**20)  # zero-filled: the pages are touched
print(before - vm_rss_kib / 1024, rss_mb() - before)
"""


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_rss_matches_the_kernels_vmrss_and_grows_with_an_allocation():
    off_kernel, growth = fresh_interpreter(_RSS_CHECK)
    assert abs(off_kernel) < 8
    assert 60 < growth < 72


def test_rss_without_proc_is_none(tmp_path):
    assert rss_mb(tmp_path / "absent") is None


def test_system_metrics_names_and_values():
    metrics = system_metrics()
    assert set(metrics) >= {"system/cpu_percent"}
    assert ("system/rss_mb" in metrics) == HAS_PROC
    assert all(math.isfinite(value) and value >= 0 for value in metrics.values())


def test_gpu_memory_is_absent_without_cuda_or_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert gpu_mem_mb() is None  # never imports torch itself
    assert "torch" not in sys.modules


@pytest.mark.gpu
def test_gpu_memory_counts_a_cuda_allocation():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    assert gpu_mem_mb() >= 64
    assert SystemSampler().sample()["system/gpu_mem_mb"] >= 64
    del block


def test_cpu_time_counts_other_threads():
    sampler = SystemSampler()
    worker = threading.Thread(target=busy, args=(0.15,))
    worker.start()
    worker.join()
    assert sampler.sample()["system/cpu_percent"] > 20
