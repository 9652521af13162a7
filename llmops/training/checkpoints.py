"""Training checkpoints that are only ever used whole, on this machine or another.

A checkpoint counts as complete once its manifest (every file's sha256) has been written, after
every process has finished writing into it; the manifest goes in last, under a temporary name
renamed into place. Resuming picks the newest checkpoint whose files match their manifest and
sets the others aside. With a checkpoint store (any fsspec URL) each complete checkpoint is
uploaded as it is written, manifest last, so a run elsewhere finds only complete ones; machines
that each keep their own checkpoints add their own files to it, and complete theirs from it. At the
end, sharded weights (DeepSpeed ZeRO-3, FSDP sharded state) are consolidated into one
safetensors file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmops.io.errors import Transient, UserError
from llmops.io.files import file_hashes, write_text_synced
from llmops.store.settings import storage_options, store_library_error, store_refusal

log = logging.getLogger("llmops.train")


class ResumeError(UserError):
    """The machines of a multi-node training cannot agree on a checkpoint to resume from."""


class CheckpointStoreError(Transient, UserError):
    """train.checkpoint_dir cannot be read or written: a wrong URL, a missing bucket, credentials, the endpoint."""

MANIFEST = "manifest.json"
# beside the model: the trained LoRA adapter when the model saved is the base with it merged in
ADAPTER_DIR = "adapter"
NAME = re.compile(r"^checkpoint-(\d+)$")


def step_of(folder: Path | str) -> int:
    found = NAME.match(Path(folder).name)
    return int(found.group(1)) if found else -1


def write_manifest(checkpoint: Path) -> None:
    """Mark a checkpoint complete: its files' hashes, written to a temporary name and renamed into place."""
    hashes = file_hashes(checkpoint, lambda rel: rel != MANIFEST)
    scratch = checkpoint / f".{MANIFEST}.{uuid.uuid4().hex[:8]}"
    write_text_synced(scratch, json.dumps(hashes, indent=1, sort_keys=True))
    os.replace(scratch, checkpoint / MANIFEST)


def problem_with(checkpoint: Path) -> str | None:
    """None when the checkpoint is complete and intact."""
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        return "not complete (no manifest: the run stopped while writing it)"
    expected = json.loads(manifest.read_text())
    actual = file_hashes(checkpoint, lambda rel: rel != MANIFEST and not rel.startswith(f".{MANIFEST}"))
    changed = sorted(n for n in expected.keys() | actual.keys() if expected.get(n) != actual.get(n))
    return f"{len(changed)} file(s) differ from its manifest, e.g. {changed[0]}" if changed else None


def latest_complete(folder: Path) -> Path | None:
    """The newest sound checkpoint in `folder`; newer incomplete or damaged ones are set aside, with a warning."""
    if not folder.is_dir():
        return None
    for checkpoint in sorted((p for p in folder.iterdir() if NAME.match(p.name)), key=step_of, reverse=True):
        problem = problem_with(checkpoint)
        if problem is None:
            return checkpoint
        log.warning("%s is not used: %s", checkpoint.name, problem)
        aside = folder.parent / "set-aside"
        aside.mkdir(exist_ok=True)
        os.replace(checkpoint, aside / f"{checkpoint.name}-{uuid.uuid4().hex[:6]}")
    return None


def holds_weights(checkpoint: Path) -> bool:
    """Whether a checkpoint holds model weights: a weights file, or DeepSpeed's or FSDP's folder of shards. Under
    torchrun across machines only global rank 0 writes the weights file, so the other machines' copies lack it."""
    return any(checkpoint.glob("*model*.safetensors")) or any(checkpoint.glob("*model*.bin")) or any(
        path.is_dir() and path.name.startswith(("global_step", "pytorch_model_fsdp")) for path in checkpoint.iterdir())


