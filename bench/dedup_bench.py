"""Dedup benchmark: throughput on one core, and precision / recall on planted near duplicates.

Generates documents of Zipf-distributed words in sentences, then plants near duplicates of
random originals at known rates: word edits, sentence reorders and word insertions. Prints the
documents per second of the exact + near-duplicate pass and the precision and recall of
duplicate detection against the planted truth.

    python bench/dedup_bench.py --docs 100000
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import tempfile
import time
from pathlib import Path

from llmops.config.engine import EngineConfig
from llmops.config.schema import DedupConfig
from llmops.data.duplicates import find_duplicates
from llmops.io.table_types import column_types
from llmops.io.tables import table_bytes, table_shards, write_table
from llmops.pipeline.engine import Engine
from llmops.records.base import TEXT


def vocabulary(size: int, rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(size)]


def document(words: list[str], cumulative: list[float], rng: random.Random,
             sentences: tuple[int, int]) -> list[list[str]]:
    return [rng.choices(words, cum_weights=cumulative, k=rng.randint(8, 20))
            for _ in range(rng.randint(*sentences))]


def perturb(sentences: list[list[str]], kind: str, rate: float, words: list[str],
            rng: random.Random) -> list[list[str]]:
    copy = [list(s) for s in sentences]
    if kind == "reorder":
        rng.shuffle(copy)
        return copy
    for sentence in copy:
        for i in range(len(sentence) - 1, -1, -1):
            if rng.random() < rate:
                if kind == "edit":
                    sentence[i] = rng.choice(words)
                else:
                    sentence.insert(i, rng.choice(words))
    return copy


def corpus(docs: int, dup_share: float, rate: float, seed: int,
           length: tuple[int, int] = (4, 12)) -> tuple[list[str], list[int | None]]:
    """Documents of `length` (least, most) sentences of 8-20 words, and for each planted near duplicate the index of its
    original (None for originals)."""
    rng = random.Random(seed)
    words = vocabulary(30_000, rng)
    # Zipf weights, summed once: choices() would sum all 30k weights again on every call
    cumulative = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(words))))
    texts: list[str] = []
    origin: list[int | None] = []
    originals: list[tuple[int, list[list[str]]]] = []
    for position in range(docs):
        if originals and rng.random() < dup_share:
            source, source_sentences = rng.choice(originals)
            kind = rng.choice(["edit", "reorder", "insert"])
            sentences = perturb(source_sentences, kind, rate, words, rng)
            origin.append(source)
        else:
            sentences = document(words, cumulative, rng, length)
            originals.append((position, sentences))
            origin.append(None)
        texts.append(" ".join(" ".join(s) + "." for s in sentences))
    return texts, origin


def run(texts: list[str], origin: list[int | None], config: DedupConfig) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "texts"
        rows = [{"text": text} for text in texts]
        write_table(rows, column_types(rows), source)
        started = time.process_time()
        with Engine(EngineConfig(workers=1)) as engine:
            shards = table_shards(source, EngineConfig().shard_size(table_bytes(source)))
            found = find_duplicates(config, TEXT, False, source, Path(scratch), engine, shards)
        seconds = time.process_time() - started
    duplicates = set(found.rows.tolist())
    flagged = [position in duplicates for position in range(len(texts))]
    truth = [o is not None for o in origin]
    true_positive = sum(f and t for f, t in zip(flagged, truth, strict=True))
    return {
        "docs": len(texts),
        "planted_duplicates": sum(truth),
        "flagged": sum(flagged),
        "cpu_seconds": round(seconds, 2),
        "docs_per_s_one_core": round(len(texts) / seconds),
        "precision": round(true_positive / max(sum(flagged), 1), 4),
        "recall": round(true_positive / max(sum(truth), 1), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--dup-share", type=float, default=0.2, help="share of documents that are planted copies")
    parser.add_argument("--rate", type=float, default=0.05, help="per-word edit / insertion rate of a copy")
    parser.add_argument("--threshold", type=float, default=DedupConfig().threshold)
    parser.add_argument("--num-perm", type=int, default=DedupConfig().num_perm)
    parser.add_argument("--shingle-size", type=int, default=DedupConfig().shingle_size)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    texts, origin = corpus(args.docs, args.dup_share, args.rate, args.seed)
    config = DedupConfig(threshold=args.threshold, num_perm=args.num_perm, shingle_size=args.shingle_size)
    result = run(texts, origin, config)
    print(json.dumps({**result, "threshold": args.threshold, "num_perm": args.num_perm,
                      "shingle_size": args.shingle_size, "edit_rate": args.rate}, indent=2))


if __name__ == "__main__":
    main()
