"""Sharded weights become one safetensors model: real ZeRO-3 and FSDP2 shards, written by two processes on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmops.training.checkpoints import consolidate

pytestmark = pytest.mark.slow

TINY = ("LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, "
        "vocab_size=64, tie_word_embeddings=False)")

# DeepSpeed driven directly (the Trainer's DeepSpeed path needs CUDA): one ZeRO-3 step, then its checkpoint
ZERO3 = textwrap.dedent(f"""
    import sys, torch, deepspeed
    deepspeed.ops.__compatible_ops__ = {{}}  # gloo carries the collectives: no shared-memory kernel to compile
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    out = sys.argv[1]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config({TINY})
    config = {{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {{"stage": 3}}, "zero_force_ds_cpu_optimizer": False}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(engine.global_rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(out)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        if engine.global_rank == 0:
            save_file({{n: p.detach().clone() for n, p in engine.module.named_parameters()}}, out + "/reference.st")
""")

# FSDP2 with gloo: one step, then the sharded state dict as a distributed checkpoint, as accelerate saves it
FSDP2 = textwrap.dedent(f"""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    out = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config({TINY})
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    dcp.save({{"model": get_model_state_dict(model)}}, checkpoint_id=out + "/pytorch_model_fsdp_0")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_file({{n: t.contiguous() for n, t in full.items()}}, out + "/reference.st")
    dist.destroy_process_group()
""")


def write_shards(script: str, folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder.parent / "shards.py").write_text(script)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                             str(folder.parent / "shards.py"), str(folder)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def assert_same_weights(folder: Path) -> None:
    merged = load_file(str(folder / "model.safetensors"))
    reference = load_file(str(folder / "reference.st"))
    assert set(reference) <= set(merged)
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name].float(), tensor.float(), rtol=0, atol=0)


def test_zero3_shards_consolidate_into_the_trained_weights(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    write_shards(ZERO3, folder)
    assert (folder / "latest").is_file() and not (folder / "model.safetensors").exists()
    assert consolidate(folder) == "deepspeed"
    assert_same_weights(folder)
    assert not (folder / "latest").exists() and not list(folder.glob("global_step*"))


def test_fsdp_sharded_state_consolidates_into_the_trained_weights(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    write_shards(FSDP2, folder)
    assert consolidate(folder) == "fsdp"
    assert_same_weights(folder)
    assert not (folder / "pytorch_model_fsdp_0").exists()


def test_a_whole_model_needs_no_consolidation(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert consolidate(tmp_path) is None
