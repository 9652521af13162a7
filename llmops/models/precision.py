"""Which float types a training computes in and keeps its weights in, chosen on purpose for the card it runs on.

Mixed precision computes in a half type (autocast) and keeps what trains in fp32: an optimizer step
on a weight stored in bf16 rounds any update smaller than the weight's last bit (about 1/256 of it)
away, and an fp16 weight's gradients cannot be unscaled. transformers loads a checkpoint in the
dtype it was saved in unless told otherwise, so the load dtype is decided here, never left to it.
bf16 runs on the tensor cores of compute capability 8.0 and newer (A100, H100, L4); older cards
(V100 7.0, T4 7.5) emulate it slowly, although `torch.cuda.is_bf16_supported()` says yes, so they
train in fp16.
"""

from __future__ import annotations

from typing import Any

from llmops.io.errors import UserError

# the first compute capability whose tensor cores run bf16 (Ampere, sm80)
NATIVE_BF16_MAJOR = 8
HALF_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


class PrecisionError(UserError, ValueError):
    """train.precision asks for a float type the card does not run natively."""


def native_bf16(capability: tuple[int, int] | None) -> bool:
    return capability is not None and capability[0] >= NATIVE_BF16_MAJOR


def compute_precision(configured: str, capability: tuple[int, int] | None) -> str:
    """The precision a training computes in: auto is fp32 on the CPU, bf16 on a card that runs it natively, fp16 on
    an older card; bf16 set by hand on an older card is one line (it would run emulated, many times slower)."""
    if configured == "bf16" and capability is not None and not native_bf16(capability):
        raise PrecisionError(f"train.precision=bf16: this GPU (compute capability {capability[0]}.{capability[1]}) "
                             f"does not run bf16 natively (needs {NATIVE_BF16_MAJOR}.0 or newer): set "
                             "train.precision to auto or fp16")
    if configured != "auto":
        return configured
    if capability is None:
        return "fp32"
    return "bf16" if native_bf16(capability) else "fp16"


def half_dtype_name(capability: tuple[int, int] | None) -> str:
    """The half type a card computes in: bf16 where it runs natively, fp16 elsewhere."""
    return "bfloat16" if native_bf16(capability) else "float16"


def load_dtype(precision: str, adapter: str, sharded: bool) -> str:
    """The dtype a pretrained base is loaded in (a torch dtype's name), whatever dtype its checkpoint is stored in.

    fp32 wherever its weights train (full fine-tuning: fp32 master weights and optimizer state, autocast computes
    in half) and wherever the weights are sharded (FSDP, ZeRO-3: one dtype per shard group, the engine's own mixed
    precision computes in half). A LoRA base is frozen: it is loaded in the compute dtype (half the memory), and
    what trains beside it is kept in fp32 (modeling.with_adapter). A 4-bit base has its own (modeling.quantization).
    """
    if precision == "fp32" or adapter == "none" or sharded:
        return "float32"
    return HALF_DTYPES[precision]


def dtype_setting(dtype: str | None) -> dict[str, Any]:
    """from_pretrained's dtype: the one named (a torch dtype's name), or None: as the checkpoint stores it."""
    if dtype is None:
        return {}
    import torch

    return {"dtype": getattr(torch, dtype)}


def upcast_trainable(model: Any) -> None:
    """What trains beside a frozen half base (the adapter, a head trained whole) in fp32: its optimizer steps do not
    round away, and fp16 gradients are never unscaled (the scaler refuses them)."""
    import torch

    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype in (torch.float16, torch.bfloat16):
            parameter.data = parameter.data.float()


def parameter_dtypes(model: Any) -> dict[str, str | None]:
    """The dtype the weights that train are kept in, and that of the frozen ones (None: there are none)."""
    found: dict[bool, str] = {}
    for parameter in model.parameters():
        found.setdefault(parameter.requires_grad, str(parameter.dtype).removeprefix("torch."))
    return {"trainable_dtype": found.get(True), "frozen_dtype": found.get(False)}
