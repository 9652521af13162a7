"""Finding exact and near duplicates shard by shard, with memory bounded by a shard rather than by the corpus.

1. sign: each shard of the input table, in parallel, gives per row its order (its position in the
   table; with held-out sources, eval rows come first), the fingerprint of its normalized text and,
   for rows long enough, a MinHash signature over word shingles and the record's number of fields.
   Fingerprints and LSH band hashes are spilled to partitions by hash; the signatures and field
   counts stay in a file per shard.
2. bucket: each partition, in parallel, pairs every row with the first row of its bucket (rows of
   one fingerprint, or of one band hash).
3. confirm: candidate pairs, grouped by the shards of their two rows, are kept when the estimated
   Jaccard similarity of the two signatures passes the threshold; a worker holds at most the
   signatures of two shards. Records of more than one field (a chat's turns, a QA record's context,
   question and answers) must also be near field by field (data/near_fields.py): a long field that
   distinct records share must not make them duplicates. Those pairs' rows are read back from the
   table (only the row groups that hold them), at most the rows of two shards at a time.
4. cluster: connected components over the exact and confirmed pairs; the first row of each
   component survives. Only rows with a duplicate reach this step, and as numbers, not signatures.

Everything is ordered and keyed by row order, which the data fixes: the verdicts are the same
whatever the shard size, the number of workers or the engine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmops.config.schema import DedupConfig
from llmops.data.near_fields import fields_near, normalize, unspaced_apart_arrow
from llmops.io.tables import TableShard, shard_rows
from llmops.pipeline.engine import Engine
from llmops.records.base import RecordKind

# joins a record's fields: not whitespace (normalizing must not merge fields) and never in valid content
FIELD_SEPARATOR = "\x00"
# added to the position of a training row when eval rows come from held-out sources: they are seen first
TRAIN_AFTER = 1 << 48
# rows signed at once by rensa: enough to amortize the call, few enough to keep a shard's shingles small
SIGN_BATCH = 2000
# shards whose spilled hashes one bucket job holds: fewer partitions means fewer files to read
SHARDS_PER_PARTITION = 4
# 64-bit mixing constants (splitmix64) for the word, shingle and band hashes
MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))

# a verdict: ("duplicate" | "near_duplicate", order of the row that survives)
Verdict = tuple[str, int]


def normalized_record(row: dict[str, Any], kind: RecordKind) -> str:
    """Each field normalized on its own, so that normalizing never moves text across fields."""
    return FIELD_SEPARATOR.join(normalize(field, casefold=False) for field in kind.content(row))


def near_text(normalized: str) -> str:
    """What near-duplicate detection compares: the case-folded text, its words separated by spaces (normalizing
    left single spaces, and fields joined by FIELD_SEPARATOR)."""
    return normalized.casefold().replace(FIELD_SEPARATOR, " ")


def word_hashes(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A 64-bit hash of every word of the texts (split at ASCII whitespace, the only whitespace a normalized text
    holds; a character of a script without spaces is a word), flat and in order, and each text's word count.
    Arrow splits and finds the distinct words, and only those are hashed (a Python string per word was slow)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc

    split = pc.ascii_split_whitespace(unspaced_apart_arrow(pa.array(texts, type=pa.large_string())))
    flat, text_of = pc.list_flatten(split), pc.list_parent_indices(split).to_numpy(zero_copy_only=False)
    # Arrow splits an empty word off a leading or trailing space and between two (an empty field leaves them);
    # Python's split, the words meant, has none
    present = pc.greater(pc.binary_length(flat), 0)
    words = pc.dictionary_encode(flat.filter(present))
    # SipHash with pandas' fixed key: the same value in every process and run
    distinct = pd.util.hash_array(words.dictionary.to_numpy(zero_copy_only=False), categorize=False)
    counts = np.bincount(text_of[present.to_numpy(zero_copy_only=False)], minlength=len(texts))
    return distinct[words.indices.to_numpy(zero_copy_only=False)], counts


def shingle_hashes(words: np.ndarray, counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The hashes of each text's runs of `size` words (one run of all of them when it has no more than `size`),
    flat, and where each text's start: the texts' words given flat, with their counts."""
    ends = np.cumsum(counts)
    starts = ends - counts
    # runs[k][i]: the hash of the k + 1 words from position i on, for every i, whatever text they fall in (those
    # that cross into the next text are never taken): no masks over the words, only gathers of the runs kept
    padded = np.concatenate([words, np.zeros(size, np.uint64)])
    runs = [words]
    for step in range(1, size):
        runs.append(mixed(runs[-1]) ^ padded[step:step + len(words)])
    whole = counts >= size
    taken = np.where(whole, counts - size + 1, np.minimum(counts, 1))
    offsets = np.concatenate([[0], np.cumsum(taken)])
    hashes = runs[-1][np.arange(offsets[-1]) - np.repeat(offsets[:-1] - starts, taken)]
    for length in range(1, size):  # a text of fewer words: one run of them all
        short = np.flatnonzero(counts == length)
        hashes[offsets[short]] = runs[length - 1][starts[short]]
    return hashes, offsets.astype(np.uint64)


