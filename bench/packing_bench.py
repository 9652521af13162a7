"""Packed vs padded training throughput on CPU, on an Alpaca-like length mix.

Tokenizes Alpaca-shaped instruction records, then trains the same small Llama-style model for
the same number of steps twice: with padding-free packing (the default) and with padded batches.
Prints real (non-pad) tokens per second of each, and the padding fraction of the padded run.

    python bench/packing_bench.py --rows 3000 --steps 30
"""

from __future__ import annotations

import argparse
import json

from _workspace import bench_workspace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=256)
    args = parser.parse_args()
    workdir = bench_workspace()

    from llmops.data.synthetic import alpaca_like_records
    from llmops.io.files import write_jsonl
    from llmops.objectives import load_config
    from llmops.pipeline.runner import run_chain

    data_file = workdir / "alpaca_like.jsonl"
    write_jsonl(data_file, alpaca_like_records(args.rows))
    results = {}
    for packing in (True, False):
        config = load_config("configs/tiny_sft_cpu.yaml", [
            f"data.path={data_file}", f"tokenize.max_length={args.max_length}", "tokenize.vocab_size=2000",
            f"model.hidden_size={args.hidden_size}", "model.num_layers=4", f"train.batch_size={args.batch_size}",
            f"train.max_steps={args.steps}", f"train.packing={str(packing).lower()}", "train.logging_steps=5"])
        figures = run_chain(config, through="train")["train"].figures
        results["packed" if packing else "padded"] = figures.model_dump(include={
            "tokens", "seconds", "tokens_per_s", "padding_fraction", "packed"})
    results["packed_vs_padded_tokens_per_s"] = round(
        results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"], 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
