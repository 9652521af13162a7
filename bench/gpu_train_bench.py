"""Training throughput of the train stage itself (not a bare loop), in tokens/s and MFU, on the reference shapes.

    python bench/gpu_train_bench.py                 # both shapes on the visible GPU
    python bench/gpu_train_bench.py --shape gpt2    # one of them
    python bench/gpu_train_bench.py --dry           # tiny versions of both, on CPU, a few steps
    python bench/gpu_train_bench.py --set train.speed.compile=none --set gpt2:train.speed.liger_kernel=off
                                                    # a lever switched (on every shape, or on one), to compare

Shapes (random init; synthetic token ids with realistic length mixes, so nothing is downloaded):
  llama1b  Llama-3.2-1B shape, SFT through TRL's trainer (loss on the completions: prompts are IGNORE_INDEX),
           Alpaca lengths, packed 8 x 2048, samples isolated
  gpt2     GPT-2 124M, causal LM on document lengths, packed 16 x 1024
tokens/s counts real (non-pad) tokens after the first steps; MFU = tokens/s x (6N + 12·L·d·T) / peak, the
peak of the card from llmops/training/throughput.py, T the attention length per sample (samples are isolated).
The measured window holds only full batches of one shape: packed rows are always max_length wide (one compilation),
training stops before the first epoch's last batch if that one is partial, and on a GPU it lasts --seconds of steady
steps (20 by default; max_steps only caps it), counted from the end of the warm-up steps (compilation). The final
weights are saved after the window, never inside it.
While it trains, a shape prints progress lines ({"progress": true, steps, tokens/s so far}) at its logging steps: a
step killed at its time limit still has figures (bench/run_step.py reports the last one). Then one JSON line per
shape as it finishes, with the goal it is held to; a shape that fails prints a line with its error and the others
still run (the exit status is then 1).
Imports neither Prefect, MLflow, DVC, great-expectations nor rensa (a bare CUDA machine has none of them).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

from _workspace import bench_workspace

SHAPES = {
    "llama1b": {"model": {"architecture": "llama", "hidden_size": 2048, "num_layers": 16, "num_heads": 32,
                          "num_kv_heads": 8, "intermediate_size": 8192},
                "data": {"kind": "instruction", "objective": "sft"}, "prompt_share": 0.4,
                "vocab": 128256, "max_length": 2048, "batch_size": 8, "lengths": (180, 0.9, 2048),
                # 20 s at up to 2.5x the goal's 3 steps/s before max_steps cuts the window short
                "max_steps": 160, "goal": {"tokens_per_s": 50000}},
    "gpt2": {"model": {"architecture": "gpt2", "hidden_size": 768, "num_layers": 12, "num_heads": 12,
                       "intermediate_size": 3072},
             "data": {"kind": "text"}, "prompt_share": 0.0,
             "vocab": 50257, "max_length": 1024, "batch_size": 16, "lengths": (600, 0.8, 1024),
             # 20 s at up to 1.6x the goal's 21 steps/s
             "max_steps": 700, "goal": {"tokens_per_s": 350000}},
}
WINDOW_S = 20.0
DRY = {"llama1b": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128},
       "gpt2": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128}}


def lengths(count: int, median: float, sigma: float, cap: int, seed: int = 0) -> list[int]:
    """Log-normal sample lengths, as instruction data and documents have."""
    rng = random.Random(seed)
    return [max(8, min(cap, int(math.exp(math.log(median) + sigma * rng.gauss(0, 1))))) for _ in range(count)]


def enough(sizes: list[int], tokens: float) -> list[int]:
    """The first sizes that add up to `tokens` (all of them when they do not)."""
    total = 0
    for count, size in enumerate(sizes, 1):
        total += size
        if total >= tokens:
            return sizes[:count]
    return sizes


def synthetic_tokenized(name: str, vocab: int, sizes: list[int], max_length: int, prompt_share: float = 0.0) -> object:
    """A tokenize-stage artifact of random token ids: the train stage reads it like any other. With a prompt share,
    each sample's first tokens are its prompt: IGNORE_INDEX in the labels, as SFT encodes them."""
    import numpy as np
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from llmops.data.tokenize import SplitFigures, TokenizeFigures, TokenizeRecord
    from llmops.store.workspace import artifact_dir
    from llmops.text.encoding import IGNORE_INDEX

    key = f"bench-{name}-{vocab}-{max_length}-{len(sizes)}-{prompt_share}"
    folder = artifact_dir("tokenize", key)
    tokens = {f"t{i}": i for i in range(vocab - 2)} | {"<|pad|>": vocab - 2, "<|end|>": vocab - 1}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(tokens, unk_token="t0")),
                                        pad_token="<|pad|>", eos_token="<|end|>")
    tokenizer.save_pretrained(str(folder / "tokenizer"))
    rng = np.random.default_rng(1)
    targets = 0
    for split, count in (("train", len(sizes)), ("eval", 16)):
        ids = [rng.integers(0, vocab - 2, size).tolist() for size in sizes[:count]]
        labels = [[IGNORE_INDEX] * int(len(row) * prompt_share) + row[int(len(row) * prompt_share):] for row in ids]
        targets = targets or sum(len(row) - int(len(row) * prompt_share) for row in ids)
        Dataset.from_dict({"input_ids": ids, "labels": labels, "raw_length": [len(i) for i in ids],
                           "length": [len(i) for i in ids]}).save_to_disk(str(folder / split))
    split = SplitFigures(rows=len(sizes), tokens=sum(sizes), target_tokens=targets, truncated=0,
                         truncation_rate=0.0, dropped_no_target=0, max_length=max(sizes))
    return TokenizeRecord(stage="tokenize", key=key, hash=key, figures=TokenizeFigures(
        vocab_size=vocab, tokenizer_source="synthetic", max_length=max_length, train=split, eval=split))


