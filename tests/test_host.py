"""Host settings: glibc's allocator thresholds are raised unless the user chose their own; a
rank leaves with what it printed and its code."""

import os
import platform
import subprocess
import sys

import pytest

glibc_only = pytest.mark.skipif(
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


@glibc_only
def test_thresholds_are_raised_and_threads_set():
    out = _probe()
    assert "'allocator': 'glibc thresholds 1 GiB'" in out and "'threads': 1" in out


@glibc_only
def test_a_users_own_setting_is_left_alone():
    assert "unchanged (MALLOC_TRIM_THRESHOLD_ is set)" in _probe(MALLOC_TRIM_THRESHOLD_="0")


def test_exit_now_flushes_what_was_printed_and_ends_with_the_code():
    leave = "import sys; from honing.host import exit_now; print('said', end=''); "
    leave += "sys.stderr.write('warned'); exit_now(3)"
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a pipe is
    result = subprocess.run(
        [sys.executable, "-c", leave], env=buffered, capture_output=True, text=True
    )
    assert (result.returncode, result.stdout, result.stderr) == (3, "said", "warned")
