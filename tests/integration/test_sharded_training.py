"""The multi-GPU paths' logic on CPU with real process groups (gloo): QLoRA's placement per local rank, ZeRO-3
building the model partitioned, FSDP2 + LoRA trained, checkpointed sharded, gathered, consolidated and merged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def torchrun(script: str, folder: Path, *args: str, env: dict[str, str] | None = None) -> None:
    """Two processes on CPU, joined over gloo, running `script` with `args`."""
    (folder / "script.py").write_text(textwrap.dedent(script))
    environment = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
                   **(env or {})}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                             str(folder / "script.py"), *args], env=environment, capture_output=True, text=True,
                            timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def write_base(folder: Path) -> Path:
    """A tiny pretrained Llama in safetensors: the base LoRA adapts."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                         vocab_size=64, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return folder


def synthetic_tokenized(vocab: int = 128, length: int = 32) -> object:
    """A tokenize-stage artifact of random ids, as the GPU bench makes it."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_train_bench import lengths
    from gpu_train_bench import synthetic_tokenized as make

    return make("sharded", vocab, lengths(64, 12, 0.5, length), length)


# each rank records what it would load a 4-bit base with (alone, then under FSDP), then builds the ZeRO-3 trainer
# as a training process does, and records the parameters it holds and the 4-bit placement under ZeRO-3
ZERO3 = """
    import json, os, sys, torch
    from llmops.config.schema import PipelineConfig
    from llmops.data.tokenize import TokenizeRecord
    from llmops.models import modeling
    from llmops.training.session import Session
    from llmops.training.trainer import build_trainer
    spec, out = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    def placement():
        settings = modeling.quantized_loading(torch.bfloat16, modeling.local_device(), modeling.sharded_loading())
        q = settings["quantization"]
        return {"device_map": settings.get("device_map"), "dtype": str(settings.get("dtype")),
                "storage": str(q["bnb_4bit_quant_storage"]), "compute": str(q["bnb_4bit_compute_dtype"])}
    found = {"local_rank": int(os.environ["LOCAL_RANK"]), "ddp": placement()}
    os.environ["ACCELERATE_USE_FSDP"] = "true"  # what accelerate launch sets for FSDP
    found["fsdp"] = placement()
    del os.environ["ACCELERATE_USE_FSDP"]
    import deepspeed
    deepspeed.ops.__compatible_ops__ = {}  # gloo carries the collectives: no shared-memory kernel to compile
    deepspeed.init_distributed(dist_backend="gloo")  # what accelerate does on GPUs; on CPU it would join gloo alone
    trainer, meter, packed = build_trainer(PipelineConfig.model_validate(spec["config"]),
                                           TokenizeRecord.model_validate(spec["tokenized"]),
                                           Session.model_validate(spec["session"]))
    found["zero3"] = placement()
    parameters = list(trainer.model.parameters())
    whole = type(trainer.model)(trainer.model.config)  # built directly: no zero.Init
    found.update(held=sum(p.numel() for p in parameters), full=sum(p.ds_numel for p in parameters),
                 status=sorted({p.ds_status.name for p in parameters}), packed=packed,
                 expected=sum(p.numel() for p in whole.parameters()))
    open(f"{out}/rank-{os.environ['RANK']}.json", "w").write(json.dumps(found))
