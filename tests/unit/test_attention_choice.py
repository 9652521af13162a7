"""The attention kernel each architecture trains with, on what a machine offers: only the capability probe is set
(CUDA present or not, FlashAttention installed or not); the model classes and their own flags are transformers'."""

from __future__ import annotations

import pytest
import torch

from llmops.config.schema import DataConfig, ModelConfig
from llmops.io.errors import UserError
from llmops.models import modeling
from llmops.models.modeling import Capabilities
from llmops.objectives import selected
from llmops.text import packing

# the record kind whose default objective builds each architecture from scratch
KINDS = {"llama": "text", "gpt2": "text", "bert": "text", "roberta": "text", "t5": "seq2seq"}
OBJECTIVES = {"bert": "masked_lm", "roberta": "masked_lm"}
CPU = Capabilities(cuda=False)
HOPPER = Capabilities(cuda=True, major=9)
HOPPER_FA2 = Capabilities(cuda=True, major=9, flash=("flash_attention_2",))
HOPPER_FA4 = Capabilities(cuda=True, major=9, flash=("flash_attention_4", "flash_attention_2"))

EXPECTED = {  # architecture: (CPU, CUDA without FlashAttention, with FA2, with FA4 and FA2)
    "llama": ("sdpa", "flex_attention", "flash_attention_2", "flash_attention_4"),
    # GPT-2 has no flex_attention: sdpa with packed rows, never flex
    "gpt2": ("sdpa", "sdpa", "flash_attention_2", "flash_attention_4"),
    "bert": ("sdpa", "flex_attention", "flash_attention_2", "flash_attention_4"),
    "roberta": ("sdpa", "flex_attention", "flash_attention_2", "flash_attention_4"),
    # T5 has no FlashAttention
    "t5": ("sdpa", "flex_attention", "flex_attention", "flex_attention"),
}


def objective_of(architecture: str):  # noqa: ANN201 - an Objective
    return selected(DataConfig(kind=KINDS[architecture], objective=OBJECTIVES.get(architecture)))


@pytest.mark.parametrize("architecture", sorted(EXPECTED))
def test_auto_picks_what_the_machine_offers_and_the_class_supports(architecture: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    objective = objective_of(architecture)
    chosen = []
    for capabilities in (CPU, HOPPER, HOPPER_FA2, HOPPER_FA4):
        monkeypatch.setattr(modeling, "device_capabilities", lambda found=capabilities: found)
        chosen.append(objective.attention(ModelConfig(architecture=architecture)))
    assert tuple(chosen) == EXPECTED[architecture]


def test_gpt2_on_cuda_without_flash_builds_with_sdpa_and_packs_in_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """What crashed before: GPT-2 given flex_attention. Now sdpa, its packed rows kept apart (the check passes)."""
    monkeypatch.setattr(modeling, "device_capabilities", lambda: HOPPER)
    config = ModelConfig(architecture="gpt2", hidden_size=32, num_layers=2, num_heads=4)
    objective = objective_of("gpt2")
    model = objective.build_model(config, word_tokenizer(), seed=0, labels=[])
    assert model.config._attn_implementation == "sdpa"
    assert isinstance(packing.packed_collator(model, pad_token_id=0, max_length=32), packing.PackedRows)
    samples = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    assert packing.packing_is_exact(model, samples, pad_token_id=0, device=torch.device("cpu"))


def test_a_kernel_the_class_does_not_support_is_one_line() -> None:
    with pytest.raises(UserError, match="model.attention=flex_attention: GPT2LMHeadModel does not support it"):
        objective_of("gpt2").attention(ModelConfig(architecture="gpt2", attention="flex_attention"))
    with pytest.raises(UserError, match="T5ForConditionalGeneration does not support it"):
        objective_of("t5").attention(ModelConfig(architecture="t5", attention="flash_attention_2"))
    assert objective_of("llama").attention(ModelConfig(attention="eager")) == "eager"


def test_a_class_known_only_once_loaded_gets_the_kernel_every_model_has() -> None:
    assert modeling.attention_for(ModelConfig(), None, HOPPER) == "sdpa"
    assert modeling.attention_for(ModelConfig(), None, HOPPER_FA2) == "sdpa"
    assert modeling.attention_for(ModelConfig(attention="flash_attention_2"), None, CPU) == "flash_attention_2"


def test_what_a_class_supports_is_remembered_by_what_decides_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding a class imports its modeling code (seconds, on every plan): each architecture is asked once a
    workspace, and the remembered answer chooses as the class would."""
    objective = objective_of("llama")
    asked: list[str] = []
    real = type(objective).kernel_support
    monkeypatch.setattr(type(objective), "kernel_support",
                        lambda self, config: asked.append(config.architecture) or real(self, config))
    monkeypatch.setattr(modeling, "device_capabilities", lambda: HOPPER)
    chosen = [objective.attention(ModelConfig(architecture=name)) for name in ("llama", "gpt2", "llama", "gpt2")]
    assert asked == ["llama", "gpt2"] and chosen == ["flex_attention", "sdpa"] * 2


def test_a_machine_without_a_gpu_device_answers_without_torch(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from llmops.training import launch

    monkeypatch.setattr(modeling, "GPU_DEVICE_NODES", (str(tmp_path / "nvidia[0-9]*"),))
    assert not modeling.may_have_gpu() and modeling.device_capabilities() == CPU and launch.gpu_count() == 0
    (tmp_path / "nvidia0").touch()
    assert modeling.may_have_gpu()  # then torch is asked, and says what it sees
    assert modeling.device_capabilities().cuda == torch.cuda.is_available()
    assert launch.gpu_count() == torch.cuda.device_count()


def word_tokenizer():  # noqa: ANN201 - a tokenizer
    """A real tokenizer of 64 words, pad id 0, end id 1."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<end>": 1} | {f"w{i}": i for i in range(2, 64)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w2")),
                                   pad_token="<pad>", eos_token="<end>", bos_token="<end>")
