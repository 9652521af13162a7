"""Dedup: drop exact duplicates of normalized text, then split train / eval by a salted hash.

The survivor of each duplicate group is its first row in source order. The split depends only
on a row's own content, so adding data never moves an existing row between train and eval.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import unicodedata
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.config import DataConfig, DedupConfig, PipelineConfig, RecordKind
from tasks import tracking, workspace
from tasks.tracking import RunHandle
from tasks.workspace import StageRecord

CONTENT_FIELDS = {"text": ("text",), "instruction": ("instruction", "input", "output")}
WHITESPACE = re.compile(r"\s+")


class EmptySplitError(ValueError):
    """A split came out empty: there is nothing to train on, or nothing to evaluate on."""


def dedup(config: DedupConfig, data: DataConfig, validated: StageRecord) -> StageRecord:
    relevant = {**config.model_dump(), "eval_fraction": data.eval_fraction, "split_salt": data.split_salt}
    key = workspace.stage_key("dedup", relevant, [validated], workspace.code_version(sys.modules[__name__]),
                              kind=data.kind)

    def build(folder: Path) -> tuple[str, dict[str, Any]]:
        stats = split_unique_rows(config, data, validated.dir / "valid.jsonl", folder)
        assert stats["rows_in"] == validated.stats["rows_kept"], "dedup lost rows"
        for split in ("train", "eval"):
            if stats[f"{split}_rows"] == 0:
                raise EmptySplitError(f"the {split} split is empty after dedup ({stats['rows_out']} unique rows, "
                                      f"data.eval_fraction={data.eval_fraction}): add data or change the fraction")
        content = workspace.hash_file(folder / "train.jsonl") + workspace.hash_file(folder / "eval.jsonl")
        return workspace.hash_json(content), stats

    return workspace.build_artifact("dedup", key, build)


def normalize(text: str, casefold: bool) -> str:
    """NFKC, whitespace runs folded to one space, optionally case-folded."""
    text = WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip()
    return text.casefold() if casefold else text


def fingerprint(row: dict[str, Any], kind: RecordKind, casefold: bool) -> str:
    parts = [normalize(row.get(field) or "", casefold) for field in CONTENT_FIELDS[kind]]
    return hashlib.sha1("\x1f".join(parts).encode()).hexdigest()


def in_eval(fingerprint_hex: str, salt: str, fraction: float) -> bool:
    bucket = int.from_bytes(hashlib.sha256((salt + fingerprint_hex).encode()).digest()[:8], "big")
    return bucket / 2**64 < fraction


def split_unique_rows(config: DedupConfig, data: DataConfig, source: Path, folder: Path) -> dict[str, Any]:
    first_seen: dict[str, tuple[str, int]] = {}
    counts = {"rows_in": 0, "duplicates": 0, "train_rows": 0, "eval_rows": 0}
    with (folder / "train.jsonl").open("w", encoding="utf-8") as train, \
         (folder / "eval.jsonl").open("w", encoding="utf-8") as evaluation, \
         (folder / "duplicates.jsonl").open("w", encoding="utf-8") as dupes:
        for row in workspace.read_jsonl(source):
            counts["rows_in"] += 1
            mark = fingerprint(row, data.kind, config.casefold)
            if mark in first_seen:
                counts["duplicates"] += 1
                kept_source, kept_line = first_seen[mark]
                dupes.write(json.dumps({"source": row["_source"], "line": row["_line"], "kept_source": kept_source,
                                        "kept_line": kept_line}) + "\n")
                continue
            first_seen[mark] = (row["_source"], row["_line"])
            split = "eval" if in_eval(mark, data.split_salt, data.eval_fraction) else "train"
            (evaluation if split == "eval" else train).write(json.dumps(row, ensure_ascii=False) + "\n")
            counts[f"{split}_rows"] += 1
    counts["rows_out"] = counts["train_rows"] + counts["eval_rows"]
    counts["duplicate_rate"] = counts["duplicates"] / counts["rows_in"] if counts["rows_in"] else 0.0
    return counts


@task(name="dedup", cache_policy=NO_CACHE)
def dedup_task(config: PipelineConfig, validated: StageRecord, run: RunHandle) -> StageRecord:
    return tracking.tracked(run, lambda: dedup(config.dedup, config.data, validated))
