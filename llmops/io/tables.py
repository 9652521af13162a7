"""Tables: a stage's rows as a folder of Parquet parts, the format any reader of datasets takes.

`<name>/part-00000.parquet, part-00001.parquet, ...` and `<name>/index.json` (the parts in order,
their row counts, the columns kept as JSON text). The rows are cut into parts of ROWS_PER_PART
and row groups of ROWS_PER_GROUP by their position in the data, never by how the work was
sharded, and each column's type is the least type that holds all of its values (io/table_types.py), so the
same rows give the same bytes whatever the engine and its workers. A column whose values disagree in type (text in
one row, a number in another) is kept as each value's JSON text and read back as the value.

Read back, a row is as it was written except that a field holding null is absent, in the row and
in every object inside it (Parquet holds the column, or the struct's field, for every row), and
that its fields come in the order of the table's columns: readers of rows take a missing field and
a null one alike.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import groupby, islice
from pathlib import Path
from typing import Any

from llmops.io.table_types import ColumnTypes, arrow_schema, json_columns

ROWS_PER_PART = 65_536
# small enough that a table's row groups spread over the workers that read it
ROWS_PER_GROUP = 1_024
INDEX = "index.json"
MAX_BLOCK = 1 << 30
def write_table(rows: Iterable[dict[str, Any]], types: ColumnTypes, folder: Path) -> int:
    """`rows`, in order, as the parts of a table in `folder` (made here), in this process; how many rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rows, parts = iter(rows), []
    while not parts or parts[-1]["rows"] == ROWS_PER_PART:
        part = write_part(islice(rows, ROWS_PER_PART), types, folder / part_name(len(parts)))
        if part["rows"] == 0 and parts:  # the rows ended with the last part
            (folder / part["file"]).unlink()
            break
        parts.append(part)
    return write_index(folder, parts, json_columns(types))


