"""Tables: rows as Parquet parts that read back as written, cut by position, the same bytes however the rows' types
were gathered, and readable by `datasets`."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from llmops.io import tables
from llmops.io.table_types import MIXED, column_types, json_columns, merge_types
from llmops.io.tables import (
    part_jobs,
    rows_at,
    shard_rows,
    table_bytes,
    table_index,
    table_rows,
    table_shards,
    write_index,
    write_lines_part,
    write_table,
)
from tests.helpers import output_bytes


def chats(count: int) -> list[dict[str, Any]]:
    """Rows as validated chat data comes: messages that differ in their keys, an optional field present in some
    rows only, an answer that is text in some rows and a number in others."""
    rows = []
    for index in range(count):
        messages = [{"role": "user", "content": f"question {index}"},
                    {"role": "assistant", "content": f"answer {index}"}]
        if index % 7 == 0:
            messages[0]["name"] = "ann"
        row: dict[str, Any] = {"messages": messages, "_source": "d.jsonl", "_line": index + 1,
                               "_weight": 1.0 if index % 2 else 1.5, "answer": index if index % 3 else str(index)}
        if index % 5 == 0:
            row["system"] = "be brief"
        rows.append(row)
    return rows


def test_rows_read_back_as_written(tmp_path: Path) -> None:
    rows = chats(50) + [{"messages": [], "_source": "d.jsonl", "_line": 51, "_weight": 1.0, "answer": None}]
    assert write_table(rows, column_types(rows), tmp_path / "t") == 51
    assert list(table_rows(tmp_path / "t")) == [{k: v for k, v in row.items() if v is not None} for row in rows]
    assert table_index(tmp_path / "t")["json_columns"] == ["answer"]


def test_column_types_are_merged_whatever_the_runs(tmp_path: Path) -> None:
    rows = chats(40)
    whole = column_types(rows)
    assert whole["answer"] == MIXED and whole["_weight"] == "float"
    assert whole["messages"] == ("list", ("struct", (("role", "str"), ("content", "str"), ("name", "str"))))
    for size in (1, 3, 7, 40):
        runs = [column_types(rows[start:start + size]) for start in range(0, len(rows), size)]
        assert merge_types(runs) == whole
    # a value no one type holds with the others makes the column text, however the rows are grouped
    odd = [{"a": 1.5}, {"a": True}, {"a": [1]}, {"a": [1.5]}, {"a": {"b": 1}}, {"a": {"b": "x"}}, {"a": 2**64}]
    for first, second in ((0, 1), (2, 3), (4, 5), (6, 6)):
        pair = [odd[first], odd[second]]
        assert column_types(pair) == merge_types([column_types([row]) for row in pair])
    assert [column_types([odd[a], odd[b]])["a"] for a, b in ((0, 1), (2, 3), (4, 5), (6, 6))] == [MIXED] * 4


@pytest.mark.parametrize("rows", [
    [{"messages": [{"role": "user", "content": "q", "name": "ann"}, {"role": "assistant", "content": "a", "name": 7}]}],
    [{"turn": {"role": "user", "id": 2**64}}],
    [{"x": [1, "a"]}, {"x": []}],
    [{"answer": 42}, {"answer": 2.5}, {"answer": 2**53 + 1}],
    [{"metadata": {}}, {"metadata": {}}],
    [{"turns": [{}]}],
    [{"x": [None, {"a": 1}, {"b": 2}]}],
], ids=["nested-mixed", "huge-int", "list-of-mixed", "int-and-float", "empty-object", "list-of-empty", "null-first"])
def test_values_no_arrow_type_holds_are_written_and_read_back_exactly(rows: list[dict[str, Any]],
                                                                      tmp_path: Path) -> None:
    types = column_types(rows)
    write_table(rows, types, tmp_path / "rows")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    write_index(tmp_path / "lines", [write_lines_part(job) for job in part_jobs([(tmp_path / "rows.jsonl", len(rows))],
                                                                                types, tmp_path / "lines")],
                json_columns(types))
    for name in ("rows", "lines"):  # as text: 42.0 == 42 in Python
        assert [json.dumps(row, sort_keys=True) for row in table_rows(tmp_path / name)] == \
            [json.dumps(row, sort_keys=True) for row in rows]
    assert list(output_bytes(tmp_path, "rows").values()) == list(output_bytes(tmp_path, "lines").values())


def test_parts_are_cut_by_row_position_and_bytes_do_not_depend_on_the_runs(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tables, "ROWS_PER_PART", 16)
    monkeypatch.setattr(tables, "ROWS_PER_GROUP", 4)
    rows = chats(40)
    write_table(rows, column_types(rows), tmp_path / "whole")
    write_table(rows, merge_types(column_types(rows[start:start + 6]) for start in range(0, 40, 6)),
                tmp_path / "runs")
    whole, runs = output_bytes(tmp_path, "whole"), output_bytes(tmp_path, "runs")
    assert [name.partition("/")[2] for name in whole] == [name.partition("/")[2] for name in runs]
    assert list(whole.values()) == list(runs.values())
    index = table_index(tmp_path / "whole")
    assert [part["rows"] for part in index["parts"]] == [16, 16, 8] and index["rows"] == 40
    shards = table_shards(tmp_path / "whole", 1)  # every row group its own shard, in order
    assert [(shard.part, shard.groups, shard.first) for shard in shards][:6] == [
        ("part-00000.parquet", (0, 1), 0), ("part-00000.parquet", (1, 2), 4), ("part-00000.parquet", (2, 3), 8),
        ("part-00000.parquet", (3, 4), 12), ("part-00001.parquet", (0, 1), 16), ("part-00001.parquet", (1, 2), 20)]
    assert [(shard.part, shard.groups, shard.first) for shard in
            table_shards(tmp_path / "whole", table_bytes(tmp_path / "whole"))] == [
        ("part-00000.parquet", (0, 4), 0), ("part-00001.parquet", (0, 4), 16), ("part-00002.parquet", (0, 2), 32)]
    # a row's position is the same whichever shard reads it, and reads back the row written there
    read = [pair for shard in shards for pair in shard_rows(shard)]
    assert read == list(enumerate(rows))
    wanted = [39, 0, 17, 5, 6, 16, 15]
    assert rows_at(tmp_path / "whole", wanted) == {position: rows[position] for position in wanted}
    assert rows_at(tmp_path / "whole", []) == {}


def test_an_empty_table_has_a_part_with_its_columns(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    assert write_table([], {"text": column_types([{"text": "x"}])["text"]}, tmp_path / "t") == 0
    assert list(table_rows(tmp_path / "t")) == []
    assert pq.read_schema(tmp_path / "t" / "part-00000.parquet").names == ["text"]


def test_datasets_reads_a_table(tmp_path: Path) -> None:
    from datasets import load_dataset

    rows = chats(30)
    write_table(rows, column_types(rows), tmp_path / "t")
    loaded = load_dataset("parquet", data_files=str(tmp_path / "t" / "*.parquet"), split="train",
                          cache_dir=str(tmp_path / "cache"))
    assert loaded.num_rows == 30 and loaded[7]["messages"][0] == {"role": "user", "content": "question 7",
                                                                   "name": "ann"}
    assert [json.loads(value) for value in loaded["answer"][:3]] == ["0", 1, 2]


def test_parts_made_from_line_files_do_not_depend_on_how_the_files_are_cut(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tables, "ROWS_PER_PART", 16)
    monkeypatch.setattr(tables, "ROWS_PER_GROUP", 4)
    rows = chats(45)
    types = column_types(rows)
    write_table(rows, types, tmp_path / "whole")
    for cuts in ((0, 45), (0, 3, 17, 18, 40, 45), (0, 16, 32, 45), (0, 0, 44, 45)):
        files = []
        for number, (start, end) in enumerate(pairwise(cuts)):
            path = tmp_path / f"shard-{cuts}-{number}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in rows[start:end]))
            files.append((path, end - start))
        folder = tmp_path / f"cut-{len(cuts)}-{cuts[1]}"
        write_index(folder, [write_lines_part(job) for job in part_jobs(files, types, folder)], json_columns(types))
        assert list(output_bytes(folder, ".").values()) == list(output_bytes(tmp_path / "whole", ".").values())
    typed = [{k: v for k, v in row.items() if k != "answer"} for row in rows]  # no column as text: Arrow parses
    write_table(typed, column_types(typed), tmp_path / "typed")
    (tmp_path / "typed.jsonl").write_text("".join(json.dumps(row) + "\n" for row in typed))
    one_file = [(tmp_path / "typed.jsonl", 45)]
    write_index(tmp_path / "parsed", [write_lines_part(job) for job in part_jobs(one_file, column_types(typed),
                                                                                tmp_path / "parsed")], [])
    assert list(output_bytes(tmp_path / "parsed", ".").values()) == list(output_bytes(tmp_path / "typed",
                                                                                       ".").values())
    empty = tmp_path / "empty"
    assert write_index(empty, [write_lines_part(job) for job in part_jobs([], types, empty)], json_columns(types)) == 0
    assert list(table_rows(empty)) == [] and [p.name for p in empty.glob("*.parquet")] == ["part-00000.parquet"]


def test_a_group_too_large_for_one_block_is_parsed_in_blocks_to_the_same_part(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"text": "word " * (index * 37 % 500), "_line": index} for index in range(3000)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    parts = {}
    for name, block in (("one", tables.MAX_BLOCK), ("many", 4096)):
        monkeypatch.setattr(tables, "MAX_BLOCK", block)
        (job,) = part_jobs([(tmp_path / "rows.jsonl", 3000)], column_types(rows), tmp_path / name)
        write_lines_part(job)
        parts[name] = (tmp_path / name / "part-00000.parquet").read_bytes()
    assert parts["one"] == parts["many"]
    write_index(tmp_path / "many", [{"file": "part-00000.parquet", "rows": 3000}], [])
    assert list(table_rows(tmp_path / "many")) == rows
