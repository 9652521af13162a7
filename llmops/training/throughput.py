"""Training throughput the way it is measured everywhere in this project: real tokens/s, model FLOPs and MFU.

Model FLOPs per token are 6·N + 12·L·d·T: N the parameters without position embeddings, L layers,
d the hidden size, T the sequence length. MFU divides the achieved FLOP rate by the card's dense
bf16 peak; a card not in the table gets no MFU rather than a guess.
"""

from __future__ import annotations

import os
from typing import Any

# dense bf16 TFLOP/s; the H200's is the measured rate of an 8192³ matmul, the others their makers' dense figures
PEAK_BF16_TFLOPS = {
    "H200": 780.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}


def flops_per_token(model: Any, sequence_length: int) -> float:
    """6·N + 12·L·d·T for the model's base (an adapter's base counts: its forward and backward run in full)."""
    config = getattr(model, "config", None)
    parameters = sum(p.numel() for name, p in model.named_parameters() if not is_position_embedding(name))
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return 6.0 * parameters + 12.0 * layers * hidden * sequence_length


def is_position_embedding(name: str) -> bool:
    return name.endswith("wpe.weight") or "position_embeddings" in name


def device_peak_tflops() -> float | None:
    """The visible CUDA card's peak from the table (LLMOPS_PEAK_TFLOPS overrides); None on CPU or an unknown card."""
    configured = os.environ.get("LLMOPS_PEAK_TFLOPS")
    if configured:
        return float(configured)
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((peak for card, peak in PEAK_BF16_TFLOPS.items() if card in name), None)


def throughput(tokens: int, seconds: float, per_token_flops: float, world_size: int) -> dict[str, float | None]:
    """tokens/s (all processes), achieved TFLOP/s and MFU per device."""
    if seconds <= 0:
        return {"tokens_per_s": 0.0, "tflops_per_device": 0.0, "mfu": None}
    tokens_per_s = tokens / seconds
    tflops = tokens_per_s * per_token_flops / 1e12 / max(world_size, 1)
    peak = device_peak_tflops()
    return {"tokens_per_s": round(tokens_per_s, 1), "tflops_per_device": round(tflops, 3),
            "mfu": round(tflops / peak, 4) if peak else None}
