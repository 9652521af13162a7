"""Under DeepSpeed ZeRO-3 each process holds a shard of every parameter: the parameter counts and the model FLOPs per
token (hence MFU) are still the whole model's. DeepSpeed driven directly, two processes on CPU (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ZERO3 = textwrap.dedent("""
    import json, sys, torch, deepspeed
    deepspeed.ops.__compatible_ops__ = {}  # gloo carries the collectives: no shared-memory kernel to compile
    from transformers import AutoModelForCausalLM, LlamaConfig
    from llmops.models.modeling import parameter_counts
    from llmops.training.throughput import flops_per_token
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                         intermediate_size=64, vocab_size=64))
    whole = {"counts": parameter_counts(model), "flops": flops_per_token(model, 12.5)}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config)
    sharded = {"counts": parameter_counts(engine.module), "flops": flops_per_token(engine.module, 12.5),
               "held": sum(p.numel() for p in engine.module.parameters()),
               "shards": sum(p.ds_tensor.numel() for p in engine.module.parameters())}
    if engine.global_rank == 0:
        print("ACCOUNTING " + json.dumps({"whole": whole, "sharded": sharded}), flush=True)
    # torn down before the interpreter exits, as the training workers do: left to exit, a communication thread
    # can be destroyed while still joinable and abort the process after its work is done
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
""")


def test_zero3_counts_and_flops_are_the_whole_models(tmp_path: Path) -> None:
    script = tmp_path / "zero3.py"
    script.write_text(ZERO3)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                             str(script)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("ACCOUNTING "))
    found = json.loads(line.removeprefix("ACCOUNTING "))
    whole, sharded = found["whole"], found["sharded"]
    # 64·32 embeddings and as many in the head, 2 layers of 4·32·32 attention + 3·32·64 MLP + 2·32 norms, 32 more
    assert whole["counts"] == {"parameters": 24_736, "trainable_parameters": 24_736}
    # the 64·32 input embeddings are lookups, not matmuls: they cost no FLOPs
    assert whole["flops"] == 6 * (24_736 - 64 * 32) + 12 * 2 * 32 * 12.5
    assert sharded["held"] == 0 and 0 < sharded["shards"] < 24_736  # the process holds a shard, nothing whole
    assert sharded["counts"] == whole["counts"] and sharded["flops"] == whole["flops"]
