"""Tokenize-stage throughput against a bare loop of `tokenizer(batch)` over the same texts.

Builds an Alpaca-like instruction set (short instructions, optional inputs, answers of varied
length), then times the tokenize stage end to end (chat template, response labels, truncation,
Arrow dataset on disk) and a bare batched tokenizer loop over the texts the stage feeds the
tokenizer (the rendered conversations). Both use the same tokenizer and thread settings.

    python bench/tokenize_bench.py --rows 20000
"""

from __future__ import annotations

import argparse
import json
import os
import time

from _workspace import bench_workspace


def numbered(rows: list[dict[str, str]]) -> list[dict[str, object]]:
    return [{**row, "_source": "bench", "_line": i + 1} for i, row in enumerate(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--max-length", type=int, default=1024)
    args = parser.parse_args()
    workdir = bench_workspace()

    # libraries are loaded before timing: a pipeline run has them loaded by then too
    import datasets  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    from llmops.data.dedup import DedupFigures, DedupRecord
    from llmops.data.synthetic import alpaca_like_records
    from llmops.data.tokenize import training_texts
    from llmops.io.table_types import column_types
    from llmops.io.tables import write_table
    from llmops.objectives import selected
    from llmops.objectives.config import complete
    from llmops.pipeline.runner import build_stage
    from llmops.store.workspace import artifact_dir
    from llmops.text import templates
    from llmops.text.tokenizers import prepare_tokenizer

    deduped = artifact_dir("dedup", "bench")
    deduped.mkdir(parents=True)
    rows = list(numbered(alpaca_like_records(args.rows)))
    write_table(rows, column_types(rows), deduped / "train")
    held = list(numbered(alpaca_like_records(10, seed=1)))
    write_table(held, column_types(held), deduped / "eval")
    objective = selected(complete({}).data)
    tokenizer = objective.train_tokenizer(training_texts(rows, objective), 8000)
    prepare_tokenizer(tokenizer, None, trained_here=True)
    tokenizer_dir = workdir / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)

    record = DedupRecord(stage="dedup", key="bench", hash="bench", figures=DedupFigures.model_construct())
    config = complete({"tokenize": {"tokenizer": str(tokenizer_dir), "max_length": args.max_length}})
    started = time.perf_counter()
    tokenized = build_stage("tokenize", config, record)
    stage_seconds = time.perf_counter() - started

    texts = [templates.render(tokenizer, objective.kind.conversation(row)) for row in rows]
    started = time.perf_counter()
    for start in range(0, len(texts), 1000):
        tokenizer(texts[start:start + 1000], add_special_tokens=False)
    bare_seconds = time.perf_counter() - started

    print(json.dumps({
        "rows": args.rows,
        "tokens": tokenized.figures.train.tokens,
        "stage_seconds": round(stage_seconds, 2),
        "stage_rows_per_s": round(args.rows / stage_seconds),
        "bare_tokenizer_seconds": round(bare_seconds, 2),
        "bare_rows_per_s": round(args.rows / bare_seconds),
        "stage_vs_bare": round(bare_seconds / stage_seconds, 3),
        "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM"),
    }, indent=2))


if __name__ == "__main__":
    main()
