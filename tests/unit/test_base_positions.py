"""A model reads at most as many tokens as its position embeddings cover: a longer tokenize.max_length is refused in
one line (at tokenize for a pretrained base, when the config loads for one built here), not met as an index error
deep in training; a prompt to generate from keeps its end within the positions that max_new_tokens leaves."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import (
    BartConfig,
    BertConfig,
    DebertaV2Config,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    Qwen2Config,
    RobertaConfig,
    T5Config,
)

from llmops.data.synthetic import text_records
from llmops.io.errors import ConfigError
from llmops.models.modeling import position_limit
from llmops.objectives.language import generate
from llmops.text.templates import render
from llmops.text.tokenizers import prepare_tokenizer, train_bpe
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


def test_a_prompt_longer_than_the_positions_left_beside_max_new_tokens_keeps_its_end(
        caplog: pytest.LogCaptureFixture) -> None:
    """A learned table of 32 positions and 8 new tokens: a prompt of more than 24 tokens keeps its last 24 (the turn
    to answer) and generates, where the whole prompt failed with an index error; a short prompt in the same batch
    generates exactly as it does alone; no room for any prompt is a one-line config error."""
    texts = [f"word{index} alpha beta gamma delta {index}" for index in range(200)]
    tokenizer = train_bpe(texts, 300)
    prepare_tokenizer(tokenizer, None, trained_here=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                       bos_token_id=None)).eval()
    long = [{"role": "user", "content": " ".join(texts[:20])}]
    short = [{"role": "user", "content": "alpha beta"}]
    with caplog.at_level(logging.WARNING, logger="llmops.modeling"):
        texts_out, _, _ = generate(model, tokenizer, [long, short], 8, 2)
    assert "1 of 2 prompts are longer than the 24 tokens the model's 32 positions leave beside max_new_tokens=8" \
        in caplog.text
    assert texts_out[1] == generate(model, tokenizer, [short], 8, 1)[0][0]
    # the long prompt answered as its last 24 tokens alone would be
    kept = tokenizer(render(tokenizer, long, generation_prompt=True), add_special_tokens=False)["input_ids"][-24:]
    expected = model.generate(torch.tensor([kept]), attention_mask=torch.ones(1, 24, dtype=torch.long),
                              max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)[0, 24:].tolist()
    eos = tokenizer.eos_token_id
    expected = expected[:expected.index(eos)] if eos in expected else expected
    assert texts_out[0] == tokenizer.decode(expected, skip_special_tokens=True).strip()
    with pytest.raises(ConfigError, match=r"^evaluate.max_new_tokens=32 leaves no room for a prompt: the model's "
                                          r"position embeddings cover 32 tokens \(n_positions in its config.json\)"):
        generate(model, tokenizer, [short], 32, 1)
