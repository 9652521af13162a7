"""The GPU paths' choices that need no GPU: how a 4-bit base is loaded, which launch file QLoRA under FSDP runs,
offload without a JIT-compiled optimizer, the smoke trainings' configs and the device check's plan."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmops.config.schema import PipelineConfig, TrainConfig
from llmops.models.modeling import quantized_loading
from llmops.training.launch import CONFIGS, LaunchPlan, fitted_to_adapter

REPO = Path(__file__).resolve().parents[2]


def test_a_4bit_base_loads_onto_this_ranks_gpu_alone_and_on_the_cpu_in_one_dtype_when_sharded() -> None:
    alone = quantized_loading(torch.bfloat16, "cuda:3", sharded=False)
    assert alone["device_map"] == {"": "cuda:3"} and "dtype" not in alone
    sharded = quantized_loading(torch.float16, "cuda:3", sharded=True)
    assert "device_map" not in sharded and sharded["dtype"] is torch.float16
    for settings, dtype in ((alone, torch.bfloat16), (sharded, torch.float16)):
        quantize = settings["quantization"]
        assert quantize["bnb_4bit_quant_storage"] is quantize["bnb_4bit_compute_dtype"] is dtype
        assert quantize["load_in_4bit"] and quantize["bnb_4bit_quant_type"] == "nf4"


def test_qlora_under_fsdp_runs_the_fsdp_qlora_recipe_unless_the_user_names_a_file() -> None:
    fsdp = LaunchPlan("fsdp", 4, 1, "cuda", str(CONFIGS / "accelerate" / "fsdp_full_shard.yaml"))
    assert Path(fitted_to_adapter(fsdp, TrainConfig(), "qlora").config_file).name == "fsdp_qlora.yaml"
    assert fitted_to_adapter(fsdp, TrainConfig(), "lora") == fsdp
    assert fitted_to_adapter(fsdp, TrainConfig(launch_config="mine.yaml"), "qlora") == fsdp
    zero3 = LaunchPlan("deepspeed", 4, 1, "cuda", str(CONFIGS / "deepspeed" / "zero3.json"))
    assert fitted_to_adapter(zero3, TrainConfig(), "qlora") == zero3


@pytest.mark.parametrize("name", ["zero2_offload_optimizer.json", "zero3_offload_optimizer.json", "zero3_offload.json"])
def test_offload_steps_the_trainers_own_adamw_so_nothing_is_compiled(name: str) -> None:
    settings = json.loads((CONFIGS / "deepspeed" / name).read_text())
    # a DeepSpeed optimizer section would make it use its CPU Adam, JIT-compiled on first use
    assert "optimizer" not in settings and settings["zero_force_ds_cpu_optimizer"] is False
    assert settings["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_the_smoke_trainings_are_valid_configs_of_one_process() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import smoke_train

    for check in ("zero2", "zero3", "fsdp2", "qlora"):
        config = PipelineConfig.model_validate(smoke_train.overrides(check, "/base"))
        assert config.train.processes == 1 and config.train.max_steps == smoke_train.STEPS
    assert PipelineConfig.model_validate(smoke_train.overrides("zero3", None)).train.zero_stage == 3
    fsdp2 = PipelineConfig.model_validate(smoke_train.overrides("fsdp2", "/base"))
    assert (fsdp2.train.distributed, fsdp2.model.adapter, fsdp2.model.lora.merge) == ("fsdp", "lora", True)


def test_the_device_check_plans_every_step_within_eight_minutes_from_a_short_command() -> None:
    result = subprocess.run(["bash", "bench/device_check.sh", "--plan"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("step "))):]
    assert table == lines[-len(table):]  # the summary table comes last
    steps = {line.split()[0]: line for line in table[1:]}
    assert {"bench-llama1b", "bench-gpt2", "smoke-zero2", "smoke-zero3", "smoke-fsdp2", "smoke-qlora"} <= set(steps)
    assert "--shape llama1b" in steps["bench-llama1b"] and "smoke_train.py qlora" in steps["smoke-qlora"]
    limits = [int(re.search(r"timeout (\d+)s", line).group(1)) for name, line in steps.items() if name != "wheels"]
    budget = int(re.search(r"\(budget (\d+)s;", result.stdout)[1])
    assert sum(limits) < budget < 8 * 60
    # the README's command that starts it (copying the tree and wheels there included) fits in 2,000 characters
    readme = (REPO / "README.md").read_text()
    start = re.search(r"<!-- device-check -->\n```bash\n(.*?)```", readme, re.S)
    assert start and "bench/device_check.sh" in start[1] and len(start[1].strip()) <= 2000


def test_the_dry_smoke_trainings_train_in_one_plain_process_and_qlora_without_bitsandbytes_is_not_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    sys.path.insert(0, str(REPO / "bench"))
    import smoke_train

    for check in ("zero2", "zero3", "fsdp2"):
        dry = PipelineConfig.model_validate(smoke_train.overrides(check, "/base", dry=True))
        assert dry.train.distributed == "none" and dry.train.max_steps == smoke_train.STEPS
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    assert "bitsandbytes is not installed" in smoke_train.missing_requirement("qlora", dry=False)


def test_the_gpu_tests_are_collected_where_prefect_and_mlflow_are_absent() -> None:
    # a bare GPU machine has neither: importing the module must not need them (the test that does skips itself)
    code = ("import sys; sys.modules.update(prefect=None, mlflow=None); import tests.gpu.test_gpu_training as t; "
            "print(sorted(name for name in dir(t) if name.startswith('test_')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "test_sharded_training_registers_a_model_that_generates" in result.stdout
