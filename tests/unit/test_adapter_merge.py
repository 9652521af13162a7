"""lora.merge of a QLoRA training: never into the 4-bit base (which would round the deltas to 4 bits), always onto
a fresh base loaded unquantized, as after a sharded training. bitsandbytes cannot run here: the 4-bit base is the
config's (model.adapter=qlora); the base, adapter, Trainer and merge are real."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from llmops.config.schema import PipelineConfig
from llmops.training import checkpoints, train, trainer
from tests.unit.test_attention_choice import word_tokenizer


def write_base(folder: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize(("adapter", "fsdp", "expected"), [("lora", False, True), ("qlora", False, False),
                                                           ("lora", True, False), ("qlora", True, False)])
def test_only_an_unsharded_unquantized_model_merges_in_process(adapter: str, fsdp: bool, expected: bool) -> None:
    found = SimpleNamespace(is_fsdp_enabled=fsdp, is_deepspeed_enabled=False)
    assert trainer.merges_in_process(found, adapter) is expected


def test_a_qlora_merge_goes_onto_a_fresh_unquantized_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = write_base(tmp_path / "base")
    # a trained adapter: B is not zero (as it is at init), so merging changes the weights
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    pipeline = PipelineConfig.model_validate({"data": {"kind": "text"}, "model": {
        "name_or_path": str(base), "adapter": "qlora", "lora": {"r": 4, "merge": True}}})
    arguments = TrainingArguments(output_dir=str(tmp_path / "checkpoints"), use_cpu=True, report_to=[])
    folder = tmp_path / "train"
    trainer.save(Trainer(model=model, args=arguments), word_tokenizer(), pipeline, folder / "model")
    # the training saved the adapter only; nothing was merged into the (4-bit) model it trained
    assert (folder / checkpoints.ADAPTER_DIR / "adapter_config.json").is_file()
    assert not list((folder / "model").glob("*.safetensors"))
    loaded = []
    load_adapter = type(train.selected(pipeline.data)).load_adapter

    def spy(self, adapter_dir: Path, labels: list[str]):  # noqa: ANN001, ANN202
        loaded.append(load_adapter(self, adapter_dir, labels))
        return loaded[-1]

    monkeypatch.setattr(type(train.selected(pipeline.data)), "load_adapter", spy)
    train.merge_saved_adapter(pipeline, folder)
    base_model = loaded[0].get_base_model()
    assert not getattr(base_model, "is_loaded_in_4bit", False)
    assert {p.dtype for p in base_model.parameters()} == {torch.float32}
    merged = load_file(str(folder / "model" / "model.safetensors"))
    assert all(tensor.dtype == torch.float32 for tensor in merged.values())
    ids = torch.tensor([[3, 9, 17, 33, 41]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        whole = AutoModelForCausalLM.from_pretrained(str(folder / "model"))(input_ids=ids).logits
        untouched = AutoModelForCausalLM.from_pretrained(str(base))(input_ids=ids).logits
    torch.testing.assert_close(whole, adapted, rtol=1e-4, atol=1e-5)
    assert (whole - untouched).abs().max() > 1e-3
