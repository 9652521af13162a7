"""The SFT trainer reads its figures (entropy, token accuracy, tokens) at logging steps only, not at every step as
TRL's SFTTrainer does, and logs TRL's loss and figures: both train the same tiny model on the CPU, every host read of
a tensor's value (`.item()`, `.tolist()`, truth tests) counted where it is made (moved from tests/unit: it trains
models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.test_attention_choice import word_tokenizer


class SyncCounter:
    """Counts the reads of a tensor's value on the host (`.item()`, `.tolist()`, truth tests), each of which waits for
    the device's queued work, made by `compute_loss` around the model (every micro-step), by the model's forward
    (its own mask building: not the trainer's) and by `log` (logging steps)."""

    def __init__(self, trainer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.where: str | None = None
        self.counts = {"compute_loss": 0, "log": 0, "model": 0}
        for name in ("item", "tolist", "__bool__"):
            monkeypatch.setattr(torch.Tensor, name, self.counted(getattr(torch.Tensor, name)))
        for method in ("compute_loss", "log"):
            monkeypatch.setattr(trainer, method, self.inside(method, getattr(trainer, method)))
        monkeypatch.setattr(trainer.model, "forward", self.inside("model", trainer.model.forward))

    def counted(self, original):  # noqa: ANN001, ANN202
        def read(tensor: torch.Tensor, *args: object):  # noqa: ANN202
            if self.where is not None:
                self.counts[self.where] += 1
            return original(tensor, *args)

        return read

    def inside(self, where: str, method):  # noqa: ANN001, ANN202
        def run(*args: object, **kwargs: object):  # noqa: ANN202
            outer, self.where = self.where, where
            try:
                return method(*args, **kwargs)
            finally:
                self.where = outer

        return run


def sft_trainer(trainer_class: type, steps: int, tmp_path: Path):  # noqa: ANN201 - an SFTTrainer
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    ids = [[1 + (i * 7 + j) % 60 for j in range(6 + i % 3)] for i in range(16)]
    arguments = SFTConfig(output_dir=str(tmp_path / f"out-{trainer_class.__name__}-{steps}"), max_steps=steps,
                          per_device_train_batch_size=2, logging_steps=4, report_to=[], use_cpu=True,
                          save_strategy="no", disable_tqdm=True, logging_nan_inf_filter=False, max_length=None,
                          dataset_kwargs={"skip_prepare_dataset": True}, seed=0)
    return trainer_class(model=model, args=arguments, train_dataset=Dataset.from_dict({"input_ids": ids}),
                         data_collator=DataCollatorForLanguageModeling(pad_token_id=0),
                         processing_class=word_tokenizer())


def trained(trainer_class: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], dict]:
    """8 steps, a log every 4: the logged figures, and the host reads inside compute_loss and log."""
    trainer = sft_trainer(trainer_class, 8, tmp_path)
    with monkeypatch.context() as patched:
        counter = SyncCounter(trainer, patched)
        trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry], counter.counts


def test_the_sft_trainer_reads_its_figures_at_logging_steps_only_and_they_are_trls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trl import SFTTrainer

    from llmops.objectives.sft_trainer import sft_trainer_class

    theirs, trl_reads = trained(SFTTrainer, tmp_path, monkeypatch)
    ours, reads = trained(sft_trainer_class(), tmp_path, monkeypatch)
    assert trl_reads["compute_loss"] >= 4 * 8  # TRL: at least 4 reads at every step (a truth test, 3 .item())
    assert reads["compute_loss"] == 0 and reads["log"] == 2  # one read of the summed figures per log
    assert len(ours) == len(theirs) == 2
    for mine, trl in zip(ours, theirs, strict=True):
        assert mine["loss"] == pytest.approx(trl["loss"], rel=1e-5)
        assert mine["num_tokens"] == trl["num_tokens"]
        # token-weighted means over the 4 steps (TRL's: the mean of each step's mean)
        assert mine["mean_token_accuracy"] == pytest.approx(trl["mean_token_accuracy"], abs=0.05)
        assert mine["entropy"] == pytest.approx(trl["entropy"], rel=0.05)


def test_on_cpu_the_model_s_own_logits_give_the_fused_head_s_loss_figures_and_gradients() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from llmops.objectives.sft_trainer import LOGITS_BYTES, fused_head, plain_head

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(1, 96, (3, 10))
    labels = ids.clone()
    labels[:, :4] = -100  # the prompt's tokens
    labels[2, 7:] = -100  # padding
    inputs = {"input_ids": ids, "attention_mask": (labels != -100) | (torch.arange(10) < 4), "labels": labels,
              "use_cache": False}
    assert not fused_head(model, inputs)
    assert fused_head(model, {**inputs, "input_ids": torch.zeros(1, LOGITS_BYTES // (4 * 96) + 1, dtype=torch.long)})
    found = {}
    for name, outputs in (("fused", lambda: model(**inputs, fused_lm_head=True)),
                          ("plain", lambda: plain_head(model, inputs))):
        model.zero_grad()
        out = outputs()
        (-out.log_probs.sum()).backward()
        found[name] = ([float(out.log_probs.sum()), int(out.label_mask.sum()), float(out.entropy.sum()),
                        int(out.is_top1.sum())], [p.grad.clone() for p in model.parameters()])
    assert found["plain"][0][1] == found["fused"][0][1] == 6 + 6 + 3  # labels from the 5th token, less padding
    assert found["plain"][0] == pytest.approx(found["fused"][0], rel=1e-5)
    for plain, fused in zip(found["plain"][1], found["fused"][1], strict=True):
        torch.testing.assert_close(plain, fused, rtol=1e-4, atol=1e-6)
