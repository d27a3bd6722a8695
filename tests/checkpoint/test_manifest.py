"""Tests for the checkpoint manifest: what it records and what verification catches."""

import hashlib
import json

from honing.checkpoint.manifest import MANIFEST, build_manifest, verify, write_manifest


def make_checkpoint(directory):
    (directory / "weights.bin").write_bytes(b"abc")
    (directory / "sub").mkdir()
    (directory / "sub" / "state.json").write_text('{"step": 1}')
    (directory / "COMPLETE").write_text("{}")  # never listed: written after the manifest
    return directory


def test_manifest_lists_sizes_and_sha256(tmp_path):
    manifest = build_manifest(make_checkpoint(tmp_path))
    assert manifest == {
        "files": {
            "sub/state.json": {"size": 11, "sha256": hashlib.sha256(b'{"step": 1}').hexdigest()},
            # sha256("abc") from FIPS 180-2, appendix B.1
            "weights.bin": {
                "size": 3,
                "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            },
        }
    }


def test_an_intact_checkpoint_verifies(tmp_path):
    write_manifest(make_checkpoint(tmp_path))
    assert json.loads((tmp_path / MANIFEST).read_text())["files"].keys() == {
        "sub/state.json",
        "weights.bin",
    }
    assert verify(tmp_path) is None


def test_a_truncated_file_is_caught_by_its_size(tmp_path):
    write_manifest(make_checkpoint(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"ab")
    assert verify(tmp_path) == "weights.bin: 2 bytes, manifest says 3"


def test_changed_bytes_of_the_same_size_are_caught_by_the_digest(tmp_path):
    write_manifest(make_checkpoint(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"abd")
    assert verify(tmp_path) == "weights.bin: sha256 differs from the manifest"


def test_a_missing_file_or_manifest_is_caught(tmp_path):
    write_manifest(make_checkpoint(tmp_path))
    (tmp_path / "sub" / "state.json").unlink()
    assert verify(tmp_path) == "sub/state.json: missing"
    (tmp_path / MANIFEST).unlink()
    assert verify(tmp_path) == f"no readable {MANIFEST}"
    (tmp_path / MANIFEST).write_text('{"files": ')  # torn
    assert verify(tmp_path) == f"no readable {MANIFEST}"
