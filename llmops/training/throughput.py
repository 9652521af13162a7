"""Training throughput the way it is measured everywhere in this project: real tokens/s, model FLOPs and MFU.

Model FLOPs per token are 6·N_t + 4·N_f + 12·L·d·T: N_t the weights that train and N_f the frozen
ones (a frozen weight costs its forward and the gradient to its inputs, not its own gradient: 4, not
6, which matters under LoRA and QLoRA), counting only the weights that multiply (an input embedding
is a lookup, unless tied to the output head), a 4-bit weight by its real size; L layers, d the
hidden size, T the attention length. Samples are kept apart (packed or padded, each attends to
itself only), so T is per sample: Σ Lᵢ² / Σ Lᵢ over the samples trained on, not the row length.
N is the whole model's even where each process holds a shard (DeepSpeed ZeRO-3 keeps the full size
of a partitioned parameter in `ds_numel`). MFU divides the achieved FLOP rate per device by the
card's maker's dense bf16 peak; a card not in the table gets no MFU rather than a guess.
"""

from __future__ import annotations

import os
from typing import Any

from llmops.models import modeling
from llmops.tracking.cost import names_card

# the makers' dense (no sparsity) bf16 tensor-core TFLOP/s; the longest name a card's own name contains wins
PEAK_BF16_TFLOPS = {
    "H200": 989.4,  # SXM; the same silicon and clocks as the H100 SXM
    "H200 NVL": 835.5,
    "H100": 989.4,  # SXM
    "H100 PCIe": 756.5,
    "H100 NVL": 835.5,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}


def flops_per_token(model: Any, attention_length: float) -> float:
    """6·N_trained + 4·N_frozen + 12·L·d·T, over the weights that multiply (an adapter's base counts: its forward
    and its backward to the inputs run in full)."""
    config = getattr(model, "config", None)
    lookups = embedding_lookups(model)
    trained = frozen = 0
    for parameter in model.parameters():
        if id(parameter) in lookups:
            continue
        size = modeling.full_numel(parameter)
        trained, frozen = (trained + size, frozen) if parameter.requires_grad else (trained, frozen + size)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return 6.0 * trained + 4.0 * frozen + 12.0 * layers * hidden * attention_length


def embedding_lookups(model: Any) -> set[int]:
    """The weights a model only looks rows up in (token, position, token-type embeddings), by id: not matmuls; an
    input embedding tied to the output head is one (the head multiplies by it)."""
    import torch

    head = getattr(modeling.base_of(model), "get_output_embeddings", lambda: None)()
    multiplied = id(head.weight) if head is not None and hasattr(head, "weight") else None
    return {id(module.weight) for module in model.modules()
            if isinstance(module, torch.nn.Embedding) and id(module.weight) != multiplied}


def peak_for(device_name: str) -> float | None:
    """The table's peak of a card by its reported name (the longest entry named in it as a whole word: an L40 is no
    L4), or None."""
    found = [card for card in PEAK_BF16_TFLOPS if names_card(card, device_name)]
    return PEAK_BF16_TFLOPS[max(found, key=len)] if found else None


def device_peak_tflops() -> float | None:
    """The visible CUDA card's peak from the table (LLMOPS_PEAK_TFLOPS overrides); None on CPU or an unknown card."""
    configured = os.environ.get("LLMOPS_PEAK_TFLOPS")
    if configured:
        return float(configured)
    import torch

    if not torch.cuda.is_available():
        return None
    return peak_for(torch.cuda.get_device_name(0))


def throughput(tokens: int, seconds: float, per_token_flops: float, world_size: int,
               peak: float | None = None) -> dict[str, float | None]:
    """tokens/s (all processes), achieved TFLOP/s and MFU per device, against `peak` (None: this card's)."""
    peak = peak if peak is not None else device_peak_tflops()
    if seconds <= 0:
        return {"tokens_per_s": 0.0, "tflops_per_device": 0.0, "mfu": None, "peak_tflops": peak}
    tokens_per_s = tokens / seconds
    tflops = tokens_per_s * per_token_flops / 1e12 / max(world_size, 1)
    return {"tokens_per_s": round(tokens_per_s, 1), "tflops_per_device": round(tflops, 3),
            "mfu": round(tflops / peak, 4) if peak else None, "peak_tflops": peak}