"""


def test_zero3_builds_the_model_partitioned_and_qlora_loads_onto_each_ranks_own_gpu(tmp_path: Path) -> None:
    from llmops.config.schema import PipelineConfig
    from llmops.training.launch import CONFIGS, LaunchPlan

    config = PipelineConfig.model_validate({
        "data": {"kind": "text"}, "tokenize": {"max_length": 32}, "train": {"max_steps": 2, "batch_size": 2},
        "model": {"architecture": "llama", "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "intermediate_size": 64}})
    plan = LaunchPlan("deepspeed", 2, 1, "cpu", str(CONFIGS / "deepspeed" / "zero3.json"))
    session = {"folder": str(tmp_path / "train"), "key": "zero3", "plan": plan.__dict__}
    (tmp_path / "spec.json").write_text(json.dumps({"config": config.as_dict(), "session": session,
                                                    "tokenized": synthetic_tokenized().model_dump(mode="json")}))
    torchrun(ZERO3, tmp_path, str(tmp_path / "spec.json"), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, found in enumerate(ranks):
        assert found["local_rank"] == rank
        # QLoRA alone (DDP, ZeRO-2): onto this rank's own GPU, not every rank onto cuda:0
        assert found["ddp"]["device_map"] == {"": f"cuda:{rank}"}
        for sharded in ("fsdp", "zero3"):
            # FSDP and ZeRO-3 place the shards themselves: loaded on the CPU, everything in one float dtype
            assert found[sharded]["device_map"] is None and found[sharded]["dtype"] == "torch.bfloat16"
        for kind in ("ddp", "fsdp", "zero3"):
            assert found[kind]["storage"] == found[kind]["compute"] == "torch.bfloat16"
        # built under zero.Init: each rank holds no whole parameter, the partitions add up to the model
        assert found["status"] == ["NOT_AVAILABLE"] and found["held"] == 0
        assert found["full"] == found["expected"] > 0
        # the packing check ran on the gathered weights
        assert found["packed"] is True


# FSDP2 with gloo: LoRA on the tiny base, each layer fully_shard-ed, three steps; a sharded checkpoint as accelerate
# writes it (a distributed checkpoint per process), then the adapter gathered as the train stage saves it at the end
FSDP2_LORA = """
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from pathlib import Path
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from llmops.config.schema import ModelConfig
    from llmops.models import modeling
    from llmops.training import checkpoints
    base, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model_config = ModelConfig(name_or_path=base, adapter="lora", lora={"r": 4, "dropout": 0.0})
    model = modeling.with_adapter(AutoModelForCausalLM.from_pretrained(base), model_config, "CAUSAL_LM", (), False)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(out / "checkpoint" / "pytorch_model_fsdp_0"))
    checkpoints.save_gathered(model, model, out / "train" / "adapter", dist.get_rank() == 0)
    # the trained adapter as each parameter's own full tensor, gathered independently of the code under test
    trained = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    if dist.get_rank() == 0:
        save_file(trained, str(out / "trained.st"))
    dist.destroy_process_group()
"""


def test_fsdp2_lora_trains_sharded_and_its_gathered_adapter_loads_merges_and_consolidates(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmops.config.schema import PipelineConfig
    from llmops.training.checkpoints import consolidate
    from llmops.training.train import merge_saved_adapter

    base = write_base(tmp_path / "base")
    torchrun(FSDP2_LORA, tmp_path, str(base), str(tmp_path))
    trained = load_file(str(tmp_path / "trained.st"))
    assert trained and all(".lora_" in name for name in trained)
    # the adapter saved at the end loads onto a fresh whole base and holds exactly the trained weights
    adapter = tmp_path / "train" / "adapter"
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter))
    held = {name: p for name, p in loaded.named_parameters() if ".lora_" in name}
    assert {name.replace(".default", "") for name in held} == {name.replace(".default", "") for name in trained}
    for name, tensor in trained.items():
        torch.testing.assert_close(held[name], tensor, rtol=0, atol=0)
    # lora.merge after a sharded training: merged in one process onto a fresh base
    config = PipelineConfig.model_validate({"data": {"kind": "text"}, "model": {
        "name_or_path": str(base), "adapter": "lora", "lora": {"r": 4, "merge": True}}})
    (tmp_path / "train" / "model").mkdir()
    merge_saved_adapter(config, tmp_path / "train")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "train" / "model"))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        adapted, whole = loaded(input_ids=ids).logits, merged(input_ids=ids).logits
        untouched = AutoModelForCausalLM.from_pretrained(str(base))(input_ids=ids).logits
    torch.testing.assert_close(whole, adapted, rtol=1e-4, atol=1e-5)
    assert (whole - untouched).abs().max() > 1e-3
    # the sharded checkpoint consolidates into one file with the same trained weights
    assert consolidate(tmp_path / "checkpoint") == "fsdp"
    consolidated = load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    for name, tensor in trained.items():
        torch.testing.assert_close(consolidated[name], tensor, rtol=0, atol=0)
