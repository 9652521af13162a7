"""A registered version's file manifest: the same files pass, a changed, missing or added file is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmops.registry import manifest
from llmops.registry.manifest import TREE, check_manifest, manifest_tag
from llmops.registry.references import RegistryError


def model_folder(root: Path) -> Path:
    (root / "model").mkdir(parents=True)
    (root / "MLmodel").write_text("flavors: {}\n")
    (root / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (root / "model" / "config.json").write_text('{"vocab_size": 32}')
    return root


def test_the_same_files_pass_and_the_tag_lists_each_by_its_short_hash(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "v")
    tag = manifest_tag(folder)
    assert sorted(json.loads(tag)) == ["MLmodel", "model/config.json", "model/model.safetensors"]
    assert all(len(digest) == 16 for digest in json.loads(tag).values())
    check_manifest("m/1", tag, folder)
    check_manifest("m/1", None, folder)  # registered without a manifest: loads unchecked


def test_a_changed_byte_that_still_reads_is_refused_naming_the_file(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "v")
    tag = manifest_tag(folder)
    weights = folder / "model" / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[100] ^= 1
    weights.write_bytes(bytes(damaged))
    with pytest.raises(RegistryError, match=r"^m/2: model/model.safetensors differs from the manifest it was "
                                            r"registered with \(sha256 [0-9a-f]{16}…, registered [0-9a-f]{16}…\)$"):
        check_manifest("m/2", tag, folder)


def test_a_missing_file_and_an_added_file_are_named(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "v")
    tag = manifest_tag(folder)
    (folder / "extra.bin").write_bytes(b"x")
    with pytest.raises(RegistryError, match=r"^m/3: extra.bin is not in the manifest"):
        check_manifest("m/3", tag, folder)
    (folder / "extra.bin").unlink()
    (folder / "model" / "config.json").unlink()
    with pytest.raises(RegistryError, match=r"^m/3: model/config.json is missing"):
        check_manifest("m/3", tag, folder)


def test_a_manifest_too_long_for_a_tag_is_one_hash_that_still_refuses_a_change(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "MODEL_TAG_LIMIT", 40)
    folder = model_folder(tmp_path / "v")
    tag = manifest_tag(folder)
    assert tag.startswith(TREE) and len(tag) == len(TREE) + 64
    check_manifest("m/4", tag, folder)
    (folder / "MLmodel").write_text("flavors: {python_function: {}}\n")
    with pytest.raises(RegistryError, match=r"^m/4: its files differ from the manifest it was registered with$"):
        check_manifest("m/4", tag, folder)
