"""Checksums of a checkpoint's files: ``manifest.json``, written just before ``COMPLETE``.

The marker says a save finished; the manifest says the bytes are still the ones that were
saved. Together they catch the two ways a checkpoint goes bad after the fact: a file cut
short or lost (a copy that stopped halfway, a disk that filled) and a file whose bytes
changed (bit rot, a bad copy back from an archive). Checking costs one read of every file
(sha256 runs at ~1 GB/s on one core), so a checkpoint is verified each time it is chosen or
loaded, not trusted from an earlier look.

Limits: the manifest guards against accidents, not against an attacker, who could rewrite
the manifest too. Files that are not in the manifest (added later by hand) are ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
MARKER = "COMPLETE"  # written last: a directory without it is never loaded
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"  # what is being written or deleted; never loaded
STEP_DIR = re.compile(r"step_(\d+)")
_SKIP = {MANIFEST, MARKER}
_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build_manifest(directory: Path) -> dict[str, Any]:
    """``{"files": {relative/path: {"size": bytes, "sha256": hex}}}`` of a directory tree.

    The manifest and marker themselves are left out; symbolic links are refused, since a
    checkpoint must hold its own bytes.
    """
    files: dict[str, dict[str, Any]] = {}
    for current, _, names in os.walk(directory):
        for name in sorted(names):
            path = Path(current, name)
            relative = path.relative_to(directory).as_posix()
            if relative in _SKIP:
                continue
            if path.is_symlink():
                raise ValueError(f"checkpoint file {path} is a symbolic link")
            files[relative] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    return {"files": dict(sorted(files.items()))}


def write_manifest(directory: Path) -> dict[str, Any]:
    """Writes ``directory/manifest.json`` for the files now in ``directory``, fsync-ed.

    Returns:
        The manifest written.
    """
    manifest = build_manifest(directory)
    with (directory / MANIFEST).open("w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    return manifest


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint, or ``None`` when missing or unreadable."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest.get("files"), dict) else None


def verify(directory: Path) -> str | None:
    """Checks every file of a checkpoint against its manifest.

    Sizes are compared for all files first (cheap, and catches truncation), then digests.

    Returns:
        ``None`` when every listed file is present with its size and sha256; otherwise one
        line saying what is wrong (the first problem found), e.g.
        ``"model.safetensors: 1024 bytes, manifest says 3467200"``.
    """
    manifest = read_manifest(directory)
    if manifest is None:
        return f"no readable {MANIFEST}"
    files = manifest["files"]
    if not files:
        return f"{MANIFEST} lists no files"
    for relative, expected in files.items():
        path = directory / relative
        if not path.is_file():
            return f"{relative}: missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{relative}: {size} bytes, manifest says {expected['size']}"
    for relative, expected in files.items():
        if file_digest(directory / relative) != expected["sha256"]:
            return f"{relative}: sha256 differs from the manifest"
    return None


def manifest_size(directory: Path) -> int:
    """Total bytes the manifest lists (0 without a manifest)."""
    manifest = read_manifest(directory)
    return sum(entry["size"] for entry in manifest["files"].values()) if manifest else 0