def mixed(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit moves every output bit."""
    values = (values ^ (values >> np.uint64(30))) * MIX[1]
    values = (values ^ (values >> np.uint64(27))) * MIX[2]
    return values ^ (values >> np.uint64(31))


def sign_texts(texts: list[str], config: DedupConfig) -> tuple[np.ndarray, np.ndarray]:
    """Which texts have min_words words, and their MinHash signatures over word shingles."""
    from rensa import RMinHash

    words, counts = word_hashes(texts)
    enough = counts >= config.min_words
    if not enough.all():
        words = words[np.repeat(enough, counts)]
    flat, offsets = shingle_hashes(words, counts[enough], config.shingle_size)
    matrix = RMinHash.digest_matrix_from_flat_token_hashes(flat, offsets, num_perm=config.num_perm,
                                                            seed=config.seed)
    return enough, np.array(matrix.to_rows(), dtype=np.uint32).reshape(-1, config.num_perm)


def bands_for(threshold: float, num_perm: int) -> int:
    """The band count whose LSH S-curve, (1/b)^(1/r), crosses closest below the threshold, for recall."""
    options = [b for b in range(1, num_perm + 1) if num_perm % b == 0]
    below = [b for b in options if (1 / b) ** (b / num_perm) <= threshold * 0.9]
    return min(below) if below else max(options)


def order_of(row: dict[str, Any], position: int, held_out: bool) -> int:
    return position + (TRAIN_AFTER if held_out and row.get("_split") != "eval" else 0)


def in_eval(fingerprint_hex: str, salt: str, fraction: float) -> bool:
    """Whether a row of this fingerprint goes to the eval split, when no held-out source decides."""
    return unit_hash(salt + fingerprint_hex) < fraction


def shard_index(starts: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """The shard of each row, by its order: shards given by the positions they start at, ascending."""
    return np.searchsorted(starts, orders % np.uint64(TRAIN_AFTER), side="right") - 1


def grouped(keys: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The indices of `keys` (ints in [0, count)) stably sorted by key, and where each key's run begins (count + 1)."""
    return np.argsort(keys, kind="stable"), np.concatenate([[0], np.cumsum(np.bincount(keys, minlength=count))])


def unit_hash(value: str) -> float:
    """A stable number in [0, 1) for `value`."""
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:8], "big") / 2**64


@dataclass(frozen=True)
class SignJob:
    rows: TableShard
    shard: int
    scratch: Path
    partitions: int
    config: DedupConfig
    kind: RecordKind
    held_out: bool
    # (split salt, eval fraction) where a hash of the row picks its split: the choice is made here, from the
    # fingerprint signing computes anyway, and read back when the splits are written
    split: tuple[str, float] | None = None


