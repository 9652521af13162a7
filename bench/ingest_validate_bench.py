"""Ingest + validate benchmark: rows per second and peak memory on a large JSONL file.

Writes a JSONL file of instruction records (about 1% of them malformed in the ways the
quarantine handles), then runs the ingest and validate stages on it in this process and prints
rows/s, MB/s and the process's peak resident memory before, after ingest and after validate:
both stages stream, so the peak stays flat whatever the file's size. The run needs free disk for
the file and about two copies of it (ingest's records, validate's valid rows); the files are
removed at the end unless --workdir names a folder to keep them in.

    python bench/ingest_validate_bench.py --gigabytes 1
    python bench/ingest_validate_bench.py --gigabytes 5 --max-rss-mb 1024
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

from _workspace import bench_workspace

WORDS = [f"w{i}" for i in range(5000)]


def write_file(path: Path, target_bytes: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    rows = 0
    with path.open("wb") as handle:
        while handle.tell() < target_bytes:
            rows += 1
            roll = rng.random()
            if roll < 0.004:
                handle.write(b'{"instruction": "broken", "output": \n')
                continue
            if roll < 0.008:
                handle.write(b'{"instruction": "bytes \xff", "output": "x"}\n')
                continue
            record = {"instruction": "Summarize the passage.",
                      "input": " ".join(rng.choices(WORDS, k=rng.randint(60, 180))),
                      "output": "" if roll < 0.01 else " ".join(rng.choices(WORDS, k=rng.randint(5, 30)))}
            handle.write(json.dumps(record).encode() + b"\n")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--workdir", default=None, help="folder for the file and the artifacts, kept (default: a "
                        "temp dir, removed at the end)")
    parser.add_argument("--max-rss-mb", type=float, default=None, help="exit 1 when the peak resident memory of "
                        "the stages is over this")
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="validate.chunk_rows, the rows validated at a time (default: the config's)")
    args = parser.parse_args()
    workdir = bench_workspace(args.workdir)
    try:
        peak = run(workdir, args.gigabytes, args.chunk_rows)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.max_rss_mb is not None and peak > args.max_rss_mb:
        print(f"peak resident memory {peak:.0f} MB is over {args.max_rss_mb:.0f} MB", file=sys.stderr)
        sys.exit(1)


def peak_rss_mb() -> float:
    from llmops.pipeline.engine import peak_rss_kib

    return peak_rss_kib() / 1024


def run(workdir: Path, gigabytes: float, chunk_rows: int | None) -> float:
    """Write the file, ingest and validate it; print the figures; return the peak resident memory in MB."""

    from llmops.config.schema import DataConfig, PipelineConfig, ValidateConfig
    from llmops.pipeline.runner import build_stage

    data_file = workdir / "big.jsonl"
    started = time.perf_counter()
    rows = write_file(data_file, int(gigabytes * 2**30))
    print(f"wrote {rows:,} rows, {data_file.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - started:.0f}s",
          flush=True)
    baseline_mb = peak_rss_mb()

    data = DataConfig(path=str(data_file))
    started = time.perf_counter()
    ingested = build_stage("ingest", PipelineConfig(data=data))
    ingest_seconds = time.perf_counter() - started
    after_ingest_mb = peak_rss_mb()
    started = time.perf_counter()
    checks = ValidateConfig(max_bad_fraction=1.0, **({"chunk_rows": chunk_rows} if chunk_rows else {}))
    validated = build_stage("validate", PipelineConfig(validate=checks, data=data), ingested)
    validate_seconds = time.perf_counter() - started
    peak_mb = peak_rss_mb()
    size_mb = data_file.stat().st_size / 2**20
    total = ingest_seconds + validate_seconds
    print(json.dumps({
        "file_gib": round(size_mb / 1024, 2),
        "rows_read": ingested.figures.rows_read,
        "rows_kept": validated.figures.rows_kept,
        "rows_quarantined": validated.figures.rows_quarantined,
        "quarantined_by_code": {str(code): count for code, count in validated.figures.codes.items()},
        "ingest_seconds": round(ingest_seconds, 1),
        "validate_seconds": round(validate_seconds, 1),
        "rows_per_s": round(ingested.figures.rows_read / total),
        "mb_per_s": round(size_mb / total, 1),
        "peak_rss_before_stages_mb": round(baseline_mb),
        "peak_rss_after_ingest_mb": round(after_ingest_mb),
        "peak_rss_mb": round(peak_mb),
    }, indent=2))
    return peak_mb


if __name__ == "__main__":
    main()