def agreed_resume(resume_from: str | None, ledger: Path) -> str | None:
    """The checkpoint every process resumes from: the oldest any found. The machines of a multi-node training each
    pick their own, and one may have completed a checkpoint the others had not when they stopped; the ones ahead go
    back to that step (their older checkpoint), and their `ledger` forgets the steps after it."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return resume_from
    mine = step_of(resume_from) if resume_from else 0
    steps: list[int] = [0] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(steps, mine)
    agreed = min(steps)
    if agreed == mine:
        return resume_from
    if ledger.is_file():
        kept = [line for line in ledger.read_text().splitlines() if line and json.loads(line)["step"] <= agreed]
        ledger.write_text("".join(f"{line}\n" for line in kept))
    if agreed == 0:
        log.warning("another machine has no checkpoint: the training starts over from step 0")
        return None
    older = Path(resume_from or ".").parent / f"checkpoint-{agreed}"
    if problem_with(older) is not None:
        raise ResumeError(f"the machines' last complete checkpoints differ (steps {sorted(set(steps))}) and this one "
                          f"no longer has checkpoint-{agreed}: raise train.save_total_limit, or remove the newer "
                          "checkpoints on every machine to resume from one they all have")
    log.warning("resuming from %s, the last checkpoint every machine completed", older.name)
    return str(older)


def remote_folder(store: str, key: str) -> str:
    return f"{store.rstrip('/')}/{key}"


@contextmanager
def opened_store(store: str, key: str) -> Iterator[tuple[Any, str]]:
    """The store's filesystem and this training's folder in it: endpoints and keys from the environment, as for
    workspace.remote (a fresh client: a cached one would not see what another machine wrote since); what the store
    refuses becomes one line."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(remote_folder(store, key), skip_instance_cache=True,
                                         **storage_options(store))
        yield fs, root.rstrip("/")
    except Exception as err:
        if not isinstance(err, (OSError, ImportError, ValueError)) and not store_library_error(err):
            raise
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise  # this machine's disk, not the store
        raise CheckpointStoreError(store_refusal("train.checkpoint_dir", store, err)) from err


def upload(checkpoint: Path, store: str, key: str) -> None:
    """Copy a complete checkpoint to the store, manifest last: a reader never sees a partial one as complete."""
    put_manifest(store, key, checkpoint.name, put_files(checkpoint, store, key, ()))


def publish(checkpoint: Path, store: str, key: str, writes: bool, lead: bool) -> None:
    """Every process's part in copying a checkpoint to the store (`writes`: this process saved it on its machine;
    `lead`: global rank 0). Machines that each keep their own checkpoints hold different files: only rank 0's holds
    the weights, each holds its own processes' RNG states and ZeRO shards. Rank 0 uploads its checkpoint first;
    then every other machine the files rank 0's lacks; rank 0 writes the manifest of them all, last."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        if lead:
            upload(checkpoint, store, key)
        return
    first = gathered(put_files(checkpoint, store, key, ()) if lead else {})
    others = gathered(put_files(checkpoint, store, key, first) if writes and not lead else {})
    if lead:
        put_manifest(store, key, checkpoint.name, {**first, **others})


def gathered(part: dict[str, str]) -> dict[str, str]:
    """Every process's `part`, merged (the same on every process)."""
    import torch

    parts: list[dict[str, str]] = [{}] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, part)
    return {name: digest for one in parts for name, digest in one.items()}


def put_files(checkpoint: Path, store: str, key: str, skip: Collection[str]) -> dict[str, str]:
    """Upload the files of a complete checkpoint (its manifest says which) not named in `skip`; their hashes."""
    hashes = {name: digest for name, digest in json.loads((checkpoint / MANIFEST).read_text()).items()
              if name not in skip}
    with opened_store(store, key) as (fs, root):
        for name in sorted(hashes):
            target = f"{root}/{checkpoint.name}/{name}"
            fs.makedirs(target.rpartition("/")[0], exist_ok=True)
            fs.put_file(str(checkpoint / name), target)
    return hashes


def put_manifest(store: str, key: str, name: str, hashes: dict[str, str]) -> None:
    with opened_store(store, key) as (fs, root):
        fs.pipe_file(f"{root}/{name}/{MANIFEST}", json.dumps(hashes, indent=1, sort_keys=True).encode())


def completed_from_store(checkpoint: Path, store: str, key: str) -> Path:
    """`checkpoint` with the files its copy in the store has and it lacks: on a machine of a multi-node training,
    the other machines' parts (rank 0's weights, their RNG states and ZeRO shards). Unchanged when the store has
    no complete copy of it or nothing is missing."""
    with opened_store(store, key) as (fs, root):
        remote = f"{root}/{checkpoint.name}"
        if not fs.exists(f"{remote}/{MANIFEST}"):
            return checkpoint
        theirs: dict[str, str] = json.loads(fs.cat_file(f"{remote}/{MANIFEST}"))
        mine: dict[str, str] = json.loads((checkpoint / MANIFEST).read_text())
        missing = sorted(set(theirs) - set(mine))
        for name in missing:
            (checkpoint / name).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{remote}/{name}", str(checkpoint / name))
    if missing:
        write_text_synced(checkpoint / MANIFEST, json.dumps({**theirs, **mine}, indent=1, sort_keys=True))
        log.info("%s: %d file(s) of the other machines' taken from the checkpoint store", checkpoint.name,
                 len(missing))
    return checkpoint