def write_index(folder: Path, parts: list[dict[str, Any]], texts: list[str]) -> int:
    """The table's index, once its parts are written, naming its columns kept as JSON text; how many rows they
    hold."""
    index = {"format": "parquet", "rows": sum(part["rows"] for part in parts), "parts": parts, "json_columns": texts}
    (folder / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index["rows"]


def part_name(number: int) -> str:
    return f"part-{number:05d}.parquet"


def write_part(rows: Iterable[dict[str, Any]], types: ColumnTypes, path: Path) -> dict[str, Any]:
    """One part of `rows` (an empty one holds the schema only); its file and rows."""
    import pyarrow as pa

    schema, texts, rows = arrow_schema(types), json_columns(types), iter(rows)

    def groups() -> Iterator[Any]:
        while group := list(islice(rows, ROWS_PER_GROUP)):
            if texts:
                group = [{**row, **{name: as_json(row.get(name)) for name in texts}} for row in group]
            yield pa.Table.from_pylist(group, schema=schema)
    return write_groups(groups(), schema, path)


def write_groups(groups: Iterable[Any], schema: Any, path: Path) -> dict[str, Any]:
    """A part written a row group (an Arrow table) at a time; its file and rows."""
    import pyarrow.parquet as pq

    count = 0
    # zstd: text compresses to about a third
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        for group in groups:
            writer.write_table(group, row_group_size=ROWS_PER_GROUP)
            count += group.num_rows
    return {"file": path.name, "rows": count}


# where a part's rows lie in the files that hold them, in order: (file, rows to skip, rows to take)
Slices = tuple[tuple[Path, int, int], ...]


@dataclass(frozen=True)
class PartJob:
    """One part of a table made from JSON Lines files: the slices of them that hold its rows."""

    slices: Slices
    types: ColumnTypes
    target: Path


def part_jobs(files: list[tuple[Path, int]], types: ColumnTypes, folder: Path) -> list[PartJob]:
    """The parts of the table in `folder` (made here) of the rows of JSON Lines `files` (each with its line
    count), in order."""
    return [PartJob(slices, types, target) for slices, target in cut_parts(files, folder)]


def cut_parts(files: list[tuple[Path, int]], folder: Path) -> list[tuple[Slices, Path]]:
    """Each part's slices of `files` (each with its row count) and its file in `folder` (made here): each part the
    next ROWS_PER_PART rows, wherever the files that hold them are cut; one part, empty, where there are none."""
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(rows for _, rows in files)
    parts = []
    for number, start in enumerate(range(0, max(total, 1), ROWS_PER_PART)):
        end, position, slices = min(start + ROWS_PER_PART, total), 0, []
        for path, rows in files:
            first, last = max(start, position), min(end, position + rows)
            if first < last:
                slices.append((path, first - position, last - first))
            position += rows
        parts.append((tuple(slices), folder / part_name(number)))
    return parts


@dataclass(frozen=True)
class ArrowPartJob:
    """One part of a table made from Arrow IPC files of rows in its schema: the slices of them that hold its rows."""

    slices: Slices
    schema: Any
    target: Path


def write_arrow_part(job: ArrowPartJob) -> dict[str, Any]:
    """One part from its slices of Arrow IPC files, in row groups of ROWS_PER_GROUP whatever the files' batches."""
    return write_groups(regrouped(sliced_batches(job.slices), job.schema), job.schema, job.target)


def sliced_batches(slices: Slices) -> Iterator[Any]:
    import pyarrow as pa

    for path, skip, take in slices:
        # mapped, not read: only the slice's pages are touched (a mapping lives on while its batches do)
        with pa.memory_map(str(path)) as source:
            yield from pa.ipc.open_file(source).read_all().slice(skip, take).to_batches()


def regrouped(batches: Iterable[Any], schema: Any, size: int | None = None) -> Iterator[Any]:
    """The rows of `batches` as tables of `size` rows (ROWS_PER_GROUP unless given; the last may hold fewer), each
    in one chunk: the same groups, and bytes, however the rows came batched."""
    import pyarrow as pa

    size = size or ROWS_PER_GROUP
    pending: list[Any] = []
    held = 0
    for batch in batches:
        pending.append(batch)
        held += batch.num_rows
        while held >= size:
            rows = pa.Table.from_batches(pending, schema)
            yield rows.slice(0, size).combine_chunks()
            rest = rows.slice(size)
            pending, held = rest.to_batches(), rest.num_rows
    if held:
        yield pa.Table.from_batches(pending, schema).combine_chunks()


def write_lines_part(job: PartJob) -> dict[str, Any]:
    """One part from its slices of JSON Lines. Without a column kept as JSON text, Arrow's JSON reader parses each
    row group straight into the schema: the same table as json.loads and from_pylist, in about a third less time."""
    if json_columns(job.types):
        return write_part((json.loads(line) for line in sliced_lines(job.slices)), job.types, job.target)
    schema = arrow_schema(job.types)
    return write_groups(parsed_groups(sliced_lines(job.slices), schema), schema, job.target)


def parsed_groups(lines: Iterator[bytes], schema: Any) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.json as pj

    parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")
    while chunk := list(islice(lines, ROWS_PER_GROUP)):
        group = b"".join(chunk)
        # every row must lie within one of the reader's blocks (an int32 size): the whole group in one block, or a
        # very large group in blocks that each hold the longest row
        block = len(group) + 1 if len(group) < MAX_BLOCK else max(map(len, chunk)) + 1
        yield pj.read_json(pa.BufferReader(group), read_options=pj.ReadOptions(use_threads=False, block_size=block),
                           parse_options=parse)


def sliced_lines(slices: Slices) -> Iterator[bytes]:
    for path, skip, take in slices:
        with path.open("rb") as lines:
            yield from (line if line.endswith(b"\n") else line + b"\n" for line in islice(lines, skip, skip + take))


def as_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def table_index(folder: Path) -> dict[str, Any]:
    return json.loads((folder / INDEX).read_text())


def table_rows(folder: Path) -> Iterator[dict[str, Any]]:
    """The table's rows in order, each as written (a null field absent)."""
    import pyarrow.parquet as pq

    index = table_index(folder)
    for part in index["parts"]:
        for batch in pq.ParquetFile(folder / part["file"]).iter_batches(batch_size=ROWS_PER_GROUP):
            yield from rows_of(batch, index["json_columns"])


@dataclass(frozen=True)
class TableShard:
    """A run of row groups [first, last) of one part of a table, and the position in the table of its first row:
    a unit of parallel work whose rows are known by their positions, which the data fixes."""

    folder: Path
    part: str
    groups: tuple[int, int]
    first: int
    texts: tuple[str, ...]


def shard_rows(shard: TableShard, columns: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(position in the table, row) for each row of the shard; with `columns`, only those of them the table has."""
    import pyarrow.parquet as pq

    handle, position = pq.ParquetFile(shard.folder / shard.part), shard.first
    if columns is not None:
        columns = [name for name in columns if name in handle.schema_arrow.names]
    texts = [name for name in shard.texts if columns is None or name in columns]
    for group in range(*shard.groups):
        # one thread: the engine already runs a worker per core
        for row in rows_of(handle.read_row_group(group, columns=columns, use_threads=False), texts):
            yield position, row
            position += 1


def write_taken(shard: TableShard, taken: dict[Path, list[int]]) -> None:
    """Arrow IPC files (what ArrowPartJob reads) of the shard's rows at the given places in it (ascending; a place
    repeated takes its row again), a row group at a time: memory holds one row group, not the shard."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(shard.folder / shard.part)
    wanted = {path: np.asarray(places, dtype=np.int64) for path, places in taken.items()}
    with ExitStack() as files:
        writers = {path: files.enter_context(pa.ipc.new_file(files.enter_context(pa.OSFile(str(path), "wb")),
                                                             handle.schema_arrow)) for path in wanted}
        start = 0
        for group in range(*shard.groups):
            rows = handle.read_row_group(group, use_threads=False)
            for path, places in wanted.items():
                inside = places[np.searchsorted(places, start):np.searchsorted(places, start + rows.num_rows)]
                if len(inside):
                    writers[path].write_table(rows.take(inside - start))
            start += rows.num_rows


def table_schema(folder: Path) -> Any:
    """The table's Arrow schema (every part has it)."""
    import pyarrow.parquet as pq

    return pq.read_schema(folder / table_index(folder)["parts"][0]["file"])


def rows_at(folder: Path, positions: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The rows at these positions of the table; only the row groups that hold them are read."""
    import pyarrow.parquet as pq

    index, wanted = table_index(folder), sorted(set(positions))
    found: dict[int, dict[str, Any]] = {}
    start = 0
    for part in index["parts"]:
        here = wanted[bisect_left(wanted, start):bisect_left(wanted, start + part["rows"])]
        if here:
            handle = pq.ParquetFile(folder / part["file"])
            bounds = group_starts(handle.metadata)
            for group, run in groupby(here, key=lambda position: bisect_right(bounds, position - start) - 1):
                members = list(run)
                held = handle.read_row_group(group, use_threads=False)
                taken = held.take([member - start - bounds[group] for member in members])
                found.update(zip(members, rows_of(taken, index["json_columns"]), strict=True))
        start += part["rows"]
    return found


def group_starts(meta: Any) -> list[int]:
    """Where each row group of a part starts, in rows."""
    starts = [0]
    for group in range(meta.num_row_groups - 1):
        starts.append(starts[-1] + meta.row_group(group).num_rows)
    return starts


def rows_of(batch: Any, texts: list[str]) -> Iterator[dict[str, Any]]:
    """A batch's rows, the columns kept as JSON text read back as their values."""
    for row in batch.to_pylist():
        for name in texts:
            if row.get(name) is not None:
                row[name] = json.loads(row[name])
        yield without_nulls(row)


def without_nulls(value: Any) -> Any:
    """Fields that hold null dropped, in the row and in every object inside it: Parquet gives a struct every field
    any of its values has, so that is what an absent field reads back as."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        return [without_nulls(item) for item in value]
    return value


def table_bytes(folder: Path) -> int:
    """The size of the table's rows uncompressed."""
    import pyarrow.parquet as pq

    metas = [pq.ParquetFile(folder / part["file"]).metadata for part in table_index(folder)["parts"]]
    return sum(meta.row_group(group).total_byte_size for meta in metas for group in range(meta.num_row_groups))


def table_shards(folder: Path, shard_bytes: int) -> list[TableShard]:
    """Runs of the table's row groups of about `shard_bytes` (as held in memory), each within one part: the
    units of parallel work on a table."""
    import pyarrow.parquet as pq

    index, shards, start = table_index(folder), [], 0
    texts = tuple(index["json_columns"])
    for part in index["parts"]:
        meta = pq.ParquetFile(folder / part["file"]).metadata
        bounds, first, size = group_starts(meta), 0, 0
        for group in range(meta.num_row_groups):
            size += meta.row_group(group).total_byte_size
            if size >= shard_bytes or group == meta.num_row_groups - 1:
                shards.append(TableShard(folder, part["file"], (first, group + 1), start + bounds[first], texts))
                first, size = group + 1, 0
        start += part["rows"]
    return shards


def table_files(relative: str, names: tuple[str, ...]) -> bool:
    """Whether a file of an artifact belongs to one of its tables `names`."""
    return relative.partition("/")[0] in names and relative != relative.partition("/")[0]
