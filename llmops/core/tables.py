"""Tables: a stage's rows as a folder of Parquet parts, the format any reader of datasets takes.

`<name>/part-00000.parquet, part-00001.parquet, ...` and `<name>/index.json` (the parts in order,
their row counts, the columns kept as JSON text). The rows are cut into parts of ROWS_PER_PART
and row groups of ROWS_PER_GROUP by their position in the data, never by how the work was
sharded, and each column's type is the least type that holds all of its values (`join`), so the
same rows give the same bytes whatever the engine and its workers. A column whose values disagree in type (text in
one row, a number in another) is kept as each value's JSON text and read back as the value.

Read back, a row is as it was written except that a field holding null is absent (Parquet holds
the column for every row): readers of rows take a missing field and a null one alike.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import groupby, islice
from pathlib import Path
from typing import Any

ROWS_PER_PART = 65_536
# small enough that a table's row groups spread over the workers that read it
ROWS_PER_GROUP = 1_024
INDEX = "index.json"
MAX_BLOCK = 1 << 30
# a column whose values have no one Arrow type
MIXED = "mixed"

# a JSON value's type: "null", "bool", "int", "float", "str", ("list", item type), ("struct", ((key, type), ...)),
# or MIXED where no one Arrow type holds the values
JsonType = Any
ColumnTypes = dict[str, JsonType]
INT64 = 2**63


def column_types(rows: Iterable[dict[str, Any]]) -> ColumnTypes:
    """Each column's type over `rows`, the columns in order of first appearance."""
    types: ColumnTypes = {}
    for row in rows:
        add_types(types, row)
    return types


def add_types(types: ColumnTypes, row: dict[str, Any]) -> None:
    """One more row into the column types `types`."""
    for name, value in row.items():
        types[name] = join(types.get(name, "null"), type_of(value))


def merge_types(found: Iterable[ColumnTypes]) -> ColumnTypes:
    """The column types of several runs of rows, taken in order: the same as those of all their rows at once,
    whatever the runs, since `join` is the least type that holds both of its types."""
    merged: ColumnTypes = {}
    for types in found:
        for name, typed in types.items():
            merged[name] = join(merged.get(name, "null"), typed)
    return merged


def type_of(value: Any) -> JsonType:
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: a bool is an int in Python
        return "bool"
    if isinstance(value, int):
        return "int" if -INT64 <= value < INT64 else MIXED
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        item: JsonType = "null"
        for element in value:
            item = join(item, type_of(element))
        return MIXED if item == MIXED else ("list", item)
    if isinstance(value, dict):
        fields = tuple((key, type_of(item)) for key, item in value.items())
        return MIXED if any(field == MIXED for _, field in fields) else ("struct", fields)
    return MIXED


def join(held: JsonType, typed: JsonType) -> JsonType:
    """The least type that holds values of both: null takes the other, lists join their items, structs their
    fields (the held one's first); anything else is MIXED. Integers and floats are MIXED too: a float column would
    read 42 back as 42.0, and a float cannot hold every integer."""
    if held == typed or typed == "null":
        return held
    if held == "null":
        return typed
    if isinstance(held, tuple) and isinstance(typed, tuple) and held[0] == typed[0]:
        if held[0] == "list":
            item = join(held[1], typed[1])
            return MIXED if item == MIXED else ("list", item)
        fields = dict(held[1])
        for key, field in typed[1]:
            fields[key] = join(fields.get(key, "null"), field)
        return MIXED if MIXED in fields.values() else ("struct", tuple(fields.items()))
    return MIXED


def as_text(typed: JsonType) -> bool:
    """Whether a column of this type is kept as each value's JSON text: MIXED, or holding an object that never has
    a field (Parquet has no struct without fields)."""
    if typed == MIXED:
        return True
    if isinstance(typed, tuple):
        if typed[0] == "list":
            return as_text(typed[1])
        return not typed[1] or any(as_text(field) for _, field in typed[1])
    return False


def arrow_type(typed: JsonType) -> Any:
    import pyarrow as pa

    if isinstance(typed, tuple):
        if typed[0] == "list":
            return pa.list_(arrow_type(typed[1]))
        return pa.struct([(key, arrow_type(field)) for key, field in typed[1]])
    return {"null": pa.null(), "bool": pa.bool_(), "int": pa.int64(), "float": pa.float64(), "str": pa.string()}[typed]


def arrow_schema(types: ColumnTypes) -> Any:
    """The Parquet schema: columns kept as JSON text as text; a column of nulls only as text, so that it has a
    type."""
    import pyarrow as pa

    return pa.schema([(name, pa.string() if as_text(typed) or typed == "null" else arrow_type(typed))
                      for name, typed in types.items()])


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
    return write_index(folder, parts, types)


def write_index(folder: Path, parts: list[dict[str, Any]], types: ColumnTypes) -> int:
    """The table's index, once its parts are written; how many rows they hold."""
    index = {"format": "parquet", "rows": sum(part["rows"] for part in parts), "parts": parts,
             "json_columns": json_columns(types)}
    (folder / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index["rows"]


def json_columns(types: ColumnTypes) -> list[str]:
    return [name for name, typed in types.items() if as_text(typed)]


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


@dataclass(frozen=True)
class PartJob:
    """One part of a table made from JSON Lines files: the slices of them that hold its rows, in order (file,
    lines to skip, lines to take)."""

    slices: tuple[tuple[Path, int, int], ...]
    types: ColumnTypes
    target: Path


def part_jobs(files: list[tuple[Path, int]], types: ColumnTypes, folder: Path) -> list[PartJob]:
    """The parts of the table in `folder` (made here) of the rows of JSON Lines `files` (each with its line
    count), in order: each part the next ROWS_PER_PART rows, wherever the files that hold them are cut."""
    folder.mkdir(parents=True, exist_ok=True)
    total = sum(lines for _, lines in files)
    jobs = []
    for number, start in enumerate(range(0, max(total, 1), ROWS_PER_PART)):
        end, position, slices = min(start + ROWS_PER_PART, total), 0, []
        for path, lines in files:
            first, last = max(start, position), min(end, position + lines)
            if first < last:
                slices.append((path, first - position, last - first))
            position += lines
        jobs.append(PartJob(tuple(slices), types, folder / part_name(number)))
    return jobs


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


def sliced_lines(slices: tuple[tuple[Path, int, int], ...]) -> Iterator[bytes]:
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


def shard_rows(shard: TableShard) -> Iterator[tuple[int, dict[str, Any]]]:
    """(position in the table, row) for each row of the shard."""
    import pyarrow.parquet as pq

    handle, position = pq.ParquetFile(shard.folder / shard.part), shard.first
    for group in range(*shard.groups):
        # one thread: the engine already runs a worker per core
        for row in rows_of(handle.read_row_group(group, use_threads=False), list(shard.texts)):
            yield position, row
            position += 1


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
        first, size, rows = 0, 0, 0
        for group in range(meta.num_row_groups):
            size += meta.row_group(group).total_byte_size
            if size >= shard_bytes or group == meta.num_row_groups - 1:
                shards.append(TableShard(folder, part["file"], (first, group + 1), start + rows, texts))
                rows += sum(meta.row_group(member).num_rows for member in range(first, group + 1))
                first, size = group + 1, 0
        start += part["rows"]
    return shards


def table_files(relative: str, names: tuple[str, ...]) -> bool:
    """Whether a file of an artifact belongs to one of its tables `names`."""
    return relative.partition("/")[0] in names and relative != relative.partition("/")[0]
