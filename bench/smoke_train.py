"""Smoke trainings of the sharded and 4-bit paths on the visible GPU, through the train stage itself.

    python bench/smoke_train.py zero2      # DeepSpeed ZeRO-2, one process
    python bench/smoke_train.py zero3      # DeepSpeed ZeRO-3 (model built under zero.Init), one process
    python bench/smoke_train.py fsdp2      # FSDP2 + LoRA, sharded checkpoints, adapter gathered and merged at the end
    python bench/smoke_train.py qlora      # QLoRA on a 4-bit base, loaded onto this process's GPU
    python bench/smoke_train.py CHECK --plan   # print the config the check trains, run nothing (any machine)
    python bench/smoke_train.py CHECK --dry    # on CPU: the same training in one plain process (DeepSpeed and FSDP
                                               # need CUDA), DeepSpeed imported all the same; proves the code and wheels

A tiny Llama and synthetic token ids (nothing downloaded); QLoRA and FSDP2's LoRA adapt a tiny base written to
the bench's workspace first. Prints one JSON line: check, status (ok, failed, not run), steps, first and last
logged loss, seconds, and what failed. QLoRA without bitsandbytes (a wheel too big to travel with the others) is
not run, with that reason, and exits 3: the device check reports it NOT RUN, not failed. Imports neither Prefect,
MLflow, DVC, great-expectations nor rensa.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from _workspace import bench_workspace

TINY = {"architecture": "llama", "hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 256}
VOCAB, LENGTH, STEPS = 512, 128, 12
CHECKS = {
    "zero2": {"train": {"distributed": "deepspeed", "zero_stage": 2}},
    "zero3": {"train": {"distributed": "deepspeed", "zero_stage": 3}},
    "fsdp2": {"train": {"distributed": "fsdp"}, "model": {"adapter": "lora", "lora": {"merge": True}}},
    "qlora": {"model": {"adapter": "qlora"}},
}


NOT_RUN = 3  # exit status of a check that could not run here (not a failure)


def overrides(check: str, base: str | None, dry: bool = False) -> dict[str, Any]:
    """The pipeline config of one check: a tiny model, a few steps, one process on one GPU (dry: one plain process,
    on CPU)."""
    extra = CHECKS[check]
    model = {**TINY, **extra.get("model", {})}
    if model.get("adapter", "none") != "none":
        model["name_or_path"] = base
    train = {"max_steps": STEPS, "batch_size": 4, "learning_rate": 1e-3, "logging_steps": 3, "save_steps": 6,
             "processes": 1, "lr_scheduler": "constant", "warmup_ratio": 0.0, **extra.get("train", {})}
    if dry:
        train = {**train, "distributed": "none"}
        train.pop("zero_stage", None)
    return {"data": {"kind": "text"}, "tokenize": {"max_length": LENGTH}, "model": model, "train": train}


def write_base(folder: Path) -> str:
    """A tiny pretrained base in safetensors, over the synthetic vocabulary."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not (folder / "config.json").is_file():
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=TINY["hidden_size"], num_hidden_layers=TINY["num_layers"],
                             num_attention_heads=TINY["num_heads"], intermediate_size=TINY["intermediate_size"],
                             pad_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, tie_word_embeddings=False)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    return str(folder)


def missing_requirement(check: str, dry: bool) -> str | None:
    """Why this check cannot run on this machine, before anything is built: None when it can."""
    import importlib.util

    if check == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        return ("bitsandbytes is not installed: its wheel (about 60 MB) does not travel with the device check's "
                "others; install it to run QLoRA")
    if check == "qlora" and dry:
        return "QLoRA's 4-bit base needs a CUDA GPU"
    if CHECKS[check].get("train", {}).get("distributed") == "deepspeed":
        import deepspeed  # noqa: F401 - its wheel must load here even where the dry run trains without it
    return None


def run_check(check: str, workdir: Path, dry: bool = False) -> dict[str, Any]:
    from gpu_train_bench import lengths, synthetic_tokenized

    from llmops.config.schema import PipelineConfig
    from llmops.pipeline.stages import StageContext
    from llmops.store.workspace import artifact_dir
    from llmops.training.train import train

    config = PipelineConfig.model_validate(overrides(check, write_base(workdir / "base"), dry))
    tokenized = synthetic_tokenized(f"smoke-{check}", VOCAB, lengths(STEPS * 16, 60, 0.6, LENGTH), LENGTH)
    folder = artifact_dir("train", f"smoke-{check}-{time.time_ns()}")
    figures = train(config, tokenized, StageContext(folder=folder))
    saved = sorted(p.name for p in (folder / "model").glob("*.safetensors"))
    losses = (figures.first_logged_loss, figures.last_logged_loss)
    problem = None
    if figures.steps != STEPS or not all(loss is not None and math.isfinite(loss) for loss in losses):
        problem = f"{figures.steps} steps, losses {losses}"
    elif not saved:
        problem = "no safetensors weights in the model folder"
    elif check == "fsdp2" and not (folder / "adapter" / "adapter_model.safetensors").is_file():
        problem = "the gathered adapter is missing beside the merged model"
    return {"status": "failed" if problem else "ok", "steps": figures.steps, "first_loss": losses[0],
            "last_loss": losses[1], "saved": saved, "detail": problem}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=list(CHECKS))
    parser.add_argument("--plan", action="store_true", help="print the config the check trains and stop")
    parser.add_argument("--dry", action="store_true", help="on CPU, in one plain process")
    args = parser.parse_args()
    if args.plan:
        config = overrides(args.check, "<tiny base>", args.dry)
        print(json.dumps({"check": args.check, "status": "plan", "config": config}))
        return 0
    started = time.perf_counter()
    try:
        reason = missing_requirement(args.check, args.dry)
        if reason:
            print(json.dumps({"check": args.check, "status": "not run", "detail": reason, "dry": args.dry}))
            return NOT_RUN
        result = {**run_check(args.check, bench_workspace(), args.dry), "dry": args.dry}
    except Exception as err:  # one line per check: the table says what failed, the traceback is on stderr
        import traceback

        traceback.print_exc()
        result = {"status": "failed", "detail": " ".join(f"{type(err).__name__}: {err}".split())[:300]}
    result = {"check": args.check, **result, "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(result), flush=True)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