def download_latest(store: str, key: str, folder: Path) -> Path | None:
    """Bring the newest complete checkpoint of this training from the store, verified, into `folder`."""
    with opened_store(store, key) as (fs, root):
        if not fs.exists(root):
            return None
        remote = sorted((p.rstrip("/") for p in fs.ls(root, detail=False) if NAME.match(Path(p.rstrip("/")).name)),
                        key=step_of, reverse=True)
        for path in remote:
            if not fs.exists(f"{path}/{MANIFEST}"):
                continue
            scratch = folder / f".download-{uuid.uuid4().hex[:8]}"
            fetch_folder(fs, path, scratch)
            problem = problem_with(scratch)
            if problem is None:
                target = folder / Path(path).name
                os.replace(scratch, target)
                log.info("resuming from %s in the checkpoint store", Path(path).name)
                return target
            log.warning("%s in the checkpoint store is not used: %s", Path(path).name, problem)
            shutil.rmtree(scratch, ignore_errors=True)
    return None


def fetch_folder(fs: Any, remote: str, target: Path) -> None:
    """Every file under `remote` into `target`, file by file (what a recursive get does differs between stores)."""
    for path in fs.find(remote):
        if path.startswith(remote + "/"):
            local = target / path[len(remote) + 1:]
            local.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(local))


def forget(store: str, key: str) -> None:
    """Delete a finished training's checkpoints from the store: the model itself is the artifact now."""
    # not found: never stored, or another machine of this training removed it first (looking first would race)
    with opened_store(store, key) as (fs, root), contextlib.suppress(FileNotFoundError):
        fs.rm(root, recursive=True)


def consolidate(model_dir: Path) -> str | None:
    """Turn sharded weights in `model_dir` into one model.safetensors; say which kind was found, if any."""
    fsdp_shards = model_dir / "pytorch_model_fsdp_0"
    if fsdp_shards.is_dir():
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(str(fsdp_shards), str(model_dir), safe_serialization=True)
        shutil.rmtree(fsdp_shards)
        return "fsdp"
    if (model_dir / "latest").is_file():
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        tag = (model_dir / "latest").read_text().strip()
        convert_zero_checkpoint_to_fp32_state_dict(str(model_dir), str(model_dir), tag=tag, safe_serialization=True)
        shutil.rmtree(model_dir / tag)
        for leftover in ("latest", "zero_to_fp32.py"):
            (model_dir / leftover).unlink(missing_ok=True)
        return "deepspeed"
    return None


def full_state(model: Any, keep: bool) -> dict[str, Any]:
    """The whole state of an FSDP model under its module's own names, on the CPU of the processes that `keep` it.
    FSDP2 (fully_shard): gathered one tensor at a time, every process taking part, so only one whole tensor is ever
    on the device, and of a PEFT model only what its adapter saves (the frozen base is never gathered); FSDP1:
    gathered by torch to rank 0 alone (the others get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = {}
    sharded = model.state_dict()
    saved = adapter_names(model, sharded)
    for name, value in sharded.items():
        if saved is not None and name not in saved:
            continue
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            state[name] = whole.detach().cpu()
    return state


def adapter_names(model: Any, state: dict[str, Any]) -> set[str] | None:
    """The entries of `state` a PEFT model saves (its adapter, a head trained whole), as peft itself picks them;
    None for any other model (it saves every entry)."""
    if not hasattr(model, "peft_config"):
        return None
    from peft import get_peft_model_state_dict

    picked = {id(value) for value in get_peft_model_state_dict(model, state_dict=state).values()}
    return {name for name, value in state.items() if id(value) in picked}


def save_gathered(sharded: Any, model: Any, folder: Path, main: bool) -> None:
    """Every process joins the gathering; those that write (`main`) save `model` (the transformers or PEFT model
    inside `sharded`) from the gathered state: a PEFT model keeps its adapter only."""
    state = full_state(sharded, keep=main)
    if main and state:
        model.save_pretrained(str(folder), state_dict=state)
