"""Packing keeps samples apart: each sample's per-token loss is the same packed with others as alone."""

import random

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from llmops.text.packing import FIGURES, BatchFigures, BatchMeter, PackedRows, pack, packing_is_exact
from llmops.training.tally import Tally

CONFIGS = {
    "llama": LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64),
    "gpt2": GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2),
}


def token_losses(model, batch: dict) -> torch.Tensor:
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:],
                                             ignore_index=-100, reduction="none")


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_per_token_loss_is_the_same_packed_and_alone(architecture: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[architecture]).eval()
    rng = random.Random(0)
    samples = [[rng.randrange(3, 64) for _ in range(rng.randint(4, 30))] for _ in range(12)]
    rows = pack(Dataset.from_dict({"input_ids": samples, "labels": samples}), 48)
    assert len(rows) < len(samples)  # several samples share a row
    collate = PackedRows(pad_token_id=0)
    with torch.no_grad():
        packed = token_losses(model, collate(list(rows)))
        for r, row in enumerate(rows):
            offset = 0
            for length in row["seq_lengths"]:
                sample = row["input_ids"][offset:offset + length]
                alone = token_losses(model, {"input_ids": torch.tensor([sample]), "labels": torch.tensor([sample])})
                torch.testing.assert_close(packed[r, offset:offset + length - 1], alone[0], rtol=1e-5, atol=1e-5)
                # the boundary position predicts nothing across samples
                if offset:
                    assert collate([row])["labels"][0, offset].item() == -100
                offset += length
        assert packing_is_exact(model, samples[:3], pad_token_id=0)


def test_batch_meter_puts_each_training_batchs_figures_in_it_and_the_tally_takes_them_in_order() -> None:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    meter = BatchMeter(DataCollatorForLanguageModeling(pad_token_id=0))
    tally = Tally(meter)
    batch = meter([{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4], "length": 4, "sample_ids": 7},
                   {"input_ids": [1, 2], "labels": [1, 2], "length": 2, "sample_ids": 3}])
    assert "sample_ids" not in batch and batch[FIGURES] == BatchFigures((7, 3), real=6, slots=8, length_sum=6,
                                                                        square_sum=20)
    tally.draw(batch)
    assert FIGURES not in batch  # taken out before the model sees the batch
    # a packed row repeats each sample's id on its tokens
    tally.draw(meter([{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7, 8], "seq_lengths": [3, 1],
                       "sample_ids": [9, 9, 9, 2]}]))
    assert tally.take_ids() == [7, 3] and tally.padding_fraction() == pytest.approx(0.25)
    assert tally.take_ids() == [9, 2] and tally.take_ids() == [] and tally.used_tokens == 10
    # evaluation rows carry no sample ids: their batches go to the model as collated
    assert FIGURES not in meter([{"input_ids": [1, 2], "labels": [1, 2]}])
