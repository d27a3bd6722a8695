"""Host settings: glibc's allocator thresholds are raised unless the user chose their own."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the allocator setting applies to glibc only"
)
PROBE = "from honing.host import configure_host; print(configure_host(1))"


def _probe(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    clean.pop("LD_PRELOAD", None)
    result = subprocess.run(
        [sys.executable, "-c", PROBE], env=clean | env, capture_output=True, text=True, check=True
    )
    return result.stdout


def test_thresholds_are_raised_and_threads_set():
    out = _probe()
    assert "'allocator': 'glibc thresholds 1 GiB'" in out and "'threads': 1" in out


def test_a_users_own_setting_is_left_alone():
    assert "unchanged (MALLOC_TRIM_THRESHOLD_ is set)" in _probe(MALLOC_TRIM_THRESHOLD_="0")
