"""Training throughput of the train stage itself (not a bare loop), in tokens/s and MFU, on the reference shapes.

    python bench/gpu_train_bench.py                 # both shapes on the visible GPU
    python bench/gpu_train_bench.py --shape gpt2    # one of them
    python bench/gpu_train_bench.py --dry           # tiny versions of both, on CPU, a few steps
    python bench/gpu_train_bench.py --set train.speed.compile=none --set gpt2:train.speed.liger_kernel=off
                                                    # a lever switched (on every shape, or on one), to compare

Shapes (random init; synthetic token ids with realistic length mixes, so nothing is downloaded):
  llama1b  Llama-3.2-1B shape, SFT-like Alpaca lengths, packed 8 x 2048, samples isolated
  gpt2     GPT-2 124M, causal LM on document lengths, packed 16 x 1024
tokens/s counts real (non-pad) tokens after the first steps; MFU = tokens/s x (6N + 12·L·d·T) / peak, the
peak of the card from llmops/training/throughput.py, T the attention length per sample (samples are isolated).
Prints one JSON line per shape as soon as it finishes, with the goal it is held to; a shape that fails prints a line
with its error and the others still run (the exit status is then 1).
Imports neither Prefect, MLflow, DVC, great-expectations nor rensa (a bare CUDA machine has none of them).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

from _workspace import bench_workspace

SHAPES = {
    "llama1b": {"model": {"architecture": "llama", "hidden_size": 2048, "num_layers": 16, "num_heads": 32,
                          "num_kv_heads": 8, "intermediate_size": 8192},
                "vocab": 128256, "max_length": 2048, "batch_size": 8, "lengths": (180, 0.9, 2048),
                "goal": {"tokens_per_s": 50000}},
    "gpt2": {"model": {"architecture": "gpt2", "hidden_size": 768, "num_layers": 12, "num_heads": 12,
                       "intermediate_size": 3072},
             "vocab": 50257, "max_length": 1024, "batch_size": 16, "lengths": (600, 0.8, 1024),
             "goal": {"tokens_per_s": 350000}},
}
DRY = {"llama1b": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
       "gpt2": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}}


def lengths(count: int, median: float, sigma: float, cap: int, seed: int = 0) -> list[int]:
    """Log-normal sample lengths, as instruction data and documents have."""
    rng = random.Random(seed)
    return [max(8, min(cap, int(math.exp(math.log(median) + sigma * rng.gauss(0, 1))))) for _ in range(count)]


def synthetic_tokenized(name: str, vocab: int, sizes: list[int], max_length: int) -> object:
    """A tokenize-stage artifact of random token ids: the train stage reads it like any other."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from llmops.data.tokenize import SplitFigures, TokenizeFigures, TokenizeRecord
    from llmops.store.workspace import artifact_dir

    key = f"bench-{name}-{vocab}-{max_length}-{len(sizes)}"
    folder = artifact_dir("tokenize", key)
    tokens = {f"t{i}": i for i in range(vocab - 2)} | {"<|pad|>": vocab - 2, "<|end|>": vocab - 1}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(tokens, unk_token="t0")),
                                        pad_token="<|pad|>", eos_token="<|end|>")
    tokenizer.save_pretrained(str(folder / "tokenizer"))
    rng = random.Random(1)
    for split, count in (("train", len(sizes)), ("eval", 16)):
        ids = [[rng.randrange(vocab - 2) for _ in range(size)] for size in sizes[:count]]
        Dataset.from_dict({"input_ids": ids, "labels": ids, "raw_length": [len(i) for i in ids],
                           "length": [len(i) for i in ids]}).save_to_disk(str(folder / split))
    split = SplitFigures(rows=len(sizes), tokens=sum(sizes), target_tokens=sum(sizes), truncated=0,
                         truncation_rate=0.0, dropped_no_target=0, max_length=max(sizes))
    return TokenizeRecord(stage="tokenize", key=key, hash=key, figures=TokenizeFigures(
        vocab_size=vocab, tokenizer_source="synthetic", max_length=max_length, train=split, eval=split))


