"""Models: built from the config or loaded pretrained, for each objective, with or without a LoRA adapter."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmops.core import workspace
from llmops.core.config import LoraConfig, ModelConfig, RecordKind, TextObjective, TrackingConfig
from llmops.objectives import masked_lm, seq2seq
from llmops.registry import registered_base

log = logging.getLogger("llmops.modeling")


class HardwareError(RuntimeError):
    """The configured training needs hardware or a package this machine does not have."""


class UnsafeCheckpointError(ValueError):
    """A model folder holds its weights only as pickles, which can run code when loaded."""


# weight files that torch.load unpickles; only safetensors are ever loaded
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def require_safetensors(name_or_path: str | Path) -> None:
    """Refuse a local model (a folder, or a single weights file) whose weights are pickles only; a hub id is
    loaded with `use_safetensors=True`, which refuses them there."""
    path = Path(name_or_path)
    if not str(name_or_path):
        return
    if path.is_file() and path.suffix != ".safetensors":
        pickles = [path.name]
    elif path.is_dir() and not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    else:
        return
    if pickles:
        raise UnsafeCheckpointError(
            f"model {name_or_path}: its weights are pickles only ({', '.join(pickles[:3])}), which can run code "
            "when loaded; only safetensors are loaded: convert it once where you trust it "
            "(from_pretrained, then save_pretrained(path, safe_serialization=True))")


def is_classifier(kind: RecordKind) -> bool:
    return kind == "classification"


def has_label_set(kind: RecordKind) -> bool:
    """Kinds whose model head is sized by data.labels: a label per row, or a tag per word."""
    return kind in ("classification", "tokens")


def auto_class(kind: RecordKind, objective: TextObjective = "causal_lm") -> Any:
    import transformers

    if objective == "masked_lm":
        return transformers.AutoModelForMaskedLM
    if kind == "tokens":
        return transformers.AutoModelForTokenClassification
    if kind == "seq2seq":
        return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModelForSequenceClassification if is_classifier(kind) else \
        transformers.AutoModelForCausalLM


def label_maps(labels: list[str]) -> dict[str, Any]:
    return {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {label: index for index, label in enumerate(labels)}}


def build_model(model_config: ModelConfig, tokenizer: Any, seed: int, kind: RecordKind,
                labels: list[str] | None = None, quantize: bool = False,
                objective: TextObjective = "causal_lm") -> Any:
    """A pretrained model, or a fresh one whose random init is fixed by `seed`."""
    import transformers

    transformers.set_seed(seed)
    auto = auto_class(kind, objective)
    if objective == "masked_lm":
        masked_lm.check_model(model_config)
    if kind == "seq2seq":
        seq2seq.check_model(model_config)
    extra = label_maps(labels or []) if has_label_set(kind) else {}
    attention = {"attn_implementation": attention_for(model_config)}
    if model_config.name_or_path:
        model = load_pretrained(auto, model_config, **extra, **attention, **(quantization() if quantize else {}))
    else:
        model = auto.from_config(scratch_config(model_config, tokenizer, extra), **attention)
    if is_classifier(kind) and model.config.pad_token_id is None:
        # sequence classifiers find each row's last token through the pad id
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def attention_for(model_config: ModelConfig) -> str:
    """The configured attention kernel; auto: a varlen FlashAttention where a GPU has one installed (packed samples
    stay apart at full speed), else flex_attention on CUDA, sdpa on CPU."""
    if model_config.attention != "auto":
        return model_config.attention
    import torch

    if not torch.cuda.is_available():
        return "sdpa"
    from transformers.utils import import_utils

    major, _ = torch.cuda.get_device_capability()
    candidates = [("flash_attention_4", "is_flash_attn_4_available", 9), ("flash_attention_3",
                  "is_flash_attn_3_available", 9), ("flash_attention_2", "is_flash_attn_2_available", 8)]
    for name, check, capability in candidates:
        if major >= capability and getattr(import_utils, check, lambda: False)():
            return name
    return "flex_attention"


def load_pretrained(auto: Any, model_config: ModelConfig, **settings: Any) -> Any:
    """`from_pretrained` with safetensors only, and the model's own code run only when model.trust_remote_code."""
    name = model_config.name_or_path
    require_safetensors(name)
    with remote_code_refused(name):
        return auto.from_pretrained(name, trust_remote_code=model_config.trust_remote_code,
                                    revision=model_config.revision, use_safetensors=True, **settings)


@contextmanager
def remote_code_refused(name: str | None) -> Iterator[None]:
    """transformers' refusal to run a model's own code (trust_remote_code off), as one line that says what to do."""
    try:
        yield
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise UnsafeCheckpointError(f"model {name}: loading it runs code that comes with it (auto_map in its "
                                    "config.json), which is off: set model.trust_remote_code: true only for code "
                                    "you have read and trust") from None


def base_fingerprint(model_config: ModelConfig, root: Path, tracking: TrackingConfig | None = None) -> dict[str, Any]:
    """What a pretrained base is: its files' content for a local folder, its id and revision on a hub, the
    resolved version's model hash for a registered one."""
    name = model_config.name_or_path
    if not name:
        return {}
    if registered_base.is_registered(name):
        return registered_base.fingerprint(name, tracking or TrackingConfig())
    local = Path(name) if Path(name).is_absolute() else root / name
    if local.is_dir():
        return {"files": {path.relative_to(local).as_posix(): workspace.hash_file_cached(path)
                          for path in sorted(local.rglob("*")) if path.is_file()}}
    return {"hub": name, "revision": model_config.revision}


