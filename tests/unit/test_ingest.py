import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmops.config.schema import DataConfig, PipelineConfig
from llmops.data.ingest import read_records, with_origin
from llmops.data.readers import DataSourceError
from llmops.io.files import read_jsonl
from tests.helpers import project_at, stage

ROWS = [
    {"instruction": "Write this number in words.", "input": "12", "output": "twelve"},
    {"instruction": "Write this date in words.", "input": "2001-02-03", "output": "3 February 2001"},
]


@pytest.fixture(autouse=True)
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the project ingest runs in: relative source paths, and the source names, are relative to it."""
    return project_at(tmp_path, monkeypatch)


def ingest(config: PipelineConfig):
    return stage("ingest", config)


def ingested_rows(path: Path | str, **config: object) -> tuple[list[dict], dict]:
    record = ingest(PipelineConfig(data=DataConfig(path=str(path), **config)))
    return list(read_records(record.dir)), record.figures


def test_jsonl_rows_keep_source_and_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    rows, stats = ingested_rows(path)
    assert [r["output"] for r in rows] == ["twelve", "3 February 2001"]
    assert [(r["_source"], r["_line"]) for r in rows] == [("d.jsonl", 1), ("d.jsonl", 2)]
    assert stats.rows_read == 2 and stats.rows_rejected == 0
    assert ingested_rows("d.jsonl")[0] == rows  # a relative path is read against the project


def test_csv_rows_are_numbered_by_file_line(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["instruction", "input", "output"])
        writer.writeheader()
        writer.writerow({**ROWS[0], "output": "twelve\n(a two-line answer)"})
        writer.writerow(ROWS[1])
    rows, _ = ingested_rows(path)
    assert [r["_line"] for r in rows] == [2, 4]
    assert rows[0]["output"] == "twelve\n(a two-line answer)"


def test_parquet_with_column_mapping(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": [r["instruction"] for r in ROWS], "input": [r["input"] for r in ROWS],
                      "response": [r["output"] for r in ROWS]})
    pq.write_table(table, path)
    rows, _ = ingested_rows(path, columns={"instruction": "prompt", "output": "response"})
    assert [(r["instruction"], r["output"], r["_line"]) for r in rows] == [
        (ROWS[0]["instruction"], "twelve", 1), (ROWS[1]["instruction"], "3 February 2001", 2)]


def test_text_kind_reads_only_the_text_field(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "one", "meta": 1}\n{"text": "two"}\n')
    rows, _ = ingested_rows(path, kind="text")
    assert [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows] == [{"text": "one"}, {"text": "two"}]


def test_unparseable_lines_are_rejected_with_line_and_code(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\r\n"
                     + b'{"instruction": "x", \n'
                     + b"[1, 2]\n"
                     + b'{"instruction": "caf\xe9"}\n'
                     + json.dumps(ROWS[1]).encode() + b"\n")
    record = ingest(PipelineConfig(data=DataConfig(path=str(path))))
    rows = list(read_records(record.dir))
    rejected = list(read_jsonl(record.dir / "rejected.jsonl"))
    assert [r["_line"] for r in rows] == [1, 5]  # the BOM and CRLF do not cost row 1
    assert [(r["line"], r["code"]) for r in rejected] == [(2, "json_broken"), (3, "not_object"), (4, "utf8_invalid")]
    assert [r["message"] for r in rejected] == ["not valid JSON: Expecting property name enclosed in double quotes "
                                                "(column 22)", "a JSON array where an object is expected",
                                                "invalid UTF-8 at byte 20"]
    assert record.figures.rows_read == 5 and record.figures.rows_rejected == 3
    assert record.figures.reject_codes == {"json_broken": 1, "not_object": 1, "utf8_invalid": 1}


def test_folder_and_glob_sources(tmp_path: Path) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    for i, row in enumerate(ROWS):
        (folder / f"part{i}.jsonl").write_text(json.dumps(row) + "\n")
    rows, stats = ingested_rows(folder)
    assert len(rows) == 2 and stats.rows_per_source == {"parts/part0.jsonl": 1, "parts/part1.jsonl": 1}
    rows, _ = ingested_rows(tmp_path / "parts" / "*1.jsonl")
    assert [r["output"] for r in rows] == ["3 February 2001"]


def test_missing_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DataSourceError, match=r"data source '.*nowhere.jsonl': no data file found"):
        ingest(PipelineConfig(data=DataConfig(path=str(tmp_path / "nowhere.jsonl"))))


def test_unchanged_source_is_reused_and_a_changed_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    first = ingest(PipelineConfig(data=DataConfig(path=str(path))))
    assert ingest(PipelineConfig(data=DataConfig(path=str(path)))).reused
    path.write_text(json.dumps(ROWS[1]) + "\n")
    changed = ingest(PipelineConfig(data=DataConfig(path=str(path))))
    assert not changed.reused and changed.key != first.key and changed.hash != first.hash


@pytest.mark.parametrize("record", [{}, {"text": "x"}, {"text": "é \" \\ \n\t😀", "meta": [1.5, None, {"k": True}]},
                                    {"text": "y", "_line": 3}])
def test_a_record_with_its_origin_is_json_dumps_of_both(record: dict) -> None:
    origin = {"_source": "data/d.jsonl", "_line": 7, "_weight": 0.5, "_split": "eval"}
    text = json.dumps(record, ensure_ascii=False)
    assert with_origin(text, record, origin) == json.dumps({**record, **origin}, ensure_ascii=False)