def shape_config(name: str, dry: bool, steps: int, overrides: tuple[str, ...] = ()) -> Any:
    from llmops.config.files import apply_override
    from llmops.config.schema import PipelineConfig

    shape = SHAPES[name]
    model = {**shape["model"], **(DRY[name] if dry else {})}
    raw = {"data": dict(shape["data"]), "tokenize": {"max_length": 64 if dry else shape["max_length"]},
           "model": model,
           "train": {"max_steps": steps, "batch_size": 2 if dry else shape["batch_size"], "learning_rate": 1e-4,
                     "logging_steps": max(1, min(10, steps // 4)), "save_steps": steps * 10, "packing": True,
                     "lr_scheduler": "constant", "warmup_ratio": 0.0}}
    for override in overrides:
        apply_override(raw, override, "--set")
    return PipelineConfig.model_validate(raw)


def run_shape(name: str, dry: bool, steps: int | None, overrides: tuple[str, ...] = (),
              seconds: float = WINDOW_S) -> dict:
    from llmops.objectives import selected
    from llmops.store.workspace import artifact_dir
    from llmops.training.trainer import warmup_steps

    shape = SHAPES[name]
    steps = steps or (6 if dry else shape["max_steps"])
    config = shape_config(name, dry, steps, overrides)
    max_length, vocab = config.tokenize.max_length, 512 if dry else shape["vocab"]
    median, sigma, cap = shape["lengths"]
    # samples for 5% more tokens than max_steps of full packed rows (packing fills them to 99%): the window ends
    # before the first epoch does; no more, as the train stage packs them all before its first step
    median = min(median, max_length / 3)
    tokens = config.train.batch_size * max_length * (steps + 2)
    sizes = enough(lengths(int(1.1 * tokens / median) + 16, median, sigma, min(cap, max_length)), 1.05 * tokens)
    tokenized = synthetic_tokenized(name, vocab, sizes, max_length, shape["prompt_share"])
    started = time.perf_counter()
    window = measured_window(name, 0.0 if dry else seconds, warmup_steps(config.train))
    figures = train_with(config, tokenized, artifact_dir("train", f"bench-{name}-{time.time_ns()}"), window)
    result = {"shape": name, "dry": dry, "objective": selected(config.data).name, "steps": figures.steps,
              "tokens_per_s": figures.tokens_per_s, "window_s": window.seconds, "window_steps": window.steps,
              "stopped_by": window.stopped_by, "mfu": figures.mfu, "tflops_per_device": figures.tflops_per_device,
              "flops_per_token": figures.flops_per_token, "attention_length": figures.attention_length,
              "peak_tflops": figures.peak_tflops, "parameters": figures.parameters,
              "attention": selected(config.data).attention(config.model), "speed": config.train.speed.model_dump(),
              "overrides": list(overrides),
              "packed": figures.packed, "padding_fraction": figures.padding_fraction,
              "peak_memory_gb": round(figures.peak_memory_mb / 1024, 2),
              "wall_s": round(time.perf_counter() - started, 1), "goal": shape["goal"]}
    result["meets_goal"] = None if dry else all(
        (result[metric] or 0) >= target for metric, target in shape["goal"].items()) and window.seconds >= seconds
    return result


def train_with(config: Any, tokenized: Any, folder: Path, window: Any) -> Any:
    """The train stage's own training (`fit`: model, Trainer, callbacks, save) in this process, with the window's
    callback added: a bench shape is one process on one device, which the stage trains in its own process too."""
    from llmops.training import launch
    from llmops.training.session import Session
    from llmops.training.train import resume_point
    from llmops.training.trainer import fit

    plan = launch.fitted_to_adapter(launch.plan_for(config), config.train,
                                    config.model.adapter)
    if not plan.inline:
        raise RuntimeError(f"a bench shape trains in one process; this machine's plan is {plan.strategy}")
    session = Session(folder=str(folder), key=folder.name, plan=plan.__dict__)
    resume_point(config.train, folder, session.key)  # a fresh folder: no checkpoint, an empty ledger
    return fit(config, tokenized, session, extra_callbacks=(window,))


def measured_window(name: str, seconds: float, skip: int) -> Any:
    """A callback that ends training after `seconds` of steady steps (0: at max_steps), counted after `skip` warm-up
    steps as the train stage counts its tokens/s, and before a partial batch; it prints progress lines at the logging
    steps."""
    from transformers import TrainerCallback

    from llmops.training.callbacks import synchronized_clock

    class MeasuredWindow(TrainerCallback):
        def __init__(self) -> None:
            self.mark: tuple[float, int] | None = None
            self.seconds, self.steps, self.stopped_by, self.last_full = 0.0, 0, "max_steps", None

        def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None,
                           **kwargs: Any) -> None:
            self.first = state.global_step + skip
            self.last_full = full_batches(train_dataloader, args)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == self.first:
                self.mark = (synchronized_clock(), int(state.num_input_tokens_seen))
            elif self.mark and seconds and time.perf_counter() - self.mark[0] >= seconds:
                control.should_training_stop, self.stopped_by = True, "seconds"
            edge = self.last_full is not None and self.last_full <= state.global_step < state.max_steps
            if edge:
                # the next batch would be the epoch's partial last one: another shape, another compilation
                control.should_training_stop, self.stopped_by = True, "epoch_end"

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            line = {"progress": True, "shape": name, "steps": state.global_step}
            if self.mark and state.global_step > self.first:
                now, tokens = synchronized_clock(), int(state.num_input_tokens_seen)
                line["tokens_per_s"] = round((tokens - self.mark[1]) / (now - self.mark[0]), 1)
                line["window_s"] = round(now - self.mark[0], 1)
            print(json.dumps(line), flush=True)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.mark:
                self.seconds = round(synchronized_clock() - self.mark[0], 2)
                self.steps = state.global_step - self.first

    return MeasuredWindow()


def full_batches(loader: Any, args: Any) -> int | None:
    """Optimizer steps of whole batches in one epoch; None when the loader's length is unknown."""
    try:
        rows = len(loader.dataset)
    except (AttributeError, TypeError):
        return None
    return rows // (args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=[*SHAPES, "all"],
                        help="a shape to run, in the order given (repeatable; default: all)")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on CPU, a few steps")
    parser.add_argument("--steps", type=int, default=None,
                        help="at most this many optimizer steps (default: the shape's cap; 6 with --dry)")
    parser.add_argument("--seconds", type=float, default=WINDOW_S, help="steady seconds to measure (GPU)")
    parser.add_argument("--set", action="append", default=[], metavar="[SHAPE:]KEY=VALUE",
                        help="a config override for every shape, or for one (repeatable)")
    args = parser.parse_args()
    import torch

    machine = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__}
    names = [name for name in (args.shape or ["all"]) for name in (SHAPES if name == "all" else [name])]
    failed = 0
    for name in names:
        try:
            bench_workspace()
            line = {**run_shape(name, args.dry, args.steps, overrides_for(name, args.set), args.seconds), **machine}
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