def sign_shard(job: SignJob) -> int:
    """Fingerprints and band hashes of one shard spilled to partitions, its signatures to a file, which of its
    rows go to eval (when a hash picks) to another; the rows read."""
    config = job.config
    orders: list[int] = []
    marks: list[bytes] = []
    evals: list[bool] = []
    near: list[np.ndarray] = []
    signed: list[np.ndarray] = []
    widths: list[np.ndarray] = []
    pending: list[str] = []
    fields: list[int] = []

    def sign_pending() -> None:
        enough, matrix = sign_texts(pending, config)
        near.append(np.array(orders[len(orders) - len(pending):], dtype=np.uint64)[enough])
        signed.append(matrix)
        widths.append(np.array(fields, dtype=np.uint32)[enough])
        pending.clear()
        fields.clear()

    # only what the content and the order are made of: a row's other columns would be Python values for nothing
    for position, row in shard_rows(job.rows, [*job.kind.fields, "_split"]):
        orders.append(order_of(row, position, job.held_out))
        text = normalized_record(row, job.kind)
        fingerprint = hashlib.sha1((text.casefold() if config.casefold else text).encode()).digest()
        marks.append(fingerprint[:16])
        if job.split:
            evals.append(in_eval(fingerprint.hex(), *job.split))
        if config.near_duplicates:
            pending.append(near_text(text))
            fields.append(text.count(FIELD_SEPARATOR) + 1)
            if len(pending) == SIGN_BATCH:
                sign_pending()
    if pending:
        sign_pending()
    if job.split:
        np.save(eval_choices(job.scratch, job.shard), np.array(evals, dtype=bool))
    order = np.array(orders, dtype=np.uint64)
    fingerprint = np.frombuffer(b"".join(marks), dtype=np.uint64).reshape(-1, 2)
    spill(job, "exact", np.column_stack([fingerprint, order]) if len(order) else np.zeros((0, 3), np.uint64))
    matrix = np.concatenate(signed) if signed else np.zeros((0, config.num_perm), np.uint32)
    near_order = np.concatenate(near) if near else np.zeros(0, np.uint64)
    np.save(job.scratch / f"sigs-{job.shard}.npy", matrix)
    np.save(job.scratch / f"sig-orders-{job.shard}.npy", near_order)
    np.save(job.scratch / f"sig-fields-{job.shard}.npy", np.concatenate(widths) if widths else np.zeros(0, np.uint32))
    hashes = band_hashes(matrix, bands_for(config.threshold, config.num_perm))
    spill(job, "bands", np.column_stack([hashes.ravel(), np.repeat(near_order, hashes.shape[1])]))
    return len(orders)


def eval_choices(scratch: Path, shard: int) -> Path:
    """Where signing leaves a shard's split choices: one bool per row, in row order."""
    return scratch / f"evals-{shard}.npy"


