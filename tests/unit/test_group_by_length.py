"""train.group_by_length groups similar lengths on an unpacked run: the real Trainer of the objective (TRL's
SFTTrainer for instructions, transformers' Trainer for text), built with the project's arguments, draws batches of
rows of similar length from its train dataloader, so a batch pads far less; without it the order is random and a
batch spans most of the lengths there are."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig

from llmops.config.schema import DataConfig, PipelineConfig, TrainConfig
from llmops.objectives import selected
from llmops.training.launch import LaunchPlan
from llmops.training.tally import Tally
from llmops.training.trainer import common_arguments

ROWS, BATCH, LONGEST = 400, 4, 120


def tokenized(folder: Path) -> list[int]:
    """A tokenize stage's splits, rows of 2 to LONGEST tokens in random order; the train rows' lengths."""
    lengths = random.Random(7).choices(range(2, LONGEST + 1), k=ROWS)
    ids = [[(index + token) % 60 + 1 for token in range(length)] for index, length in enumerate(lengths)]
    columns = {"input_ids": ids, "labels": ids, "raw_length": lengths, "length": lengths}
    for split in ("train", "eval"):
        Dataset.from_dict(columns).save_to_disk(str(folder / split))
    return lengths


def word_tokenizer():  # noqa: ANN201 - a tokenizer
    """A real tokenizer of 64 words, pad id 0."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<end>": 1} | {f"w{i}": i for i in range(2, 64)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w2")), pad_token="<pad>", eos_token="<end>"
    )


def batches(kind: str, group_by_length: bool, folder: Path) -> tuple[list[list[int]], Tally]:
    """The lengths of the rows of each batch the objective's Trainer draws in one epoch (the ids its collator
    recorded), and what the collator counted."""
    lengths = tokenized(folder)
    config = TrainConfig(batch_size=BATCH, packing=False, group_by_length=group_by_length, max_steps=-1)
    objective = selected(DataConfig(kind=kind))
    arguments = objective.arguments(common_arguments(config, folder, False, LaunchPlan("none", 1, 1, "cpu")),
                                    PipelineConfig(train=config))
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    )
    train_set, _ = objective.datasets(folder, False, LONGEST)
    tokenizer = word_tokenizer()
    tally = Tally(objective.meter(tokenizer, model, False, LONGEST, config.seed))
    settings = {
        "args": arguments,
        "train_dataset": train_set,
        "processing_class": tokenizer,
        "data_collator": tally.meter,
    }
    trainer = objective.trainer(model, settings, None, tokenizer, config.seed)
    drawn = []
    for batch in trainer.get_train_dataloader():
        tally.draw(batch)
        drawn.append(tally.take_ids())
    assert sorted(sum(drawn, [])) == list(range(len(lengths)))  # each row once in the epoch
    return [[lengths[index] for index in ids] for ids in drawn], tally


def spread(batched: list[list[int]]) -> float:
    """The mean, over the batches, of the longest row's length less the shortest's."""
    return sum(max(lengths) - min(lengths) for lengths in batched) / len(batched)


@pytest.mark.parametrize("kind", ["instruction", "text"])
def test_group_by_length_draws_batches_of_similar_length(kind: str, tmp_path: Path) -> None:
    grouped, grouped_tally = batches(kind, True, tmp_path / "grouped")
    shuffled, shuffled_tally = batches(kind, False, tmp_path / "shuffled")
    assert len(grouped) == len(shuffled) == ROWS // BATCH
    # random batches of 4 out of 2..120 tokens span about 3/5 of the range; sorted ones a few tokens
    assert spread(shuffled) > 0.4 * LONGEST
    assert spread(grouped) < 0.15 * spread(shuffled)
    # each batch is padded to its longest row: grouped, hardly any padding
    assert grouped_tally.used_tokens == shuffled_tally.used_tokens
    assert grouped_tally.padding_fraction() < 0.1 and shuffled_tally.padding_fraction() > 0.3
    print(
        f"\n{kind}: mean length spread in a batch {spread(grouped):.1f} grouped, {spread(shuffled):.1f} random; "
        f"padding {grouped_tally.padding_fraction():.3f} vs {shuffled_tally.padding_fraction():.3f}"
    )
