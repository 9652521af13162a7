"""Data stages at scale: ingest → validate → dedup → tokenize on each engine, with time and memory per corpus size.

Generates a text corpus with planted duplicates (near copies: word edits, sentence reorders and
insertions, from bench/dedup_bench.py; and exact copies), then runs the four stages once per
engine, each in a fresh process with a workspace of its own (nothing is reused). Prints JSON:
docs/s per stage, the peak RSS of the driver and of the largest worker, dedup precision and
recall against the planted duplicates, and whether every engine made identical artifacts (the
stages' content hashes).

    python bench/data_scale_bench.py --docs 20000 100000 --engines local:1 local:2 ray:2
    python bench/data_scale_bench.py --docs 100000 --format json    # the corpus as one JSON array
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _workspace import bench_workspace
from dedup_bench import corpus


def write_corpus(path: Path, docs: int, exact_share: float, near_share: float, seed: int,
                 length: tuple[int, int], array: bool = False) -> dict[int, int | None]:
    """The corpus as JSONL text records of `length` (least, most) sentences, or as a JSON array of them, one a line
    after the bracket's; for each record's line (1-based), the line of the original it copies, if any."""
    texts, origin = corpus(docs, near_share, 0.05, seed, length)
    rng = random.Random(seed + 1)
    rows: list[tuple[str, int | None]] = []
    position_of: dict[int, int] = {}  # a document's index in `texts` -> its position in `rows`
    for index, (text, source) in enumerate(zip(texts, origin, strict=True)):
        position_of[index] = len(rows)
        rows.append((text, None if source is None else position_of[source]))
        if source is None and rng.random() < exact_share:
            rows.append((text, position_of[index]))
    lines: dict[int, int | None] = {}
    first = 2 if array else 1
    with path.open("w", encoding="utf-8") as handle:
        handle.write("[\n" if array else "")
        for position, (text, source) in enumerate(rows):
            handle.write(("," if array and position else "") + json.dumps({"text": text}) + "\n")
            lines[position + first] = None if source is None else source + first
        handle.write("]\n" if array else "")
    return lines


class Phases(logging.Handler):
    """The seconds of each engine map a stage ran (the engine's last progress line of a map says how long)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        found = PHASE.match(record.getMessage())
        if found:
            self.seconds[found.group(1)] = self.seconds.get(found.group(1), 0.0) + float(found.group(2))


PHASE = re.compile(r"^(.+?): \d+/\d+ shards, \d+ rows/s in ([\d.]+) s$")


def child(args: argparse.Namespace) -> None:
    """One engine's run of the four stages, in this process; prints its figures as one JSON line."""
    # the corpus under one name in every run, as the project's data: the records name their source, so the
    # artifacts of two bench runs can be compared too
    os.chdir(args.workdir)
    name = Path("corpus" + Path(args.corpus).suffix)
    name.symlink_to(args.corpus)
    bench_workspace(args.workdir)
    from llmops.config.engine import EngineConfig
    from llmops.config.schema import PipelineConfig
    from llmops.pipeline.engine import peak_rss_kib, start_ray
    from llmops.pipeline.runner import build_stage

    engine_name, workers = args.engine.split(":")
    shard_bytes = int(args.shard_mb * 2**20) if args.shard_mb else None
    engine = EngineConfig(name=engine_name, workers=int(workers), shard_bytes=shard_bytes)
    config = PipelineConfig(data={"kind": "text", "path": str(name), "eval_fraction": 0.02},
                            validate={"max_chars": 100_000}, engine=engine,
                            tokenize={"max_length": args.max_length,
                                      **({"tokenizer": args.tokenizer} if args.tokenizer else {})})
    phases = Phases()
    logging.getLogger("llmops.engine").addHandler(phases)
    logging.getLogger("llmops.engine").setLevel(logging.INFO)
    started = time.perf_counter()
    if engine_name == "ray":
        start_ray(engine)
    out: dict = {"engine": args.engine, "start_s": round(time.perf_counter() - started, 2), "stages": {}}
    records: dict = {}
    for stage, upstream in STAGES[:STAGES.index(next(s for s in STAGES if s[0] == args.through)) + 1]:
        started = time.perf_counter()
        records[stage] = build_stage(stage, config, *(records[up] for up in upstream))
        seconds = time.perf_counter() - started
        out["stages"][stage] = {"seconds": round(seconds, 2), "docs_per_s": round(args.rows / seconds),
                                "peak_worker_rss_mb": records[stage].figures.peak_worker_rss_mb,
                                "hash": records[stage].hash}
    out["ingest_to_dedup_docs_per_s"] = round(args.rows / sum(out["stages"][s]["seconds"]
                                                              for s in ("ingest", "validate", "dedup")))
    out["phases_s"] = {label: round(seconds, 2) for label, seconds in phases.seconds.items()}
    figures = records["dedup"].figures
    out["dedup"] = {key: getattr(figures, key) for key in ("rows_in", "duplicates", "near_duplicates", "rows_out",
                                                           "shards", "workers")}
    if "tokenize" in records:
        out["tokenize"] = tokenize_figures(records["tokenize"], phases, out["stages"]["tokenize"]["seconds"],
                                           int(workers))
    out["driver_peak_rss_mb"] = round(peak_rss_kib() / 1024, 1)
    flagged = [json.loads(line)["line"] for line in (records["dedup"].dir / "clusters.jsonl").open()]
    Path(args.flagged).write_text(json.dumps(flagged))
    print(json.dumps(out))


STAGES = (("ingest", ()), ("validate", ("ingest",)), ("dedup", ("validate",)), ("tokenize", ("dedup",)))


def tokenize_figures(record: Any, phases: Phases, seconds: float, workers: int) -> dict:
    # what the tokenizer read: every token of every row, the ones max_length cut off included
    split = (record.figures.train, record.figures.eval)
    tokens = sum(part.tokens + (part.truncated_tokens or 0) for part in split)
    encoding = sum(seconds for label, seconds in phases.seconds.items() if label.startswith("tokenize:"))
    return {"tokens": tokens, "kept_tokens": sum(part.tokens for part in split),
            "tokens_per_s": round(tokens / seconds),
            "encoding_tokens_per_s_per_worker": round(tokens / encoding / workers)}


def pretrained_tokenizer(corpus: Path, folder: Path, vocab_size: int, sample: int) -> Path:
    """A byte-level BPE tokenizer trained on the corpus's first `sample` documents, saved as a pretrained one
    (a team fine-tunes a base model whose tokenizer exists): tokenize then only encodes."""
    from llmops.text.tokenizers import train_bpe

    with corpus.open(encoding="utf-8") as handle:
        records = (line.lstrip(",") for line in handle if line.strip() not in ("[", "]"))
        texts = [json.loads(line)["text"] for line, _ in zip(records, range(sample), strict=False)]
    train_bpe(texts, vocab_size).save_pretrained(folder)
    return folder


def quality(flagged: list[int], truth: dict[int, int | None]) -> dict[str, float]:
    planted = {line for line, source in truth.items() if source is not None}
    hits = len(planted & set(flagged))
    return {"planted": len(planted), "flagged": len(flagged), "precision": round(hits / max(len(flagged), 1), 4),
            "recall": round(hits / max(len(planted), 1), 4)}


def run_size(docs: int, args: argparse.Namespace, folder: Path) -> dict:
    path = folder / f"corpus-{docs}.{args.format}"
    truth = write_corpus(path, docs, args.exact_share, args.near_share, args.seed, tuple(args.sentences),
                         array=args.format == "json")
    tokenizer = args.tokenizer
    if tokenizer is None and args.through == "tokenize":
        tokenizer = str(pretrained_tokenizer(path, folder / f"tokenizer-{docs}", 32_000, 20_000))
    runs = []
    for engine in args.engines:
        flagged = folder / f"flagged-{docs}-{engine.replace(':', '-')}.json"
        workdir = tempfile.mkdtemp(dir=folder)
        command = [sys.executable, __file__, "--child", "--engine", engine, "--corpus", str(path), "--rows",
                   str(len(truth)), "--flagged", str(flagged), "--workdir", workdir,
                   "--max-length", str(args.max_length), "--through", args.through,
                   *(["--tokenizer", tokenizer] if tokenizer else []),
                   *(["--shard-mb", str(args.shard_mb)] if args.shard_mb else [])]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        shutil.rmtree(workdir)  # a million documents leave gigabytes of artifacts per engine
        if done.returncode:
            raise SystemExit(f"{engine} failed:\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["dedup_quality"] = quality(json.loads(flagged.read_text()), truth)
        runs.append(result)
    hashes = {json.dumps({s: v["hash"] for s, v in run["stages"].items()}) for run in runs}
    return {"docs": len(truth), "megabytes": round(path.stat().st_size / 2**20, 1), "runs": runs,
            "identical_across_engines": len(hashes) == 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, nargs="+", default=[20_000, 100_000])
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--engines", nargs="+", default=["local:1", "local:2", "ray:2"])
    parser.add_argument("--exact-share", type=float, default=0.05, help="share of originals copied verbatim")
    parser.add_argument("--near-share", type=float, default=0.15, help="share of documents that are near copies")
    parser.add_argument("--format", choices=["jsonl", "json"], default="jsonl",
                        help="the corpus as JSON Lines, or as one JSON array (cut at its objects)")
    parser.add_argument("--shard-mb", type=float, help="engine.shard_bytes, in MiB (default: the engine's own choice)")
    parser.add_argument("--sentences", type=int, nargs=2, default=[12, 30], metavar=("LEAST", "MOST"),
                        help="sentences of 8-20 words per document (12-30: about 300 words)")
    parser.add_argument("--tokenizer", help="a pretrained tokenizer's folder (default: a 32k BPE trained on the "
                                            "corpus's first 20k documents)")
    parser.add_argument("--max-length", type=int, default=1024, help="tokenize.max_length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--through", choices=[stage for stage, _ in STAGES], default="tokenize",
                        help="the last stage to run (dedup: ingest → validate → dedup only, no tokenizer trained)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--flagged", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="llmops-scale-") as scratch:
        print(json.dumps([run_size(docs, args, Path(scratch)) for docs in args.docs], indent=2))


if __name__ == "__main__":
    main()
