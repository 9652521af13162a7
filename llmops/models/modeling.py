"""Loading and placing models: safetensors only, a model's own code only when trusted, LoRA and 4-bit weights.

What model class an objective trains, and its head, is the objective's (objectives/); here is how
any of them is loaded, adapted, counted and put on a device.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmops.config.schema import LoraConfig, ModelConfig
from llmops.io.errors import ConfigError, UserError
from llmops.models import precision
from llmops.store.workspace import hash_file_cached

log = logging.getLogger("llmops.modeling")


class HardwareError(UserError, RuntimeError):
    """The configured training needs hardware or a package this machine does not have."""


class UnsafeCheckpointError(UserError, ValueError):
    """A model folder holds its weights only as pickles, which can run code when loaded."""


class UnsupportedAttentionError(UserError, ValueError):
    """model.attention names a kernel the model's class does not support."""


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


@dataclass(frozen=True)
class Capabilities:
    """What this machine offers attention kernels: a CUDA device (its compute capability major) and the varlen
    FlashAttention kernels installed, newest first."""

    cuda: bool
    major: int = 0
    flash: tuple[str, ...] = ()


# varlen FlashAttention kernels, newest first, with the compute capability each needs
FLASH_KERNELS = (("flash_attention_4", "is_flash_attn_4_available", 9),
                 ("flash_attention_3", "is_flash_attn_3_available", 9),
                 ("flash_attention_2", "is_flash_attn_2_available", 8))
FLASH_NAMES = tuple(name for name, _, _ in FLASH_KERNELS)


# the device nodes of a GPU torch can use: NVIDIA, AMD (ROCm), and the GPU bridge of WSL
GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def may_have_gpu() -> bool:
    """Whether this machine may have a GPU for torch: a GPU shows itself by a device node (NVIDIA's, AMD's or WSL's
    bridge), so where none exists there is none, and saying so costs no torch import (seconds, on every plan)."""
    return any(glob.glob(pattern) for pattern in GPU_DEVICE_NODES)


def device_capabilities() -> Capabilities:
    """The probe of this machine: CUDA and the FlashAttention kernels its card can run."""
    if not may_have_gpu():
        return Capabilities(cuda=False)
    import torch

    if not torch.cuda.is_available():
        return Capabilities(cuda=False)
    from transformers.utils import import_utils

    major, _ = torch.cuda.get_device_capability()
    installed = tuple(name for name, check, needs in FLASH_KERNELS
                      if major >= needs and getattr(import_utils, check, lambda: False)())
    return Capabilities(cuda=True, major=major, flash=installed)


def cuda_capability() -> tuple[int, int] | None:
    """This machine's CUDA compute capability (its first card's), or None without CUDA."""
    if not may_have_gpu():
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major, minor


def supported_attention(model_class: Any) -> tuple[str, ...]:
    """The kernels a transformers model class says it supports (its own class flags); eager always runs."""
    if model_class is None:  # a class not known before loading (a model's own code): the kernel every model has
        return ("sdpa", "eager")
    flags = [(FLASH_NAMES, "_supports_flash_attn"), (("flex_attention",), "_supports_flex_attn"),
             (("sdpa",), "_supports_sdpa")]
    return tuple(name for names, flag in flags if getattr(model_class, flag, False) for name in names) + ("eager",)


def kernel_support(model_class: Any) -> dict[str, Any]:
    """What attention_for needs of a model class, as JSON (a plan remembers it: finding the class imports its
    modeling code, seconds): its name and the kernels it supports."""
    return {"name": getattr(model_class, "__name__", None), "kernels": list(supported_attention(model_class))}


