"""Models built from scratch: the config of each architecture `model.architecture` names, sized by the config.

Decoders (llama, gpt2) read left to right; encoders (bert, roberta) read both ways; t5 is an
encoder-decoder. Which of them an objective builds is the objective's choice (objectives/); here is
only how each is shaped, over the vocabulary of the tokenizer it will read.
"""

from __future__ import annotations

from typing import Any

from llmops.config.schema import ModelConfig

# position embeddings of the models built here (longer inputs than any tiny config uses)
MAX_POSITIONS = 2048


def position_limit(architecture: str) -> int | None:
    """The longest input a model of `architecture` built here reads: a learned position table has MAX_POSITIONS
    rows; rotary (llama) and relative (t5) positions have no table to run past."""
    return MAX_POSITIONS if architecture in ("gpt2", "bert", "roberta") else None


def scratch_config(model_config: ModelConfig, tokenizer: Any, extra: dict[str, Any]) -> Any:
    """The transformers config of `model.architecture`; `extra` carries what the objective's head needs."""
    ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id, **extra}
    builders = {"llama": llama, "gpt2": gpt2, "bert": encoder, "roberta": encoder, "t5": t5}
    return builders[model_config.architecture](model_config, tokenizer, ids)


def config_class(architecture: str) -> Any:
    """The transformers config class `architecture` builds from (which model class an Auto class makes of it)."""
    import transformers

    names = {"llama": "LlamaConfig", "gpt2": "GPT2Config", "bert": "BertConfig", "roberta": "RobertaConfig",
             "t5": "T5Config"}
    return getattr(transformers, names[architecture])


def llama(model_config: ModelConfig, tokenizer: Any, ids: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    heads = model_config.num_heads
    return LlamaConfig(hidden_size=model_config.hidden_size, num_hidden_layers=model_config.num_layers,
                       num_attention_heads=heads, num_key_value_heads=model_config.num_kv_heads or heads,
                       intermediate_size=model_config.intermediate_size or 4 * model_config.hidden_size,
                       max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, **ids)


def gpt2(model_config: ModelConfig, tokenizer: Any, ids: dict[str, Any]) -> Any:
    from transformers import GPT2Config

    hidden = model_config.hidden_size
    return GPT2Config(n_embd=hidden, n_layer=model_config.num_layers, n_head=model_config.num_heads,
                      n_inner=model_config.intermediate_size or 4 * hidden, n_positions=MAX_POSITIONS, **ids)


def encoder(model_config: ModelConfig, tokenizer: Any, ids: dict[str, Any]) -> Any:
    """A BERT or RoBERTa config of the configured size, over the tokenizer's vocabulary."""
    from transformers import BertConfig, RobertaConfig

    shape = {"hidden_size": model_config.hidden_size, "num_hidden_layers": model_config.num_layers,
             "num_attention_heads": model_config.num_heads,
             "intermediate_size": model_config.intermediate_size or 4 * model_config.hidden_size, **ids}
    if model_config.architecture == "roberta":
        # RoBERTa numbers positions from pad_token_id + 1
        return RobertaConfig(max_position_embeddings=MAX_POSITIONS + (tokenizer.pad_token_id or 0) + 1,
                             type_vocab_size=1, **shape)
    return BertConfig(max_position_embeddings=MAX_POSITIONS, **shape)


def t5(model_config: ModelConfig, tokenizer: Any, ids: dict[str, Any]) -> Any:
    """A small T5: the decoder starts from the pad token, as T5 does, and stops at the tokenizer's end token."""
    from transformers import T5Config

    hidden, heads = model_config.hidden_size, model_config.num_heads
    return T5Config(vocab_size=len(tokenizer), d_model=hidden, d_kv=max(1, hidden // heads),
                    d_ff=model_config.intermediate_size or 4 * hidden, num_layers=model_config.num_layers,
                    num_decoder_layers=model_config.num_layers, num_heads=heads, feed_forward_proj="relu",
                    # no dropout, as the decoder-only models built here: small models on small data learn faster
                    dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                    decoder_start_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
