"""Launch plans, launcher command lines, the shipped DeepSpeed and FSDP files, and throughput arithmetic."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.config.scale import RendezvousConfig
from llmops.config.schema import TrainConfig
from llmops.io.errors import ConfigError
from llmops.training import throughput
from llmops.training.launch import (
    LaunchError,
    LaunchPlan,
    TrainingFailedError,
    command,
    launch_config_file,
    plan_launch,
    run_workers,
)

REPO = Path(__file__).resolve().parents[2]
needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")


@needs_cpu_only
def test_auto_is_one_process_on_cpu_and_ddp_when_asked_for_more() -> None:
    assert plan_launch(TrainConfig()) == LaunchPlan(strategy="none", processes=1, nodes=1, device="cpu")
    two = plan_launch(TrainConfig(processes=2))
    assert (two.strategy, two.world_size, two.inline) == ("ddp", 2, False)
    assert plan_launch(TrainConfig(distributed="ddp", processes=2, nodes=3)).world_size == 6


@needs_cpu_only
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sharded_strategies_refuse_to_run_without_a_gpu(strategy: str) -> None:
    with pytest.raises(LaunchError, match=rf"train.distributed={strategy} needs CUDA GPUs"):
        plan_launch(TrainConfig(distributed=strategy, processes=2))


def test_one_process_cannot_be_spread() -> None:
    with pytest.raises(LaunchError, match="train.distributed=none trains in one process"):
        plan_launch(TrainConfig(distributed="none", processes=2))


def test_the_options_choose_the_shipped_files() -> None:
    pick = launch_config_file
    assert pick(TrainConfig(zero_stage=2), "deepspeed").name == "zero2.json"
    assert pick(TrainConfig(zero_stage=3, offload="optimizer"), "deepspeed").name == "zero3_offload_optimizer.json"
    assert pick(TrainConfig(zero_stage=3, offload="optimizer_and_parameters"), "deepspeed").name == "zero3_offload.json"
    assert pick(TrainConfig(fsdp_sharding="hybrid"), "fsdp").name == "fsdp_hybrid_shard.yaml"
    for path in [pick(TrainConfig(zero_stage=s), "deepspeed") for s in (2, 3)]:
        assert path.is_file()
    with pytest.raises(LaunchError, match="train.launch_config: no such file"):
        pick(TrainConfig(launch_config="configs/deepspeed/missing.json"), "deepspeed")


def test_launcher_command_lines(tmp_path: Path) -> None:
    spec = tmp_path / "run-1" / "spec.json"
    single = command(LaunchPlan("ddp", 2, 1, "cpu"), RendezvousConfig(), spec)
    assert single[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in single
    assert single[single.index("--nproc-per-node") + 1] == "2"
    assert single[-3:] == ["-m", "llmops.training.worker", str(spec)]
    multi = command(LaunchPlan("ddp", 8, 2, "cuda"), RendezvousConfig(node_rank=1, main_address="10.0.0.5",
                                                                        main_port=29600), spec)
    assert multi[multi.index("--master-addr") + 1] == "10.0.0.5" and multi[multi.index("--node-rank") + 1] == "1"
    assert multi[multi.index("--rdzv-conf") + 1] == "timeout=600"  # the static rendezvous's wait, as configured
    meet = command(LaunchPlan("deepspeed", 8, 4, "cuda", "configs/deepspeed/zero3.json"),
                   RendezvousConfig(endpoint="head:29400"), spec)
    assert meet[meet.index("--rdzv-endpoint") + 1] == "head:29400" and "--standalone" not in meet
    assert meet[meet.index("--rdzv-conf") + 1] == "join_timeout=600"
    fsdp = command(LaunchPlan("fsdp", 4, 1, "cuda", "configs/accelerate/fsdp_full_shard.yaml"), RendezvousConfig(),
                   spec)
    assert fsdp[1:3] == ["-m", "accelerate.commands.launch"]
    assert fsdp[fsdp.index("--config_file") + 1].endswith("fsdp_full_shard.yaml")
    assert fsdp[fsdp.index("--num_processes") + 1] == "4"


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs" / "deepspeed").glob("*.json")))
def test_deepspeed_files_pass_deepspeeds_own_parser(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                         intermediate_size=64, vocab_size=100))
    args = TrainingArguments(output_dir=str(REPO / ".llmops-none"), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, use_cpu=True, report_to=[])
    hf_config = HfTrainerDeepSpeedConfig(str(REPO / "configs" / "deepspeed" / name))
    hf_config.trainer_config_process(args)  # the Trainer's "auto" values, filled in as a training would
    hf_config.trainer_config_finalize(args, model, 100)
    parsed = DeepSpeedConfig(hf_config.config)
    del hf_config
    assert parsed.zero_optimization_stage == int(name[4]) and parsed.train_batch_size == 8
    assert (parsed.zero_config.offload_param is not None) == name.endswith("_offload.json")
    assert (parsed.zero_config.offload_optimizer is not None) == ("offload" in name)


def test_deepspeeds_parser_refuses_a_misspelt_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    broken = json.loads((REPO / "configs" / "deepspeed" / "zero2.json").read_text())
    broken["zero_optimization"]["stagee"] = 2
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        broken[key] = 1
    broken["gradient_clipping"] = 1.0
    broken["bf16"] = broken["fp16"] = {"enabled": False}
    with pytest.raises(Exception, match="stagee"):
        DeepSpeedConfig(broken)


@pytest.mark.parametrize(("name", "expected"), [
    # FSDP2, sharded checkpoints, weights read on one process
    ("fsdp_full_shard.yaml", "2 TRANSFORMER_BASED_WRAP SHARDED_STATE_DICT true true"),
    ("fsdp_hybrid_shard.yaml", "1 TRANSFORMER_BASED_WRAP SHARDED_STATE_DICT true true"),
    # the FSDP-QLoRA recipe: FSDP1 with flat parameters over one float storage dtype
    ("fsdp_qlora.yaml", "1 TRANSFORMER_BASED_WRAP SHARDED_STATE_DICT true false")])
def test_fsdp_files_are_read_by_accelerate_launch_into_its_fsdp_plugin(name: str, expected: str,
                                                                        tmp_path: Path) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    path = REPO / "configs" / "accelerate" / name
    assert str(load_config_from_file(str(path)).distributed_type) == "DistributedType.FSDP"
    # what the launcher hands the workers, from which accelerate's FSDP plugin is built (that needs a GPU)
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint('FSDP', *(os.environ.get(k) for k in ('ACCELERATE_USE_FSDP', 'FSDP_VERSION', "
                     "'FSDP_AUTO_WRAP_POLICY', 'FSDP_STATE_DICT_TYPE', 'FSDP_CPU_RAM_EFFICIENT_LOADING', "
                     "'FSDP_USE_ORIG_PARAMS')))\n")
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path),
                             "--num_processes", "1", "--main_process_port", str(free_port()), str(probe)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"FSDP true {expected}" in result.stdout


def test_flops_per_token_and_mfu_follow_the_projects_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=128))
    without_positions = sum(p.numel() for n, p in model.named_parameters() if "wpe" not in n)
    assert throughput.flops_per_token(model, 128) == 6 * without_positions + 12 * 2 * 64 * 128
    monkeypatch.setenv("LLMOPS_PEAK_TFLOPS", "100")
    rates = throughput.throughput(tokens=1_000_000, seconds=10, per_token_flops=6e9, world_size=2)
    assert rates == {"tokens_per_s": 100_000.0, "tflops_per_device": 300.0, "mfu": 3.0, "peak_tflops": 100.0}
    monkeypatch.delenv("LLMOPS_PEAK_TFLOPS")
    if not torch.cuda.is_available():
        assert throughput.throughput(1000, 1.0, 1e6, 1)["mfu"] is None  # no guess for a CPU


@needs_cpu_only
def test_a_strategy_this_machine_cannot_run_is_one_line_before_any_work() -> None:
    for override, expected in [("train.distributed=fsdp", "train.distributed=fsdp needs CUDA GPUs"),
                               ("train.distributed=tensor", "train.distributed: input should be 'auto', 'none'")]:
        result = CliRunner().invoke(app, ["run", "configs/tiny_sft_cpu.yaml", override, "train.processes=2"])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in result.output



def test_a_node_rank_beyond_the_nodes_is_refused() -> None:
    from llmops.objectives import load_config

    with pytest.raises(ConfigError, match=r"launch.rendezvous.node_rank=2 but train.nodes=2: the machines' ranks run "
                                          r"from 0 to 1$"):
        load_config(REPO / "configs" / "tiny_sft_cpu.yaml", ["train.nodes=2", "launch.rendezvous.node_rank=2"])


def test_machines_that_never_all_meet_end_the_launch_in_one_line_after_the_timeout(tmp_path: Path) -> None:
    """Node rank 1 of 2 alone, with torchrun's real static rendezvous: it gives up after the configured wait."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = RendezvousConfig(node_rank=1, main_port=port, timeout=3)
    (tmp_path / "run").mkdir()
    with pytest.raises(TrainingFailedError) as raised:
        run_workers(LaunchPlan("ddp", 1, 2, "cpu"), config, tmp_path / "run" / "spec.json", tmp_path / "run")
    assert str(raised.value).startswith(
        f"the 2 machines of train.nodes did not all meet at 127.0.0.1:{port} within 3 s (this one is node rank 1): "
        "start the same run on every machine, each with its own launch.rendezvous.node_rank and a main_address all of "
        f"them reach; full output in {tmp_path / 'run' / 'logs' / 'workers.log'}")


def free_port() -> int:
    """A port nothing listens on: the parametrized launches run at once on several workers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
