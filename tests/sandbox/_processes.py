"""The processes a sandboxed program may have left behind, found by a marker in their
command line."""

import os


def processes_with(marker: str) -> list[int]:
    """Pids of the running processes whose command line holds ``marker`` (a process that ends
    while it is looked at is not one)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():
                        found.append(int(entry.name))
            except OSError:
                continue
    return found
