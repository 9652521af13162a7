"""Loading and placing models: safetensors only, a model's own code only when trusted, LoRA and 4-bit weights.

What model class an objective trains, and its head, is the objective's (objectives/); here is how
any of them is loaded, adapted, counted and put on a device.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmops.core.config import LoraConfig, ModelConfig
from llmops.core.errors import UserError
from llmops.core.workspace import hash_file_cached

log = logging.getLogger("llmops.modeling")


class HardwareError(UserError, RuntimeError):
    """The configured training needs hardware or a package this machine does not have."""


class UnsafeCheckpointError(UserError, ValueError):
    """A model folder holds its weights only as pickles, which can run code when loaded."""


# weight files that torch.load unpickles; only safetensors are ever loaded
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
LABELS_FILE = "labels.json"


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


def pretrained_config(model_config: ModelConfig) -> Any:
    """The transformers config of a pretrained base, without its weights."""
    from transformers import AutoConfig

    name = model_config.name_or_path
    with remote_code_refused(name):
        return AutoConfig.from_pretrained(name, revision=model_config.revision,
                                          trust_remote_code=model_config.trust_remote_code)


def base_fingerprint(model_config: ModelConfig, root: Path) -> dict[str, Any]:
    """What a pretrained base is: its files' content for a local folder, its id and revision on a hub."""
    name = model_config.name_or_path
    if not name:
        return {}
    local = Path(name) if Path(name).is_absolute() else root / name
    if local.is_dir():
        return {"files": {path.relative_to(local).as_posix(): hash_file_cached(path)
                          for path in sorted(local.rglob("*")) if path.is_file()}}
    return {"hub": name, "revision": model_config.revision}


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


def lora_settings(lora: LoraConfig, task: str, exclude: tuple[str, ...] = ()) -> Any:
    """peft's LoRA config; `exclude` leaves modules out of all-linear (a head trained whole instead)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    excluded = {"exclude_modules": list(exclude)} if exclude else {}
    return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules, task_type=TaskType[task], **excluded)


def with_adapter(model: Any, model_config: ModelConfig, task: str, exclude: tuple[str, ...],
                 gradient_checkpointing: bool) -> Any:
    """Wrap the model in a LoRA adapter when configured; only the adapter (and a head) trains."""
    if model_config.adapter == "none":
        return model
    from peft import get_peft_model, prepare_model_for_kbit_training

    if model_config.adapter == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    return get_peft_model(model, lora_settings(model_config.lora, task, exclude))


def is_adapter(model_dir: Path) -> bool:
    return (model_dir / "adapter_config.json").is_file()


def label_maps(labels: list[str]) -> dict[str, Any]:
    return {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {label: index for index, label in enumerate(labels)}}


def save_labels(model_dir: Path, labels: list[str]) -> None:
    """A head's label order, beside its weights: an adapter alone does not record it."""
    (model_dir / LABELS_FILE).write_text(json.dumps(labels))


def read_labels(model_dir: Path) -> list[str]:
    path = model_dir / LABELS_FILE
    return json.loads(path.read_text()) if path.is_file() else []


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


def base_of(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper, or the model itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