def run_shape(name: str, dry: bool, steps: int, overrides: tuple[str, ...] = ()) -> dict:
    from llmops.config.files import apply_override
    from llmops.config.schema import PipelineConfig
    from llmops.objectives import selected
    from llmops.pipeline.stages import StageContext
    from llmops.store.workspace import artifact_dir
    from llmops.training.train import train

    shape = SHAPES[name]
    model = {**shape["model"], **(DRY[name] if dry else {})}
    max_length = 64 if dry else shape["max_length"]
    vocab = 512 if dry else shape["vocab"]
    median, sigma, cap = shape["lengths"]
    rows = shape["batch_size"] * (steps + 12) * 3  # enough packed rows for every step
    sizes = lengths(rows, min(median, max_length / 3), sigma, min(cap, max_length))
    tokenized = synthetic_tokenized(name, vocab, sizes, max_length)
    raw = {"data": {"kind": "text"}, "tokenize": {"max_length": max_length}, "model": model,
           "train": {"max_steps": steps, "batch_size": 2 if dry else shape["batch_size"], "learning_rate": 1e-4,
                     "logging_steps": max(1, steps // 4), "save_steps": steps * 10, "packing": True,
                     "lr_scheduler": "constant", "warmup_ratio": 0.0}}
    for override in overrides:
        apply_override(raw, override, "--set")
    config = PipelineConfig.model_validate(raw)
    started = time.perf_counter()
    # the train stage itself, without the runner: nothing of Prefect, MLflow or DVC is needed
    figures = train(config, tokenized, StageContext(folder=artifact_dir("train", f"bench-{name}-{time.time_ns()}")))
    result = {"shape": name, "dry": dry, "steps": figures.steps, "tokens_per_s": figures.tokens_per_s,
              "mfu": figures.mfu, "tflops_per_device": figures.tflops_per_device,
              "flops_per_token": figures.flops_per_token, "attention_length": figures.attention_length,
              "peak_tflops": figures.peak_tflops, "parameters": figures.parameters,
              "attention": selected(config.data).attention(config.model), "speed": config.train.speed.model_dump(),
              "overrides": list(overrides),
              "packed": figures.packed, "padding_fraction": figures.padding_fraction,
              "peak_memory_gb": round(figures.peak_memory_mb / 1024, 2),
              "wall_s": round(time.perf_counter() - started, 1), "goal": shape["goal"]}
    result["meets_goal"] = None if dry else all(
        (result[metric] or 0) >= target for metric, target in shape["goal"].items())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=[*SHAPES, "all"],
                        help="a shape to run, in the order given (repeatable; default: all)")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on CPU, a few steps")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 40; 6 with --dry)")
    parser.add_argument("--set", action="append", default=[], metavar="[SHAPE:]KEY=VALUE",
                        help="a config override for every shape, or for one (repeatable)")
    args = parser.parse_args()
    bench_workspace()
    import torch

    steps = args.steps or (6 if args.dry else 40)
    machine = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__}
    names = [name for name in (args.shape or ["all"]) for name in (SHAPES if name == "all" else [name])]
    failed = 0
    for name in names:
        try:
            line = {**run_shape(name, args.dry, steps, overrides_for(name, args.set)), **machine}
        except Exception as err:  # one shape's failure is its own line; the others still run
            failed += 1
            line = {"shape": name, "error": f"{type(err).__name__}: {' '.join(str(err).split())[:2000]}", **machine}
        print(json.dumps(line), flush=True)
    return 1 if failed else 0


def overrides_for(name: str, settings: list[str]) -> tuple[str, ...]:
    """The --set overrides that apply to a shape: those without a shape, and those naming it (SHAPE:KEY=VALUE)."""
    found = []
    for setting in settings:
        target, colon, override = setting.partition(":")
        if colon and target in SHAPES and "=" not in target:
            if target == name:
                found.append(override)
        else:
            found.append(setting)
    return tuple(found)


if __name__ == "__main__":
    sys.exit(main())