def scratch_config(model_config: ModelConfig, tokenizer: Any, extra: dict[str, Any]) -> Any:
    from transformers import GPT2Config, LlamaConfig

    hidden, layers, heads = model_config.hidden_size, model_config.num_layers, model_config.num_heads
    inner = model_config.intermediate_size or 4 * hidden
    ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id, **extra}
    if model_config.architecture == "t5":
        return seq2seq.scratch_config(model_config, tokenizer)
    if model_config.architecture == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=inner, n_positions=2048, **ids)
    if model_config.architecture in ("bert", "roberta"):
        return encoder_config(model_config, tokenizer, ids)
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=model_config.num_kv_heads or heads, intermediate_size=inner,
                       max_position_embeddings=2048, tie_word_embeddings=True,
                       **ids)


def encoder_config(model_config: ModelConfig, tokenizer: Any, ids: dict[str, Any]) -> Any:
    """A BERT or RoBERTa config of the configured size, over the tokenizer's vocabulary."""
    from transformers import BertConfig, RobertaConfig

    shape = {"hidden_size": model_config.hidden_size, "num_hidden_layers": model_config.num_layers,
             "num_attention_heads": model_config.num_heads,
             "intermediate_size": model_config.intermediate_size or 4 * model_config.hidden_size, **ids}
    if model_config.architecture == "roberta":
        # RoBERTa numbers positions from pad_token_id + 1
        return RobertaConfig(max_position_embeddings=2048 + (tokenizer.pad_token_id or 0) + 1, type_vocab_size=1,
                             **shape)
    return BertConfig(max_position_embeddings=2048, **shape)


def quantization() -> dict[str, Any]:
    """4-bit NF4 weights for QLoRA: needs CUDA and bitsandbytes."""
    import torch

    if not torch.cuda.is_available():
        raise HardwareError("model.adapter=qlora needs a CUDA GPU (4-bit weights through bitsandbytes); this "
                            "machine has none: use model.adapter=lora")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise HardwareError("model.adapter=qlora needs bitsandbytes: pip install 'llmops[gpu]'") from None
    from transformers import BitsAndBytesConfig

    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                      bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)}


def with_adapter(model: Any, model_config: ModelConfig, kind: RecordKind, gradient_checkpointing: bool) -> Any:
    """Wrap the model in a LoRA adapter when configured; only the adapter (and a classifier head) train."""
    if model_config.adapter == "none":
        return model
    from peft import get_peft_model, prepare_model_for_kbit_training

    if model_config.adapter == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    return get_peft_model(model, lora_settings(model_config.lora, kind))


def lora_settings(lora: LoraConfig, kind: RecordKind) -> Any:
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    task = {"tokens": TaskType.TOKEN_CLS, "classification": TaskType.SEQ_CLS, "seq2seq": TaskType.SEQ_2_SEQ_LM
            }.get(kind, TaskType.CAUSAL_LM)
    # peft leaves a token classifier's head out of all-linear only when told: the head is trained whole instead
    excluded = {"exclude_modules": ["classifier", "score"]} if kind == "tokens" else {}
    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules, task_type=task, **excluded)


def is_adapter(model_dir: Path) -> bool:
    return (model_dir / "adapter_config.json").is_file()


LABELS_FILE = "labels.json"


def save_labels(model_dir: Path, labels: list[str]) -> None:
    """A classifier's label order, beside its weights: an adapter alone does not record it."""
    (model_dir / LABELS_FILE).write_text(json.dumps(labels))


def load_trained(model_dir: Path, kind: RecordKind) -> Any:
    """The trained model from its folder: full weights, or the base model with the saved adapter."""
    require_safetensors(model_dir)
    if is_adapter(model_dir):
        from peft import (
            AutoPeftModelForCausalLM,
            AutoPeftModelForSeq2SeqLM,
            AutoPeftModelForSequenceClassification,
            AutoPeftModelForTokenClassification,
        )

        base = json.loads((model_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if base:
            require_safetensors(base)
        if has_label_set(kind):
            labels = json.loads((model_dir / LABELS_FILE).read_text())
            auto_peft = AutoPeftModelForTokenClassification if kind == "tokens" else \
                AutoPeftModelForSequenceClassification
            return auto_peft.from_pretrained(str(model_dir), use_safetensors=True, trust_remote_code=False,
                                             **label_maps(labels))
        peft_auto = AutoPeftModelForSeq2SeqLM if kind == "seq2seq" else AutoPeftModelForCausalLM
        return peft_auto.from_pretrained(str(model_dir), use_safetensors=True, trust_remote_code=False)
    auto = auto_class("text", "masked_lm") if masked_lm.saved_as_masked_lm(model_dir) else auto_class(kind)
    return auto.from_pretrained(str(model_dir), use_safetensors=True, trust_remote_code=False)


def parameter_counts(model: Any) -> dict[str, int]:
    return {"parameters": int(sum(p.numel() for p in model.parameters())),
            "trainable_parameters": int(sum(p.numel() for p in model.parameters() if p.requires_grad))}


def place(model: Any) -> Any:
    """On the GPU when there is one; a model already placed by its loader (4-bit, device maps) stays put."""
    import torch

    if getattr(model, "hf_device_map", None) or getattr(model, "is_loaded_in_4bit", False):
        return model
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


def on_device(batch: dict[str, Any], model: Any) -> dict[str, Any]:
    return {name: value.to(model.device) if hasattr(value, "to") else value for name, value in batch.items()}
