"""Dedup: exact and near-duplicate removal, the train / eval split, and the contamination check.

Exact duplicates share a fingerprint of their normalized text (Unicode NFKC, folded whitespace,
optionally case-folded). Near duplicates are found with MinHash-LSH over word shingles and
confirmed on the estimated Jaccard similarity. The survivor of each cluster is its first row in
source order. Rows from `data.eval_sources` form the eval split; otherwise a salted hash of each
row's content picks it, so adding data never moves a row between splits. Training rows that are
exact or near duplicates of an eval row are removed and counted as contaminated (with a hash
split, dedup already keeps a single copy of each cluster, in one split only).
"""

from __future__ import annotations

import hashlib
import json
import math
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmops.core.artifacts import Figures, StageRecord
from llmops.core.config import DataConfig, DedupConfig, PipelineConfig
from llmops.core.errors import UserError
from llmops.core.workspace import read_jsonl
from llmops.data.validate import ValidateRecord
from llmops.objectives import record_kind
from llmops.objectives.records import RecordKind


class EmptySplitError(UserError, ValueError):
    """A split came out empty: there is nothing to train on, or nothing to evaluate on."""


class DedupFigures(Figures):
    rows_in: int
    duplicates: int
    near_duplicates: int
    contaminated: int
    train_rows: int
    eval_rows: int
    # training rows as written, source weights applied
    train_rows_weighted: int
    rows_out: int
    duplicate_rate: float


DedupRecord = StageRecord[DedupFigures]


def dedup(config: PipelineConfig, validated: ValidateRecord, folder: Path) -> DedupFigures:
    figures = DedupFigures(**write_splits(config.dedup, config.data, validated.dir / "valid.jsonl", folder))
    removed = figures.duplicates + figures.near_duplicates + figures.contaminated
    if not figures.rows_in == validated.figures.rows_kept == removed + figures.rows_out:
        raise RuntimeError(f"dedup lost rows: {validated.figures.rows_kept} in, {figures.rows_out} out, "
                           f"{removed} removed")
    for split, rows in (("train", figures.train_rows_weighted), ("eval", figures.eval_rows)):
        if rows == 0:
            raise EmptySplitError(f"the {split} split is empty after dedup ({figures.rows_out} unique rows, "
                                  f"data.eval_fraction={config.data.eval_fraction}): add data or change the "
                                  "fraction")
    return figures


def split_files(relative: str) -> bool:
    return relative in ("train.jsonl", "eval.jsonl")


def normalize(text: str, casefold: bool) -> str:
    """NFKC, whitespace runs folded to one space, optionally case-folded."""
    if not text.isascii():  # NFKC leaves ASCII as it is
        text = unicodedata.normalize("NFKC", text)
    text = " ".join(text.split())
    return text.casefold() if casefold else text


# joins a record's fields: not whitespace (normalizing must not merge fields) and never in valid content
FIELD_SEPARATOR = "\x00"


def record_text(row: dict[str, Any], kind: RecordKind) -> str:
    return FIELD_SEPARATOR.join(kind.content(row))


def normalized_record(row: dict[str, Any], kind: RecordKind) -> str:
    """Each field normalized on its own, so that normalizing never moves text across fields."""
    return FIELD_SEPARATOR.join(normalize(field, casefold=False) for field in kind.content(row))


def split_fingerprint(row: dict[str, Any], kind: RecordKind, casefold: bool) -> str:
    text = normalized_record(row, kind)
    return digest(text.casefold() if casefold else text)


def digest(normalized: str) -> str:
    return hashlib.sha1(normalized.encode()).hexdigest()


def in_eval(fingerprint_hex: str, salt: str, fraction: float) -> bool:
    return unit_hash(salt + fingerprint_hex) < fraction


def unit_hash(value: str) -> float:
    """A stable number in [0, 1) for `value`."""
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:8], "big") / 2**64


def shingles(words: list[str], size: int) -> list[str]:
    """Overlapping runs of `size` words."""
    if len(words) <= size:
        return [" ".join(words)]
    return list(map(" ".join, zip(*(words[i:] for i in range(size)), strict=False)))


class NearDuplicateIndex:
    """MinHash-LSH over word shingles; a candidate counts only if its estimated Jaccard passes the threshold."""

    def __init__(self, config: DedupConfig) -> None:
        from rensa import RMinHashLSH

        self.config = config
        self.lsh = RMinHashLSH(threshold=config.threshold, num_perm=config.num_perm,
                               num_bands=bands_for(config.threshold, config.num_perm))
        self.minhashes: list[Any] = []
        self.ids: list[int] = []

    def signature(self, words: list[str]) -> Any:
        from rensa import RMinHash

        minhash = RMinHash(num_perm=self.config.num_perm, seed=self.config.seed)
        minhash.update(shingles(words, self.config.shingle_size))
        return minhash

    def match(self, minhash: Any) -> int | None:
        """The id of the earliest indexed row this one nearly duplicates, if any."""
        matches = [key for key in self.lsh.query(minhash)
                   if minhash.jaccard(self.minhashes[key]) >= self.config.threshold]
        return self.ids[min(matches)] if matches else None

    def add(self, row_id: int, minhash: Any) -> None:
        self.lsh.insert(len(self.minhashes), minhash)
        self.minhashes.append(minhash)
        self.ids.append(row_id)