def band_hashes(matrix: np.ndarray, bands: int) -> np.ndarray:
    """One 64-bit hash per row and band, the band's index mixed in, so that equal values in two bands differ."""
    values = matrix.reshape(len(matrix), bands, matrix.shape[1] // bands).astype(np.uint64)
    hashed = np.broadcast_to(np.arange(bands, dtype=np.uint64) * MIX[0], values.shape[:2]).copy()
    for column in range(values.shape[2]):
        hashed = (hashed ^ values[:, :, column]) * MIX[1]
        hashed ^= hashed >> np.uint64(31)
    return hashed * MIX[2]


def spill(job: SignJob, name: str, rows: np.ndarray) -> None:
    """Rows grouped by partition (their first column's hash) to one file per shard, with where each partition
    starts in it."""
    order, bounds = grouped((rows[:, 0] % np.uint64(job.partitions)).astype(np.int64), job.partitions)
    np.save(job.scratch / f"{name}-{job.shard}.npy", rows[order])
    np.save(job.scratch / f"{name}-starts-{job.shard}.npy", bounds)


def partition_of(scratch: Path, name: str, shard: int, partition: int) -> np.ndarray:
    """One partition's rows of one shard's spill, read without loading the rest."""
    starts = np.load(scratch / f"{name}-starts-{shard}.npy")
    return np.array(np.load(scratch / f"{name}-{shard}.npy", mmap_mode="r")[starts[partition]:starts[partition + 1]])


@dataclass(frozen=True)
class BucketJob:
    scratch: Path
    partition: int
    # where each shard starts, by position
    starts: np.ndarray


def bucket_partition(job: BucketJob) -> np.ndarray:
    """The exact pairs of one partition, (row, first row of its fingerprint); its candidate pairs (row, first row
    of a band bucket) are spilled by the shard of their row, for that shard's confirm job."""
    shards = len(job.starts)

    def load(name: str, width: int) -> np.ndarray:
        parts = [partition_of(job.scratch, name, shard, job.partition) for shard in range(shards)]
        return np.concatenate(parts) if parts else np.zeros((0, width), np.uint64)

    exact = load("exact", 3)
    bands = load("bands", 2)
    candidates = unique_rows(first_of_bucket(bands[:, :1], bands[:, 1]))
    order, bounds = grouped(shard_index(job.starts, candidates[:, 0]), shards)
    np.save(job.scratch / f"candidates-{job.partition}.npy", candidates[order])
    np.save(job.scratch / f"candidates-starts-{job.partition}.npy", bounds)
    return first_of_bucket(exact[:, :2], exact[:, 2])


def unique_rows(rows: np.ndarray) -> np.ndarray:
    """np.unique(rows, axis=0) (the distinct rows, in order of their columns), in a third of its time: numpy
    compares whole rows as records, this sorts on the columns as numbers."""
    ranked = rows[np.lexsort(rows.T[::-1])]
    first = np.ones(len(ranked), dtype=bool)
    first[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
    return ranked[first]


def first_of_bucket(keys: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """(order, first order of the bucket) for every row that is not the first of its bucket (rows of equal keys)."""
    if not len(orders):
        return np.zeros((0, 2), np.uint64)
    ranked = np.lexsort((orders, *reversed(keys.T)))
    keys, orders = keys[ranked], orders[ranked]
    starts = np.ones(len(orders), dtype=bool)
    starts[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    first = orders[np.flatnonzero(starts)][np.cumsum(starts) - 1]
    return np.column_stack([orders[~starts], first[~starts]])


@dataclass(frozen=True)
class ConfirmJob:
    scratch: Path
    shard: int
    partitions: int
    starts: np.ndarray
    threshold: float
    # the table the rows of records of several fields are read back from, to be compared field by field
    source: Path
    kind: RecordKind
    shingle_size: int


# a shard's signed rows: (orders ascending, signatures in that order, each row's number of fields)
Signed = tuple[np.ndarray, np.ndarray, np.ndarray]


def confirm_pairs(job: ConfirmJob) -> np.ndarray:
    """The candidate pairs of the shard's rows whose signatures agree on at least `threshold` of their values (and,
    for records of several fields, whose fields are near one by one); it holds the signatures of two shards at
    most, and the rows of its pairs of records of several fields."""
    found = [partition_of(job.scratch, "candidates", partition, job.shard) for partition in range(job.partitions)]
    candidates = unique_rows(np.concatenate(found))
    others = shard_index(job.starts, candidates[:, 1])
    own = shard_signatures(job.scratch, job.shard)
    kept, several = [np.zeros((0, 2), np.uint64)], [np.zeros((0, 2), np.uint64)]
    for other in np.unique(others):
        pairs = candidates[others == other]
        theirs = own if other == job.shard else shard_signatures(job.scratch, int(other))
        near, fields = similar(job, pairs, own, theirs)
        kept.append(pairs[near & (fields == 1)])
        several.append(pairs[near & (fields > 1)])
    # records of several fields, whichever shards their pairs reach: their rows read back together, once
    pending = np.concatenate(several)
    judged = fields_near(job.source, job.kind, pending % np.uint64(TRAIN_AFTER), job.shingle_size, job.threshold)
    return unique_rows(np.concatenate([*kept, pending[judged]]))


def similar(job: ConfirmJob, pairs: np.ndarray, own: Signed, theirs: Signed) -> tuple[np.ndarray, np.ndarray]:
    """Which pairs are near on their signatures: values that agree enough, and as many fields; and each pair's
    number of fields (where there are several, each must be near its counterpart too: only those rows are read,
    so that records of one field are judged on signatures alone)."""
    (mine, my_fields), (their, their_fields) = lookup(own, pairs[:, 0]), lookup(theirs, pairs[:, 1])
    return ((mine == their).mean(axis=1) >= job.threshold) & (my_fields == their_fields), my_fields


def shard_signatures(scratch: Path, shard: int) -> Signed:
    """(orders ascending, signatures and numbers of fields in that order) of one shard."""
    orders = np.load(scratch / f"sig-orders-{shard}.npy")
    ranked = np.argsort(orders, kind="stable")
    return (orders[ranked], np.load(scratch / f"sigs-{shard}.npy")[ranked],
            np.load(scratch / f"sig-fields-{shard}.npy")[ranked])


def lookup(signed: Signed, orders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The signatures and numbers of fields of these rows."""
    known, matrix, fields = signed
    at = np.searchsorted(known, orders)
    return matrix[at], fields[at]


def find_duplicates(config: DedupConfig, kind: RecordKind, held_out: bool, source: Path, scratch: Path,
                    engine: Engine, shards: list[TableShard],
                    split: tuple[str, float] | None = None) -> Verdicts:
    """Each row with a duplicate that precedes it, by order: its verdict and the order of its cluster's survivor;
    the table `source` read in the given shards. With `split` (salt, eval fraction), each shard's split choices
    are left in the scratch folder too (`eval_choices`)."""
    # a partition holds the fingerprints and band hashes of about SHARDS_PER_PARTITION shards
    count = max(-(-len(shards) // SHARDS_PER_PARTITION), 1)
    engine.map("dedup: signatures", sign_shard, [
        SignJob(rows, shard, scratch, count, config, kind, held_out, split)
        for shard, rows in enumerate(shards)], rows=lambda rows: rows)
    starts = np.array([rows.first for rows in shards], dtype=np.uint64)
    exact = np.concatenate(engine.map("dedup: buckets", bucket_partition,
                                      [BucketJob(scratch, partition, starts) for partition in range(count)]))
    confirmed = engine.map("dedup: confirm", confirm_pairs, [
        ConfirmJob(scratch, shard, count, starts, config.threshold, source, kind, config.shingle_size)
        for shard in range(len(shards))])
    return verdicts(exact, np.concatenate([exact, *confirmed]))


@dataclass(frozen=True)
class Verdicts:
    """The rows with a duplicate before them (orders, ascending), the survivor of each one's cluster, and whether
    it is an exact copy: arrays of about 17 bytes a duplicate, where a dict of Python objects took hundreds (the
    stage's driver holds every duplicate of the corpus)."""

    rows: np.ndarray
    survivors: np.ndarray
    exact: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def taken(self, chosen: np.ndarray) -> Verdicts:
        return Verdicts(self.rows[chosen], self.survivors[chosen], self.exact[chosen])

    def as_dict(self) -> dict[int, Verdict]:
        """{row: (verdict, survivor)}: a shard's verdicts, looked up row by row."""
        kinds = np.where(self.exact, "duplicate", "near_duplicate").tolist()
        return dict(zip(self.rows.tolist(), zip(kinds, self.survivors.tolist(), strict=True), strict=True))


def verdicts(exact: np.ndarray, pairs: np.ndarray) -> Verdicts:
    nodes, roots = components(pairs)
    moved = nodes != roots
    return Verdicts(nodes[moved], roots[moved], np.isin(nodes[moved], exact[:, 0]))


def components(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes ascending, the smallest node of each one's connected component), by label propagation."""
    nodes, inverse = np.unique(pairs, return_inverse=True)
    edges = inverse.reshape(-1, 2)
    labels = np.arange(len(nodes))
    while True:
        before = labels
        low = np.minimum(labels[edges[:, 0]], labels[edges[:, 1]])
        labels = labels.copy()
        np.minimum.at(labels, edges[:, 0], low)
        np.minimum.at(labels, edges[:, 1], low)
        labels = labels[labels]  # a label is never above its node: jumping to the label's label is safe
        if np.array_equal(labels, before):
            return nodes, nodes[labels]