def attention_for(model_config: ModelConfig, model_class: Any = None,
                  capabilities: Capabilities | None = None, support: dict[str, Any] | None = None) -> str:
    """The attention kernel `model_class` trains with; auto: a varlen FlashAttention where the card has one installed
    and the model supports it (packed samples stay apart at full speed), else flex_attention on CUDA where the model
    supports it, else sdpa (packed rows with their own block masks), else eager. A kernel set by hand that the model
    does not support is one line."""
    support = support or kernel_support(model_class)
    supported = tuple(support["kernels"])
    if model_config.attention != "auto":
        if support["name"] is not None and model_config.attention not in supported:
            raise UnsupportedAttentionError(f"model.attention={model_config.attention}: {support['name']} does "
                                            f"not support it; use auto or one of {', '.join(supported)}")
        return model_config.attention
    found = capabilities or device_capabilities()
    # flex_attention's Triton kernels are built for the cards that run bf16 natively (sm80 and newer)
    flex = found.cuda and found.major >= precision.NATIVE_BF16_MAJOR
    choices = [*found.flash, *(("flex_attention",) if flex else ()), "sdpa", "eager"]
    return next(choice for choice in choices if choice in supported)


def model_class(auto: Any, config: Any) -> Any:
    """The transformers class an Auto class builds from `config`, or None where only loading tells (remote code)."""
    mapping = getattr(auto, "_model_mapping", None)
    try:
        return mapping[type(config)] if mapping is not None else None
    except (KeyError, ValueError):
        return None


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


# learned position embeddings whose first rows a padding offset takes (RoBERTa's family): the rest are positions
PADDING_OFFSET_TYPES = ("roberta", "xlm-roberta", "camembert", "longformer", "data2vec-text", "xmod")