def bands_for(threshold: float, num_perm: int) -> int:
    """The band count whose LSH S-curve, (1/b)^(1/r), crosses closest below the threshold, for recall."""
    options = [b for b in range(1, num_perm + 1) if num_perm % b == 0]
    below = [b for b in options if (1 / b) ** (b / num_perm) <= threshold * 0.9]
    return min(below) if below else max(options)


class Deduplicator:
    """Exact then near-duplicate detection, in source order: the first row of each cluster survives."""

    def __init__(self, config: DedupConfig, kind: RecordKind) -> None:
        self.config, self.kind = config, kind
        self.exact: dict[str, int] = {}
        self.near = NearDuplicateIndex(config) if config.near_duplicates else None

    def check(self, row_id: int, row: dict[str, Any]) -> tuple[str, int | None]:
        """('unique', None), or ('duplicate' | 'near_duplicate', id of the row it duplicates)."""
        text = normalized_record(row, self.kind)
        mark = digest(text.casefold() if self.config.casefold else text)
        if mark in self.exact:
            return "duplicate", self.exact[mark]
        self.exact[mark] = row_id
        words = self.near_words(text)
        if words is None or self.near is None:
            return "unique", None
        minhash = self.near.signature(words)
        match = self.near.match(minhash)
        if match is not None:
            # exact copies of this row belong to the same cluster, whose survivor is `match`
            self.exact[mark] = match
            return "near_duplicate", match
        self.near.add(row_id, minhash)
        return "unique", None

    def near_words(self, normalized: str) -> list[str] | None:
        """The case-folded words that near-duplicate detection compares; None for records too short for it."""
        words = normalized.casefold().replace(FIELD_SEPARATOR, " ").split()
        return words if len(words) >= self.config.min_words else None


def numbered(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    yield from enumerate(read_jsonl(path))


def write_splits(config: DedupConfig, data: DataConfig, source: Path, folder: Path) -> dict[str, Any]:
    counts = {"rows_in": 0, "duplicates": 0, "near_duplicates": 0, "contaminated": 0, "train_rows": 0,
              "eval_rows": 0, "train_rows_weighted": 0}
    held_out = bool(data.eval_sources)
    kind = record_kind(data)
    index = Deduplicator(config, kind)
    kept_at: dict[int, tuple[str, int, bool]] = {}
    with (folder / "clusters.jsonl").open("w", encoding="utf-8") as clusters, \
         (folder / "contaminated.jsonl").open("w", encoding="utf-8") as contaminated, \
         (folder / "train.jsonl").open("w", encoding="utf-8") as train, \
         (folder / "eval.jsonl").open("w", encoding="utf-8") as evaluation:
        # held-out rows first: a training row that repeats one of them is contamination
        for split in ("eval", "train") if held_out else (None,):
            for row_id, row in numbered(source):
                if split is not None and row.get("_split") != split:
                    continue
                counts["rows_in"] += 1
                verdict, original = index.check(row_id, row)
                if original is not None:
                    kept_source, kept_line, kept_in_eval = kept_at[original]
                    entry = {"kind": verdict, "source": row["_source"], "line": row["_line"],
                             "kept_source": kept_source, "kept_line": kept_line}
                    if kept_in_eval and split == "train":
                        counts["contaminated"] += 1
                        contaminated.write(json.dumps(entry) + "\n")
                    else:
                        counts["duplicates" if verdict == "duplicate" else "near_duplicates"] += 1
                        clusters.write(json.dumps(entry) + "\n")
                    continue
                goes_to_eval = split == "eval" if held_out else in_eval(
                    split_fingerprint(row, kind, config.casefold), data.split_salt, data.eval_fraction)
                kept_at[row_id] = (row["_source"], row["_line"], goes_to_eval)
                line = json.dumps(row, ensure_ascii=False) + "\n"
                if goes_to_eval:
                    evaluation.write(line)
                    counts["eval_rows"] += 1
                    continue
                counts["train_rows"] += 1
                for _ in range(copies(row, data.split_salt)):
                    train.write(line)
                    counts["train_rows_weighted"] += 1
    counts["rows_out"] = counts["train_rows"] + counts["eval_rows"]
    counts["duplicate_rate"] = (counts["duplicates"] + counts["near_duplicates"]) / max(counts["rows_in"], 1)
    return counts


def copies(row: dict[str, Any], salt: str) -> int:
    """How often a training row is written: its source's weight, the fraction decided by a stable hash."""
    weight = float(row.get("_weight", 1.0))
    whole = math.floor(weight)
    extra = unit_hash(f"{salt}:weight:{row['_source']}:{row['_line']}") < weight - whole
    return whole + int(extra)
