"""Dedup: exact and near-duplicate removal, the train / eval split, and the contamination check.

Exact duplicates share a fingerprint of their normalized text (Unicode NFKC, folded whitespace,
optionally case-folded). Near duplicates are found with MinHash-LSH over word shingles and
confirmed on the estimated Jaccard similarity (records of several fields: also each field on its
own), shard by shard on the engine (data/duplicates.py); a cluster is a connected component of
exact and confirmed pairs, and its survivor is its first row in source order. Rows from
`data.eval_sources` form the eval split; otherwise a salted hash of each row's content picks it,
so adding data never moves a row between splits. Training rows that are exact or near duplicates
of an eval row are removed and counted as contaminated (with a hash split, dedup already keeps a
single copy of each cluster, in one split only). The splits are Parquet tables (io/tables.py),
`train/` and `eval/`, cut into parts by row position.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmops.config.engine import EngineConfig
from llmops.config.schema import DataConfig, DedupConfig, PipelineConfig
from llmops.data.duplicates import (
    Verdicts,
    eval_choices,
    find_duplicates,
    grouped,
    order_of,
    shard_index,
    unit_hash,
)
from llmops.data.validate import ValidateRecord
from llmops.io.errors import UserError
from llmops.io.figures import Figures
from llmops.io.tables import (
    ArrowPartJob,
    TableShard,
    cut_parts,
    shard_rows,
    table_bytes,
    table_files,
    table_index,
    table_schema,
    table_shards,
    write_arrow_part,
    write_index,
    write_taken,
)
from llmops.objectives import record_kind
from llmops.pipeline.engine import Engine
from llmops.pipeline.stages import StageContext
from llmops.store.artifacts import StageRecord

log = logging.getLogger("llmops.dedup")


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
    # exact duplicates that disagree with the row kept on a field their content leaves out (a classification's label;
    # the kept row's is trained on), each listed in clusters.jsonl; None in records made before they were counted
    conflicts: int | None = None
    # how the work was spread (None in records made before it was): the shard jobs of its four steps (signatures,
    # buckets, confirm, splits), workers, the peak memory of the largest worker
    shards: int | None = None
    workers: int | None = None
    peak_worker_rss_mb: float | None = None


DedupRecord = StageRecord[DedupFigures]


def dedup(config: PipelineConfig, validated: ValidateRecord, context: StageContext) -> DedupFigures:
    figures = DedupFigures(**write_splits(config.dedup, config.data, validated.dir / "valid", context.folder,
                                          config.engine))
    removed = figures.duplicates + figures.near_duplicates + figures.contaminated
    if not figures.rows_in == validated.figures.rows_kept == removed + figures.rows_out:
        raise RuntimeError(f"dedup lost rows: {validated.figures.rows_kept} in, {figures.rows_out} out, "
                           f"{removed} removed")
    if figures.conflicts:
        log.warning("%d exact duplicates disagree with the copy kept (%s): the kept copy's is trained on; each is in "
                    "%s with its conflict", figures.conflicts, ", ".join(record_kind(config.data).outside_content),
                    context.folder / "clusters.jsonl")
    for split, rows in (("train", figures.train_rows_weighted), ("eval", figures.eval_rows)):
        if rows == 0:
            raise EmptySplitError(f"the {split} split is empty after dedup ({figures.rows_out} unique rows, "
                                  f"data.eval_fraction={config.data.eval_fraction}): add data or change the "
                                  "fraction")
    return figures


SPLITS = ("train", "eval")


def split_files(relative: str) -> bool:
    return table_files(relative, SPLITS)


def write_splits(config: DedupConfig, data: DataConfig, source: Path, folder: Path,
                 engine: EngineConfig | None = None) -> dict[str, Any]:
    """Find the duplicates in the table `source` shard by shard on the engine, then write the splits shard by shard,
    in source order."""
    held_out = bool(data.eval_sources)
    kind = record_kind(data)
    settings = engine or EngineConfig()
    scratch = Path(tempfile.mkdtemp(prefix=".shards-", dir=folder))
    try:
        # one cut of the input serves both the duplicate finding and the split writing
        shards = table_shards(source, settings.shard_size(table_bytes(source)))
        # without held-out sources a hash of each row picks its split, decided while signing
        split = None if held_out else (data.split_salt, data.eval_fraction)
        with Engine(settings) as workers:
            found = find_duplicates(config, kind, held_out, source, scratch, workers, shards, split)
            counts = write_verdicts(data, source, folder, found, workers, shards, scratch)
            spread = workers.figures()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**counts, **spread}


@dataclass(frozen=True)
class SplitJob:
    data: DataConfig
    rows: TableShard
    # the verdicts of this shard's rows, and its rows that some duplicate names as its survivor (orders, ascending)
    found: Verdicts
    named: np.ndarray
    # the shard's parts: this path with .train and .eval
    target: Path
    # where signing left the shard's split choices (None with held-out sources: a row's source decides)
    evals: Path | None
    # the fields a removed exact duplicate is compared on with its survivor (the kind's outside_content)
    compared: tuple[str, ...] = ()


def write_verdicts(data: DataConfig, source: Path, folder: Path, found: Verdicts, engine: Engine,
                   shards: list[TableShard], scratch: Path) -> dict[str, Any]:
    """Survivors to the splits, shard by shard on the engine; then the others, in row order, to clusters.jsonl or
    contaminated.jsonl, naming their survivor (found by then, whichever shard it is in)."""
    starts = np.array([rows.first for rows in shards], dtype=np.uint64)
    own, named = in_shards(starts, found.rows), in_shards(starts, found.survivors)
    compared = record_kind(data).outside_content
    jobs = [SplitJob(data, rows, found.taken(own[shard]), np.unique(found.survivors[named[shard]]),
                     scratch / f"split-{shard}", None if data.eval_sources else eval_choices(scratch, shard), compared)
            for shard, rows in enumerate(shards)]
    done = engine.map("dedup: splits", split_shard, jobs, rows=lambda result: result["counts"]["rows_in"])
    # the splits keep the input's columns: its schema and its columns kept as JSON text
    schema, texts = table_schema(source), table_index(source)["json_columns"]
    for split, rows in (("train", "train_rows_weighted"), ("eval", "eval_rows")):
        # the parts on the engine too: each the next ROWS_PER_PART rows of the shards' files
        files = [(job.target.with_suffix(f".{split}"), result["counts"][rows])
                 for job, result in zip(jobs, done, strict=True)]
        parts = [ArrowPartJob(slices, schema, target) for slices, target in cut_parts(files, folder / split)]
        write_index(folder / split, engine.map(f"dedup: {split} parts", write_arrow_part, parts,
                                               rows=lambda part: part["rows"]), texts)
    counts = Counter({"rows_in": 0, "duplicates": 0, "near_duplicates": 0, "contaminated": 0, "train_rows": 0,
                      "eval_rows": 0, "train_rows_weighted": 0, "conflicts": 0})
    for result in done:
        counts.update(result["counts"])
    write_clusters(folder, [result["removed"] for result in done], [result["kept"] for result in done], compared,
                   counts)
    counts["rows_out"] = counts["train_rows"] + counts["eval_rows"]
    return {**counts, "duplicate_rate": (counts["duplicates"] + counts["near_duplicates"]) / max(counts["rows_in"], 1)}


def in_shards(starts: np.ndarray, orders: np.ndarray) -> list[np.ndarray]:
    """For each shard (given by where it starts, by position), the indices of the orders of its rows."""
    order, bounds = grouped(shard_index(starts, orders), len(starts))
    return [order[bounds[index]:bounds[index + 1]] for index in range(len(starts))]


# what the shards tell of the rows clusters.jsonl names, as Arrow columns (a few dozen bytes a row, where Python
# tuples took hundreds): the removed rows, and the survivors some removed row names. `held` is the compared fields'
# values as JSON text.
REMOVED = (("order", "int64"), ("exact", "bool_"), ("source", "string"), ("line", "int64"), ("split", "string"),
           ("survivor", "int64"), ("held", "string"))
KEPT = (("survivor", "int64"), ("kept_source", "string"), ("kept_line", "int64"), ("kept_in_eval", "bool_"),
        ("kept_held", "string"))


def arrow_columns(columns: dict[str, list[Any]], names: tuple[tuple[str, str], ...]) -> Any:
    import pyarrow as pa

    return pa.table({name: pa.array(columns[name], getattr(pa, kind)()) for name, kind in names})


def write_clusters(folder: Path, removed: list[Any], kept: list[Any], compared: tuple[str, ...],
                   counts: Counter[str]) -> None:
    """Each removed row, in row order, with its survivor's source and line: to contaminated.jsonl where a training
    row repeats an eval row (held-out sources), else to clusters.jsonl; counted by what it is."""
    import pyarrow as pa

    # an empty table of each first: an input of no rows has no shards
    removed_rows = pa.concat_tables([arrow_columns({name: [] for name, _ in REMOVED}, REMOVED), *removed])
    kept_rows = pa.concat_tables([arrow_columns({name: [] for name, _ in KEPT}, KEPT), *kept])
    ranked = np.argsort(removed_rows["order"].to_numpy())
    kept_ids = kept_rows["survivor"].to_numpy()
    by_id = np.argsort(kept_ids)
    with (folder / "clusters.jsonl").open("w", encoding="utf-8") as clusters, \
         (folder / "contaminated.jsonl").open("w", encoding="utf-8") as contaminated:
        for start in range(0, len(ranked), CLUSTER_BATCH):  # Python values for a batch at a time
            batch = removed_rows.take(ranked[start:start + CLUSTER_BATCH])
            theirs = kept_rows.take(by_id[np.searchsorted(kept_ids, batch["survivor"].to_numpy(), sorter=by_id)])
            for row, survivor in zip(batch.to_pylist(), theirs.to_pylist(), strict=True):
                entry = {"kind": "duplicate" if row["exact"] else "near_duplicate", "source": row["source"],
                         "line": row["line"], "kept_source": survivor["kept_source"],
                         "kept_line": survivor["kept_line"]}
                if row["exact"] and row["held"] != survivor["kept_held"]:
                    held, kept_held = json.loads(row["held"]), json.loads(survivor["kept_held"])
                    entry["conflict"] = {field: [own, kept] for field, own, kept in
                                         zip(compared, held, kept_held, strict=True) if own != kept}
                    counts["conflicts"] += 1
                # held out: a training row that repeats an evaluation row is contamination
                if survivor["kept_in_eval"] and row["split"] == "train":
                    counts["contaminated"] += 1
                    contaminated.write(json.dumps(entry) + "\n")
                else:
                    counts["duplicates" if row["exact"] else "near_duplicates"] += 1
                    clusters.write(json.dumps(entry) + "\n")


# removed rows written to the clusters files at a time
CLUSTER_BATCH = 8_192


def split_shard(job: SplitJob) -> dict[str, Any]:
    """One shard's survivors to its .train and .eval files (Arrow, its rows as the input holds them), in source
    order; its counts, where its named survivors went, and its rows with a duplicate before them. Only the fields
    that decide a row's fate are read as Python values."""
    held_out = bool(job.data.eval_sources)
    counts = Counter({"rows_in": 0, "train_rows": 0, "eval_rows": 0, "train_rows_weighted": 0})
    found, named = job.found.as_dict(), set(job.named.tolist())
    removed: dict[str, list[Any]] = {name: [] for name, _ in REMOVED}
    kept: dict[str, list[Any]] = {name: [] for name, _ in KEPT}
    chosen = np.load(job.evals) if job.evals else None
    # the shard's rows each split takes, by their place in the shard (a training row once per copy)
    taken: dict[str, list[int]] = {split: [] for split in SPLITS}
    for place, (position, row) in enumerate(shard_rows(job.rows, [*DECIDING, *job.compared])):
        split = row.get("_split") if held_out else None
        if held_out and split not in ("eval", "train"):
            continue
        row_id = order_of(row, position, held_out)
        counts["rows_in"] += 1
        verdict, original = found.get(row_id, ("unique", None))
        if original is not None:
            for name, value in zip(removed, (row_id, verdict == "duplicate", row["_source"], row["_line"], split,
                                             original, held_fields(row, job.compared)), strict=True):
                removed[name].append(value)
            continue
        goes_to_eval = split == "eval" if chosen is None else bool(chosen[place])
        if row_id in named:
            for name, value in zip(kept, (row_id, row["_source"], row["_line"], goes_to_eval,
                                          held_fields(row, job.compared)), strict=True):
                kept[name].append(value)
        if goes_to_eval:
            taken["eval"].append(place)
            counts["eval_rows"] += 1
            continue
        counts["train_rows"] += 1
        weighted = copies(row, job.data.split_salt)
        taken["train"].extend([place] * weighted)
        counts["train_rows_weighted"] += weighted
    write_taken(job.rows, {job.target.with_suffix(f".{split}"): places for split, places in taken.items()})
    return {"counts": dict(counts), "kept": arrow_columns(kept, KEPT), "removed": arrow_columns(removed, REMOVED)}


def held_fields(row: dict[str, Any], compared: tuple[str, ...]) -> str:
    """The values of the compared fields, as JSON text (a table column holds one type, so equal values are equal
    texts)."""
    return json.dumps([row.get(field) for field in compared], ensure_ascii=False)


# the fields that decide where a row goes: its source and line, its weight, and its held-out split
DECIDING = ("_source", "_line", "_weight", "_split")


def copies(row: dict[str, Any], salt: str) -> int:
    """How often a training row is written: its source's weight, the fraction decided by a stable hash."""
    weight = float(row.get("_weight", 1.0))
    whole = math.floor(weight)
    if weight == whole:
        return whole
    return whole + int(unit_hash(f"{salt}:weight:{row['_source']}:{row['_line']}") < weight - whole)