def position_limit(config: Any) -> tuple[int, str] | None:
    """The most tokens a model's learned position embeddings cover, and the config field that says so; None where
    positions are rotary (RoPE) or relative (T5), which have no table to run past."""
    if any(getattr(config, name, None) for name in ("rope_theta", "rope_scaling", "rope_parameters", "rotary_dim",
                                                    "relative_attention_num_buckets")):
        return None
    if getattr(config, "position_biased_input", True) is False:  # DeBERTa-v2: relative positions only
        return None
    for field in ("n_positions", "max_position_embeddings"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            offset = (getattr(config, "pad_token_id", None) or 0) + 1 if config.model_type in PADDING_OFFSET_TYPES \
                else 0
            return value - offset, field
    return None


def fit_prompts(config: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Prompts that leave room for max_new_tokens within the model's learned positions: a longer one keeps its last
    tokens (the turn to answer), as it would otherwise fail mid-generation with an index error."""
    limit = position_limit(config)
    if limit is None:
        return prompts
    if max_new_tokens >= limit[0]:
        raise ConfigError(f"evaluate.max_new_tokens={max_new_tokens} leaves no room for a prompt: the model's "
                          f"position embeddings cover {limit[0]} tokens ({limit[1]} in its config.json); set "
                          f"evaluate.max_new_tokens below {limit[0]}")
    room = limit[0] - max_new_tokens
    cut = sum(len(prompt) > room for prompt in prompts)
    if cut:
        log.warning("%d of %d prompts are longer than the %d tokens the model's %d positions leave beside "
                    "max_new_tokens=%d: their first tokens were dropped", cut, len(prompts), room, limit[0],
                    max_new_tokens)
    return [prompt[-room:] for prompt in prompts]


def check_positions(config: Any, max_length: int, name: str) -> None:
    """Refuse a max_length longer than the base model's position embeddings: the first longer batch would fail deep
    in training with an index error."""
    limit = position_limit(config)
    if limit is not None and max_length > limit[0]:
        raise ConfigError(f"tokenize.max_length={max_length} is longer than model {name} reads: its position "
                          f"embeddings cover {limit[0]} tokens ({limit[1]} in its config.json): set "
                          f"tokenize.max_length to at most {limit[0]}")


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
    """4-bit NF4 weights for QLoRA, loaded where this process trains: needs CUDA and bitsandbytes."""
    import torch

    if not torch.cuda.is_available():
        raise HardwareError("model.adapter=qlora needs a CUDA GPU (4-bit weights through bitsandbytes); this "
                            "machine has none: use model.adapter=lora")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise HardwareError("model.adapter=qlora needs bitsandbytes: pip install 'llmops[gpu]'") from None
    from transformers import BitsAndBytesConfig

    dtype = getattr(torch, precision.half_dtype_name(cuda_capability()))
    settings = quantized_loading(dtype, local_device(), sharded_loading())
    return {"quantization_config": BitsAndBytesConfig(**settings.pop("quantization")), **settings}


def quantized_loading(dtype: Any, device: str, sharded: bool) -> dict[str, Any]:
    """BitsAndBytesConfig's settings and from_pretrained's placement for a 4-bit base (the FSDP/ZeRO-3 QLoRA recipe).

    The 4-bit weights are stored in the compute dtype (bnb_4bit_quant_storage), a float type FSDP and ZeRO-3 can
    shard with the rest. A sharded run loads on the CPU with every other weight in that dtype too (one dtype per
    shard group) and leaves placement to FSDP or DeepSpeed; any other run loads straight onto this process's own GPU
    (without a device_map every rank would load onto cuda:0)."""
    quantize = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                "bnb_4bit_compute_dtype": dtype, "bnb_4bit_quant_storage": dtype}
    placement = {"dtype": dtype} if sharded else {"device_map": {"": device}}
    return {"quantization": quantize, **placement}


def local_device() -> str:
    """This process's GPU: the local rank's under a launcher (torchrun, accelerate set LOCAL_RANK), else the first."""
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def sharded_loading() -> bool:
    """Whether the weights being loaded will be sharded over the processes: FSDP (accelerate launch says so in the
    environment) or DeepSpeed ZeRO-3 (known once the training arguments exist, as they do before the model)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true") or is_deepspeed_zero3_enabled()


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

    if model_config.adapter == "qlora" and not sharded_loading():
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    elif model_config.adapter == "qlora" and gradient_checkpointing:
        # sharded QLoRA keeps one dtype per shard group, so nothing is cast up to fp32 (as
        # prepare_model_for_kbit_training does); checkpointed layers still need inputs that carry gradients
        model.enable_input_require_grads()
    adapted = get_peft_model(model, lora_settings(model_config.lora, task, exclude))
    if not sharded_loading():  # sharded, every weight keeps the one dtype it was loaded in (one per shard group)
        precision.upcast_trainable(adapted)
    return adapted


def is_adapter(model_dir: Path) -> bool:
    return (model_dir / "adapter_config.json").is_file()


def label_maps(labels: list[str]) -> dict[str, Any]:
    return {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {label: index for index, label in enumerate(labels)}}


def fitted_head(model_config: ModelConfig, settings: dict[str, Any]) -> dict[str, Any]:
    """from_pretrained's settings for a pretrained base whose head classifies another number of labels than the data
    gives (a 2-way sentiment model tuned to 3 labels, a classifier made a reward model): that head is replaced by a
    new one, as transformers does when told, and the log says so."""
    wanted = settings.get("num_labels")
    if wanted is None:
        return settings
    try:
        had = pretrained_config(model_config)
    except (OSError, ValueError):
        return settings  # loading it will say why
    if had.num_labels == wanted:
        return settings
    log.warning("model %s: its head has %d labels (%s) and this training %d: a new head is trained from scratch",
                model_config.name_or_path, had.num_labels, ", ".join(map(str, list(had.id2label.values())[:10])),
                wanted)
    return {**settings, "ignore_mismatched_sizes": True}


def save_labels(model_dir: Path, labels: list[str]) -> None:
    """A head's label order, beside its weights: an adapter alone does not record it."""
    (model_dir / LABELS_FILE).write_text(json.dumps(labels))


def read_labels(model_dir: Path) -> list[str]:
    path = model_dir / LABELS_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def full_numel(parameter: Any) -> int:
    """A parameter's real size: also where this process holds only its shard (ZeRO-3: ds_numel), and of a 4-bit
    weight (bitsandbytes' Params4bit packs two values a byte: its numel() is half, its quant_state has the shape)."""
    shape = getattr(getattr(parameter, "quant_state", None), "shape", None)
    if shape is not None:
        return math.prod(shape)
    return int(getattr(parameter, "ds_numel", None) or parameter.numel())


def parameter_counts(model: Any) -> dict[str, int]:
    """The whole model's counts, also where each process holds a shard or a 4-bit weight (full_numel)."""
    sizes = [(full_numel(p), p.requires_grad) for p in model.parameters()]
    return {"parameters": sum(size for size, _ in sizes),
            "trainable_parameters": sum(size for size, trains in sizes if trains)}


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
