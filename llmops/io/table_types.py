"""The types of JSON values, as a table's columns hold them: a small lattice (null, bool, int, float, str, list,
struct, and MIXED where no one Arrow type holds the values) whose join gives each column the least type that holds
all of its values, however the rows were grouped to gather them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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


def json_columns(types: ColumnTypes) -> list[str]:
    return [name for name, typed in types.items() if as_text(typed)]
