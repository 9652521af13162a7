"""`llmops models export` end to end (slow): a registered LoRA version as a folder that from_pretrained loads, with
the same logits as the registered version."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.tracking import log as tracking
from tests.conftest import tiny_config
from tests.helpers import run_all_stages

runner = CliRunner()


@pytest.mark.slow
def test_an_exported_lora_version_loads_with_from_pretrained_and_gives_the_registered_logits(
        pretrained_base: Path, instruction_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = tiny_config("tiny_sft_cpu.yaml", instruction_file, f"model.name_or_path={pretrained_base}",
                         "model.adapter=lora", "train.max_steps=20", "evaluate.max_examples=8",
                         "register.model_name=exported")
    run_all_stages(config, "export-test")
    target = tmp_path / "exported"
    result = runner.invoke(app, ["models", "export", "exported/1", str(target)])
    assert result.exit_code == 0, result.output
    assert "adapter merged into its base" in result.output
    files = {p.name for p in target.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= files
    assert not [name for name in files if name.endswith((".bin", ".pt", ".pth", ".pkl"))]
    card = (target / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text-generation") and "exported" in card

    exported = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    assert tokenizer.chat_template  # the one the model was trained with
    tracking.client(config.tracking)
    registered = mlflow.transformers.load_model("models:/exported/1", return_type="components")["model"].eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write this number in words.\n\n42"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        torch.testing.assert_close(exported(**prompt).logits, registered(**prompt).logits, rtol=1e-4, atol=1e-4)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pushed = runner.invoke(app, ["models", "export", "exported/1", str(tmp_path / "again"), "--to-hub", "me/model"])
    assert pushed.exit_code == 2
    lines = pushed.output.strip().splitlines()
    assert "error: could not push" in lines[-1] and "me/model" in lines[-1]
    assert "Traceback" not in pushed.output
