"""The packing check tells its failures apart: a model that mixes packed samples, one that rejects packed batches,
a check that ran out of memory or whose kernel failed to compile; none of them is read as another, and none turns
packing off without a line. Under FSDP or ZeRO-3 the check is skipped, and says so. The errors are torch's own
classes, raised by a model's forward (no GPU here)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, BloomConfig

from llmops.config.schema import DataConfig, TrainConfig
from llmops.models import modeling
from llmops.objectives import selected
from llmops.text import packing
from llmops.training import trainer
from llmops.training.trainer import PackingError, decide_packing

TEXT = selected(DataConfig(kind="text"))
SAMPLES = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]


class Raising(torch.nn.Module):
    """A model whose forward raises `error`, as a kernel that runs out of memory or fails to compile does."""

    def __init__(self, error: BaseException | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(_attn_implementation="flex_attention")
        self.error, self.calls = error, 0

    def forward(self, **batch: Any) -> Any:
        self.calls += 1
        raise self.error or AssertionError("never called")


class PositionsRefused(Raising):
    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:  # type: ignore[override]
        return SimpleNamespace(logits=torch.zeros(1, input_ids.shape[1], 4))


@pytest.fixture
def tokenized(tmp_path: Path) -> Path:
    Dataset.from_dict({"input_ids": SAMPLES, "labels": SAMPLES}).save_to_disk(str(tmp_path / "train"))
    return tmp_path


def test_out_of_memory_is_its_own_line_and_never_a_fallback(tokenized: Path) -> None:
    model = Raising(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    found = packing.check_packing(model, SAMPLES, 0)
    assert not found.exact and found.failure.startswith("it ran out of memory on cpu (CUDA out of memory. Tried")
    for fallback in (False, True):
        with pytest.raises(PackingError, match=r"could not run: it ran out of memory on cpu") as stopped:
            decide_packing(TrainConfig(packing_fallback=fallback), TEXT, model, tokenized, 0)
        assert "does not keep packed samples apart" not in str(stopped.value) and "\n" not in str(stopped.value)


def test_a_kernel_that_fails_to_compile_is_its_own_line(tokenized: Path) -> None:
    from torch._dynamo.exc import InternalTorchDynamoError

    model = Raising(InternalTorchDynamoError("triton: out of resource: shared memory\nRequired: 135168"))
    with pytest.raises(PackingError, match=r"could not run: the attention kernel failed to compile "
                                           r"\(InternalTorchDynamoError: triton: out of resource: shared memory\); "
                                           r"set another model.attention"):
        decide_packing(TrainConfig(packing_fallback=True), TEXT, model, tokenized, 0)


def test_any_other_error_is_named_not_read_as_an_answer(tokenized: Path) -> None:
    found = packing.check_packing(Raising(RuntimeError("CUDA error: an illegal memory access")), SAMPLES, 0)
    assert found == packing.PackingCheck(False, failure="it failed with RuntimeError: CUDA error: an illegal "
                                                        "memory access")


def test_a_wrong_answer_and_a_refused_batch_say_which(tokenized: Path, caplog: pytest.LogCaptureFixture) -> None:
    # BLOOM's ALiBi attention reads no position ids: packed samples see each other
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4))
    found = packing.check_packing(bloom, SAMPLES, 0)
    assert not found.exact and found.failure is None and found.reason.startswith("packed samples get other logits")
    refused = packing.check_packing(PositionsRefused(), SAMPLES, 0)
    assert refused.failure is None and refused.reason.startswith("its forward rejects packed batches")
    with caplog.at_level(logging.WARNING, logger="llmops.train"):
        assert decide_packing(TrainConfig(packing_fallback=True), TEXT, bloom, tokenized, 0) is False
    assert "packing is off (train.packing_fallback)" in caplog.text and "other logits than alone" in caplog.text


@pytest.mark.parametrize("sharding", [{"ACCELERATE_USE_FSDP": "true"}, {}])
def test_sharded_weights_skip_the_check_and_say_so(sharding: dict[str, str], tokenized: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    if sharding:
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    else:  # ZeRO-3, as transformers knows it once the training arguments exist
        monkeypatch.setattr("transformers.integrations.is_deepspeed_zero3_enabled", lambda: True)
    model = Raising()
    with caplog.at_level(logging.WARNING, logger="llmops.train"):
        assert decide_packing(TrainConfig(), TEXT, model, tokenized, 0) is True
    assert model.calls == 0 and "packing check skipped: the weights are sharded (FSDP or ZeRO-3)" in caplog.text


@pytest.mark.parametrize(("capability", "expected"), [((7, 5), torch.float16), ((7, 0), torch.float16),
                                                      ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_the_check_computes_in_the_cards_own_half_type(capability: tuple[int, int], expected: torch.dtype,
                                                       tokenized: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = {}

    def check(model: Any, samples: Any, pad: int, device: Any = None, half: Any = None) -> packing.PackingCheck:
        asked.update(device=device, half=half)
        return packing.PackingCheck(True)

    monkeypatch.setattr(modeling, "cuda_capability", lambda: capability)
    monkeypatch.setattr(trainer, "checking_device", lambda: "cuda:0")
    monkeypatch.setattr(packing, "check_packing", check)
    assert decide_packing(TrainConfig(), TEXT, Raising(), tokenized, 0)
    assert asked == {"device": "cuda:0", "half": expected}
