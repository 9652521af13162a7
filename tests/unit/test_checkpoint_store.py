"""The checkpoint store (train.checkpoint_dir): any fsspec URL, complete checkpoints only, one line when unreachable."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from llmops.training import checkpoints


def a_checkpoint(folder: Path, step: int) -> Path:
    checkpoint = folder / f"checkpoint-{step}"
    (checkpoint / "nested").mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(bytes([step]) * 64)
    (checkpoint / "nested" / "rng_state_0.pth").write_text(f"state {step}")
    checkpoints.write_manifest(checkpoint)
    return checkpoint


def test_the_newest_complete_checkpoint_comes_back_from_the_store_and_goes_when_forgotten(tmp_path: Path) -> None:
    store = f"memory://checkpoints-{uuid.uuid4().hex[:8]}/runs"
    for step in (4, 8):
        checkpoints.upload(a_checkpoint(tmp_path / "machine-a", step), store, "key1")
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.rm_file(f"{store[len('memory://'):]}/key1/checkpoint-8/manifest.json")  # checkpoint-8 is not complete
    landed = checkpoints.download_latest(store, "key1", tmp_path / "machine-b")
    assert landed == tmp_path / "machine-b" / "checkpoint-4" and checkpoints.problem_with(landed) is None
    assert (landed / "nested" / "rng_state_0.pth").read_text() == "state 4"
    assert checkpoints.download_latest(store, "other-key", tmp_path / "machine-b") is None
    checkpoints.forget(store, "key1")
    assert checkpoints.download_latest(store, "key1", tmp_path / "machine-c") is None


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_forgetting_what_is_not_in_the_store_is_no_error(tmp_path: Path, scheme: str) -> None:
    """Every machine of a multi-node training forgets the same key when it ends: the ones that come second find it
    gone, which is the state they want."""
    root = f"checkpoints-{uuid.uuid4().hex[:8]}" if scheme == "memory" else str(tmp_path / "store")
    store = f"{scheme}://{root}/runs"
    checkpoints.upload(a_checkpoint(tmp_path / "machine-a", 4), store, "key1")
    checkpoints.forget(store, "key1")
    checkpoints.forget(store, "key1")
    checkpoints.forget(store, "never-stored")
    assert checkpoints.download_latest(store, "key1", tmp_path / "machine-b") is None


def test_a_folder_another_machine_removes_while_this_one_forgets_is_no_error(tmp_path: Path) -> None:
    """The interleaving the two machines of a training met: this one sees the folder, the other removes it, then
    this one deletes. A store whose every look at a path is followed by the other machine's removal replays it."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class OtherMachineRemovesAfterEachLook(MemoryFileSystem):
        protocol = "racing"

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            return MemoryFileSystem._strip_protocol(path.replace("racing://", "memory://", 1))

        def exists(self, path: str, **kwargs: object) -> bool:
            seen = super().exists(path, **kwargs)
            if seen:
                MemoryFileSystem(skip_instance_cache=True).rm(self._strip_protocol(path), recursive=True)
            return seen

    fsspec.register_implementation("racing", OtherMachineRemovesAfterEachLook, clobber=True)
    store = f"memory://checkpoints-{uuid.uuid4().hex[:8]}/runs"
    checkpoints.upload(a_checkpoint(tmp_path / "machine-a", 4), store, "key1")
    checkpoints.forget(store.replace("memory://", "racing://"), "key1")
    assert checkpoints.download_latest(store, "key1", tmp_path / "machine-b") is None


def test_a_store_that_cannot_be_reached_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(checkpoints.CheckpointStoreError, match=r"^train.checkpoint_dir nosuchscheme://x/y: "):
        checkpoints.upload(a_checkpoint(tmp_path, 4), "nosuchscheme://x/y", "key1")


def test_a_checkpoint_without_weights_is_told_apart(tmp_path: Path) -> None:
    """Under torchrun across machines only global rank 0 writes the weights: another machine's checkpoint lacks them."""
    whole, weightless, sharded = (tmp_path / name for name in ("whole", "weightless", "sharded"))
    for folder in (whole, weightless, sharded / "global_step4"):
        folder.mkdir(parents=True)
        (folder / "training_args.bin").write_bytes(b"x")
    (whole / "model.safetensors").write_bytes(b"x")
    assert [checkpoints.holds_weights(f) for f in (whole, weightless, sharded)] == [True, False, True]


def test_the_machines_of_a_multi_node_training_complete_each_others_checkpoints_through_the_store(
        tmp_path: Path) -> None:
    """Rank 0's machine holds the weights and its RNG state, the other machine its own RNG state; the store's copy
    holds both (rank 0's files first, the other's missing ones next, the manifest of all last), and each machine,
    or a fresh one, resumes from all of it."""
    store = f"memory://checkpoints-{uuid.uuid4().hex[:8]}/runs"
    lead = a_checkpoint(tmp_path / "machine-0", 4)
    other = tmp_path / "machine-1" / "checkpoint-4"
    (other / "nested").mkdir(parents=True)
    (other / "nested" / "rng_state_1.pth").write_text("state of rank 1")
    (other / "nested" / "rng_state_0.pth").write_text("not rank 0's: never uploaded over it")
    checkpoints.write_manifest(other)
    assert not checkpoints.holds_weights(other)

    first = checkpoints.put_files(lead, store, "key1", ())
    more = checkpoints.put_files(other, store, "key1", first)
    assert sorted(more) == ["nested/rng_state_1.pth"]
    checkpoints.put_manifest(store, "key1", "checkpoint-4", {**first, **more})

    completed = checkpoints.completed_from_store(other, store, "key1")
    assert checkpoints.holds_weights(completed) and checkpoints.problem_with(completed) is None
    assert (completed / "nested" / "rng_state_1.pth").read_text() == "state of rank 1"
    assert checkpoints.completed_from_store(lead, store, "key1") == lead and checkpoints.problem_with(lead) is None
    assert sorted(p.name for p in lead.rglob("rng_state_*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert (lead / "nested" / "rng_state_0.pth").read_text() == "state 4"  # its own files stay its own
    fresh = checkpoints.download_latest(store, "key1", tmp_path / "machine-2")
    assert fresh is not None and checkpoints.problem_with(fresh) is None
    assert sorted(p.name for p in fresh.rglob("rng_state_*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert (fresh / "nested" / "rng_state_0.pth").read_text() == "state 4"
