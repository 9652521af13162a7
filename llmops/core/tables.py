"""Tables: a stage's rows as a folder of Parquet parts, the format any reader of datasets takes.

`<name>/part-00000.parquet, part-00001.parquet, ...` and `<name>/index.json` (the parts in order,
their row counts, the columns kept as JSON text). The rows are cut into parts of ROWS_PER_PART
and row groups of ROWS_PER_GROUP by their position in the data, never by how the work was
sharded, and each column's type is inferred from all of its values, so the same rows give the
same bytes whatever the engine and its workers. A column whose values disagree in type (text in
one row, a number in another) is kept as each value's JSON text and read back as the value.

Read back, a row is as it was written except that a field holding null is absent (Parquet holds
the column for every row): readers of rows take a missing field and a null one alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

ROWS_PER_PART = 131_072
ROWS_PER_GROUP = 4_096
INDEX = "index.json"
# a column whose values have no one Arrow type
MIXED = "mixed"

ColumnTypes = dict[str, Any]


def column_types(rows: list[dict[str, Any]]) -> ColumnTypes:
    """Each column's Arrow type over `rows`, in order of first appearance; MIXED where its values disagree."""
    import pyarrow as pa

    names = list(dict.fromkeys(name for row in rows for name in row))
    types: ColumnTypes = {}
    for name in names:
        try:
            types[name] = pa.array([row.get(name) for row in rows]).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            types[name] = MIXED
    return types


def merge_types(found: Iterable[ColumnTypes]) -> ColumnTypes:
    """The types of the same columns seen in several runs of rows, taken in order: each column the type both
    hold (a null column takes the other's, integers and floats give floats, structs gain each other's fields),
    else MIXED. The order of first appearance holds whatever the runs, so the result does not depend on them."""
    import pyarrow as pa

    merged: ColumnTypes = {}
    for types in found:
        for name, kind in types.items():
            held = merged.setdefault(name, kind)
            if held is kind or held == MIXED:
                continue
            if kind == MIXED:
                merged[name] = MIXED
                continue
            try:
                merged[name] = pa.unify_schemas([pa.schema([(name, held)]), pa.schema([(name, kind)])],
                                                promote_options="permissive").field(name).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                merged[name] = MIXED
    return merged


def arrow_schema(types: ColumnTypes) -> Any:
    """The Parquet schema: MIXED columns as text; a column of nulls only as text, so that it has a type."""
    import pyarrow as pa

    def storable(kind: Any) -> Any:
        return pa.string() if kind == MIXED or pa.types.is_null(kind) else kind
    return pa.schema([(name, storable(kind)) for name, kind in types.items()])


def write_table(rows: Iterable[dict[str, Any]], types: ColumnTypes, folder: Path) -> int:
    """`rows`, in order, as the parts of a table in `folder` (made here); how many rows."""
    folder.mkdir(parents=True, exist_ok=True)
    schema = arrow_schema(types)
    mixed = [name for name, kind in types.items() if kind == MIXED]
    parts: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for row in rows:
        pending.append(row)
        if len(pending) == ROWS_PER_PART:
            parts.append(write_part(pending, schema, mixed, folder / part_name(len(parts))))
            pending = []
    if pending or not parts:  # an empty table still has a part, which holds its schema
        parts.append(write_part(pending, schema, mixed, folder / part_name(len(parts))))
    index = {"format": "parquet", "rows": sum(part["rows"] for part in parts), "parts": parts, "json_columns": mixed}
    (folder / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index["rows"]


def part_name(number: int) -> str:
    return f"part-{number:05d}.parquet"


def write_part(rows: list[dict[str, Any]], schema: Any, mixed: list[str], path: Path) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if mixed:
        rows = [{**row, **{name: as_json(row.get(name)) for name in mixed}} for row in rows]
    table = pa.Table.from_pylist(rows, schema=schema)
    # zstd: text compresses to about a third
    pq.write_table(table, path, row_group_size=ROWS_PER_GROUP, compression="zstd")
    return {"file": path.name, "rows": len(rows)}


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


def group_rows(folder: Path, part: str, groups: tuple[int, int], mixed: list[str]) -> Iterator[dict[str, Any]]:
    """The rows of row groups [first, last) of one part."""
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(folder / part)
    for group in range(*groups):
        yield from rows_of(handle.read_row_group(group), mixed)


def rows_of(batch: Any, mixed: list[str]) -> Iterator[dict[str, Any]]:
    for row in batch.to_pylist():
        for name in mixed:
            if row.get(name) is not None:
                row[name] = json.loads(row[name])
        yield without_nulls(row)


def without_nulls(value: Any) -> Any:
    """Fields that hold null dropped, in the row and in every object inside it: Parquet gives a struct every field
    any of its values has, so that is what an absent field reads back as."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        return [without_nulls(item) for item in value]
    return value


def table_bytes(folder: Path) -> int:
    """The size of the table's rows uncompressed."""
    import pyarrow.parquet as pq

    metas = [pq.ParquetFile(folder / part["file"]).metadata for part in table_index(folder)["parts"]]
    return sum(meta.row_group(group).total_byte_size for meta in metas for group in range(meta.num_row_groups))


def row_groups(folder: Path, shard_bytes: int) -> list[tuple[str, tuple[int, int]]]:
    """Runs of the table's row groups of about `shard_bytes` (as held in memory), each within one part: the
    units of parallel work on a table."""
    import pyarrow.parquet as pq

    runs: list[tuple[str, tuple[int, int]]] = []
    for part in table_index(folder)["parts"]:
        meta = pq.ParquetFile(folder / part["file"]).metadata
        first, size = 0, 0
        for group in range(meta.num_row_groups):
            size += meta.row_group(group).total_byte_size
            if size >= shard_bytes:
                runs.append((part["file"], (first, group + 1)))
                first, size = group + 1, 0
        if first < meta.num_row_groups:
            runs.append((part["file"], (first, meta.num_row_groups)))
    return runs


def table_files(relative: str, names: tuple[str, ...]) -> bool:
    """Whether a file of an artifact belongs to one of its tables `names`."""
    return relative.partition("/")[0] in names and relative != relative.partition("/")[0]
