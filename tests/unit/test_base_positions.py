"""A model reads at most as many tokens as its position embeddings cover: a longer tokenize.max_length is refused in
one line (at tokenize for a pretrained base, when the config loads for one built here), not met as an index error
deep in training."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import (
    BartConfig,
    BertConfig,
    DebertaV2Config,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    RobertaConfig,
    T5Config,
)

from llmops.core.errors import ConfigError
from llmops.data.synthetic import text_records
from llmops.models.modeling import position_limit
from llmops.text.tokenizers import train_bpe
from tests.conftest import tiny_config
from tests.helpers import data_stages


@pytest.mark.parametrize(("config", "limit"), [
    (GPT2Config(n_positions=16), (16, "n_positions")),
    (BertConfig(max_position_embeddings=64), (64, "max_position_embeddings")),
    # RoBERTa's table starts after the padding index: 514 rows hold 512 positions
    (RobertaConfig(max_position_embeddings=514, pad_token_id=1), (512, "max_position_embeddings")),
    (BartConfig(max_position_embeddings=128), (128, "max_position_embeddings")),
    # rotary and relative positions have no table to run past
    (LlamaConfig(max_position_embeddings=64), None),
    (Qwen2Config(max_position_embeddings=64), None),
    (T5Config(), None),
    (DebertaV2Config(relative_attention=True, position_biased_input=False), None),
])
def test_the_position_limit_is_read_from_the_models_own_config(config: object, limit: tuple | None) -> None:
    assert position_limit(config) == limit


def test_a_max_length_beyond_the_bases_positions_is_refused_at_tokenize(tmp_path: Path,
                                                                          instruction_file: Path) -> None:
    base = tmp_path / "short-gpt2"
    tokenizer = train_bpe((row["text"] for row in text_records(rows=200, seed=3)), 300)
    tokenizer.save_pretrained(base)
    GPT2Config(n_positions=16, vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2).save_pretrained(base)
    config = tiny_config("tiny_sft_cpu.yaml", instruction_file, f"model.name_or_path={base}", "tokenize.max_length=48")
    with pytest.raises(ConfigError) as refused:
        data_stages(config)
    assert str(refused.value) == (f"tokenize.max_length=48 is longer than model {base} reads: its position embeddings "
                                  "cover 16 tokens (n_positions in its config.json): set tokenize.max_length to at "
                                  "most 16")


@pytest.mark.parametrize(("config_file", "architecture", "refused"), [
    ("tiny_pretrain_cpu.yaml", "gpt2", True),
    ("tiny_classify_cpu.yaml", "bert", True),
    ("tiny_mlm_cpu.yaml", "roberta", True),
    ("tiny_pretrain_cpu.yaml", "llama", False),  # rotary: no table to run past
    ("tiny_seq2seq_cpu.yaml", "t5", False),  # relative positions
])
def test_a_model_built_here_refuses_a_max_length_beyond_its_table_when_the_config_loads(
        config_file: str, architecture: str, refused: bool) -> None:
    from llmops.models.architectures import MAX_POSITIONS
    from llmops.objectives import load_config

    overrides = [f"model.architecture={architecture}", f"tokenize.max_length={MAX_POSITIONS + 1}"]
    if not refused:
        assert load_config(f"configs/{config_file}", overrides).tokenize.max_length == MAX_POSITIONS + 1
        return
    with pytest.raises(ConfigError) as refusal:
        load_config(f"configs/{config_file}", overrides)
    message = str(refusal.value)
    assert "\n" not in message and message.startswith(f"configs/{config_file} (override ")
    assert (f"tokenize.max_length: tokenize.max_length={MAX_POSITIONS + 1} is longer than a {architecture} model "
            f"built here reads (its position embeddings cover {MAX_POSITIONS} tokens): set tokenize.max_length to "
            f"at most {MAX_POSITIONS}") in message
    # llama is offered where the objective builds one (not masked LM's encoders)
    assert ("model.architecture=llama" in message) == (config_file != "tiny_mlm_cpu.yaml")
    assert load_config(f"configs/{config_file}", [overrides[0], f"tokenize.max_length={MAX_POSITIONS}"])
