"""Each input format, written as a real file, ingested into each record kind it can hold."""

import csv
import json
from collections.abc import Callable
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmops.config.schema import DataConfig, PipelineConfig, ValidateConfig
from llmops.data.ingest import read_records
from llmops.data.validate import DataQualityError, check_bad_fraction
from llmops.io.files import read_jsonl
from llmops.io.tables import table_rows
from tests.helpers import project_at, stage

SAMPLES: dict[str, list[dict]] = {
    "text": [{"text": "The first document."}, {"text": "The second, with a comma."}],
    "instruction": [{"instruction": "Add.", "input": "2 3", "output": "5"},
                    {"instruction": "Greet.", "input": "", "output": "Hello, world"}],
    "chat": [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4"}]}],
    "classification": [{"text": "great film", "label": "positive"}, {"text": "dull plot", "label": "negative"}],
}
LABELS = ["negative", "positive"]


@pytest.fixture(autouse=True)
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the project ingest runs in: the source names are relative to it."""
    return project_at(tmp_path, monkeypatch)


def ingest(config: PipelineConfig):
    return stage("ingest", config)


def validate(config: PipelineConfig, ingested):
    return stage("validate", config, ingested)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_json_array(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps(rows, indent=2))
    return path


def write_delimited(path: Path, rows: list[dict], delimiter: str) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_saved_dataset(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def write_text_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(r["text"] + "\n" for r in rows))
    return path


def write_text_files(path: Path, rows: list[dict]) -> Path:
    path.mkdir()
    for i, row in enumerate(rows):
        (path / f"doc{i}.txt").write_text(row["text"])
    return path / "*.txt"


Writer = Callable[[Path, list[dict]], Path]
FORMATS: dict[str, tuple[str, Writer, dict, tuple[str, ...]]] = {
    # name: (file name, writer, source settings, kinds the format can hold)
    "jsonl": ("d.jsonl", write_jsonl, {}, ("text", "instruction", "chat", "classification")),
    "json": ("d.json", write_json_array, {}, ("text", "instruction", "chat", "classification")),
    "csv": ("d.csv", lambda p, r: write_delimited(p, r, ","), {}, ("text", "instruction", "classification")),
    "tsv": ("d.tsv", lambda p, r: write_delimited(p, r, "\t"), {}, ("text", "instruction", "classification")),
    "parquet": ("d.parquet", write_parquet, {}, ("text", "instruction", "chat", "classification")),
    "text": ("d.txt", write_text_lines, {}, ("text",)),
    "text-files": ("docs", write_text_files, {"format": "text-files"}, ("text",)),
    "save_to_disk": ("saved", write_saved_dataset, {}, ("text", "instruction", "chat", "classification")),
    "load_dataset": ("hubdir", None, {}, ("text", "instruction", "chat", "classification")),
}
CASES = [(fmt, kind) for fmt, (_, _, _, kinds) in FORMATS.items() for kind in kinds]


@pytest.mark.parametrize(("fmt", "kind"), CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_format_into_kind(fmt: str, kind: str, tmp_path: Path) -> None:
    name, writer, settings, _ = FORMATS[fmt]
    rows = SAMPLES[kind]
    if fmt == "load_dataset":
        folder = tmp_path / name
        folder.mkdir()
        write_jsonl(folder / "train.jsonl", rows)
        source = {"name": str(folder), **settings}
    else:
        source = {"path": str(writer(tmp_path / name, rows)), **settings}
    data = DataConfig(kind=kind, sources=[source], labels=LABELS if kind == "classification" else [])
    record = ingest(PipelineConfig(data=data))
    got = [{k: v for k, v in r.items() if not k.startswith("_")} for r in read_records(record.dir)]
    assert got == rows
    assert record.figures.rows_rejected == 0
    validated = validate(PipelineConfig(data=data), record)
    assert validated.figures.rows_kept == len(rows), list(read_jsonl(validated.dir / "quarantine.jsonl"))


def test_sharegpt_conversations_become_messages(tmp_path: Path) -> None:
    rows = [{"conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello"}]}]
    data = DataConfig(kind="chat", path=str(write_jsonl(tmp_path / "sg.jsonl", rows)))
    record = next(read_records(ingest(PipelineConfig(data=data)).dir))
    assert record["messages"] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello"}]


def test_json_array_elements_keep_their_line_and_a_broken_tail_is_quarantined(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text('[\n  {"text": "one"},\n  {"text":\n     "two"},\n  3,\n  {"text": "four"}, {"text": \n')
    record = ingest(PipelineConfig(data=DataConfig(kind="text", path=str(path))))
    rows = list(read_records(record.dir))
    rejected = list(read_jsonl(record.dir / "rejected.jsonl"))
    assert [(r["text"], r["_line"]) for r in rows] == [("one", 2), ("two", 3), ("four", 6)]
    assert [(r["line"], r["code"], r["message"]) for r in rejected] == [
        (5, "not_object", "a JSON number where an object is expected"),
        (6, "json_broken", "not valid JSON: Expecting value; the rest of the file was not read")]
    # training on the part of a file before a break is refused, whatever the bad fraction
    validated = validate(PipelineConfig(data=DataConfig(kind="text", path=str(path))), record)
    with pytest.raises(DataQualityError, match=r"1 source file\(s\) could not be read to the end \(a.json\)"):
        check_bad_fraction(PipelineConfig(validate=ValidateConfig(max_bad_fraction=1.0)), validated)


def test_a_json_array_over_a_reading_block_reads_every_element(tmp_path: Path) -> None:
    """Over 1 MiB, elements cross the reader's blocks inside their strings: every one is read, none is broken."""
    rows = [{"text": f"document {n} " + "word " * 400} for n in range(700)]
    path = tmp_path / "big.json"
    path.write_text(json.dumps(rows, indent=1))
    assert path.stat().st_size > 2**20
    record = ingest(PipelineConfig(data=DataConfig(kind="text", path=str(path))))
    assert [int(row["text"].split()[1]) for row in read_records(record.dir)] == list(range(700))
    assert (record.dir / "rejected.jsonl").read_text() == ""


@pytest.mark.parametrize("block", [5, 17, 256, 5000])
def test_a_json_array_reads_the_same_whatever_its_reading_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                block: int) -> None:
    """Strings, \\u escapes, numbers, -Infinity and literals cut by the end of a block are read on, not taken as
    broken or as two elements; numbers that are elements of their own keep every digit; an element over the limit
    is rejected and skipped, never a reason to stop, wherever the block ends."""
    from llmops.data.json_array import read_json_array

    rows = [{"text": f"é {n} \"quoted\" ✓ [{{", "x": [n * 1234567, True, None, -1.5e-7, -float("inf")]}
            for n in range(40)]
    elements = [*rows[:20], 1234567890, {"text": "long \\ \" ]} " * 400, "more": [[{}]]}, 1e-300, *rows[20:],
                {"end": False}]
    path = tmp_path / "a.json"
    # and an element whose inner object names a key twice (json.dumps cannot write one)
    twice = '{"text": "twice", "meta": {"k": [1, "]}"], "k": 2}, "after": [{"x": "[{"}]}'
    path.write_text(json.dumps(elements, ensure_ascii=True).replace('{"end"', twice + ', {"end"'))
    monkeypatch.setattr("llmops.data.json_array.READ_BLOCK", block)
    read = list(read_json_array(path, 4096))
    assert [row for _, row, _ in read if row is not None] == [*rows, {"end": False}]
    rejects = [reject for _, _, reject in read if reject is not None]
    assert [(reject.code, reject.stops_file) for reject in rejects] == [
        ("not_object", False), ("too_large", False), ("not_object", False), ("duplicate_key", False)]
    assert rejects[3].message == "key 'k' appears twice in one object: which value is meant is not known"
    assert "1234567890" in rejects[0].excerpt and "1e-300" in rejects[2].excerpt
    assert rejects[1].message == "record is 5,628 bytes, over data.max_record_bytes (4,096)"


def test_a_key_named_twice_in_one_object_is_quarantined_not_collapsed_to_one_value(tmp_path: Path) -> None:
    """A dict keeps one value of a key named twice and loses the other: such a row (at any depth) is quarantined
    as `duplicate_key`, naming the key, in JSON Lines and in a JSON array alike, and the rows after it are read."""
    from llmops.data.json_array import read_json_array
    from llmops.data.readers import read_jsonl

    objects = ['{"text": "a", "text": "b"}', '{"text": "c", "meta": {"tags": [{"k": 1, "k": 2}]}}',
               '{"text": "ok", "meta": {"k": 1, "K": 2}}']
    lines, array = tmp_path / "a.jsonl", tmp_path / "a.json"
    lines.write_text("\n".join(objects) + "\n")
    array.write_text("[\n" + ",\n".join(objects) + "\n]\n")
    for read in (read_jsonl(lines, 4096), read_json_array(array, 4096)):
        found = [(line, row, reject and (reject.code, reject.message, reject.stops_file)) for line, row, reject in read]
        twice = "appears twice in one object: which value is meant is not known"
        offset = found[0][0] - 1
        assert found == [(1 + offset, None, ("duplicate_key", f"key 'text' {twice}", False)),
                         (2 + offset, None, ("duplicate_key", f"key 'k' {twice}", False)),
                         (3 + offset, {"text": "ok", "meta": {"k": 1, "K": 2}}, None)]


def test_labels_outside_the_declared_set_are_quarantined(tmp_path: Path) -> None:
    rows = SAMPLES["classification"] + [{"text": "meh", "label": "neutral"}, {"text": "ok", "label": 1},
                                        {"text": "no label"}]
    data = DataConfig(kind="classification", labels=["negative", "positive", "1"],
                      path=str(write_jsonl(tmp_path / "c.jsonl", rows)))
    config = PipelineConfig(data=data)
    validated = validate(config, ingest(config))
    reasons = {q["line"]: (q["code"], q["message"]) for q in read_jsonl(validated.dir / "quarantine.jsonl")}
    assert reasons == {3: ("label_unknown", "label: 'neutral' is not one of data.labels (negative, positive, 1)"),
                       5: ("missing_field", "label: missing")}


def test_chat_turns_are_checked(tmp_path: Path) -> None:
    def turns(*pairs: tuple[str, object]) -> dict:
        return {"messages": [{"role": r, "content": c} for r, c in pairs]}

    rows = [
        turns(("user", "a"), ("assistant", "b")),                                        # 1 good
        turns(("assistant", "b")),                                                       # 2 starts wrong
        turns(("user", "a"), ("assistant", "b"), ("user", "c")),                         # 3 ends with user
        turns(("user", "a"), ("user", "b"), ("assistant", "c")),                         # 4 two users
        turns(("user", "a"), ("assistant", "  ")),                                       # 5 empty turn
        turns(("user", "a"), ("assistant", 5)),                                          # 6 content not text
        {"messages": "hello"},                                                           # 7 not a list
        turns(("system", "s"), ("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")),  # 8 good
        turns(("user", "a"), ("assistant\n", "b")),                                      # 9 a role with a newline
        turns(("user,assistant,user", "a"), ("assistant", "b")),                         # 10 three roles in one
        turns(("user", "\u200b"), ("assistant", "b")),                                   # 11 a zero-width space
        turns(("user", "a\u200b"), ("assistant", "\ufeff b \u2060")),                   # 12 good: text shows
    ]
    data = DataConfig(kind="chat", path=str(write_jsonl(tmp_path / "chat.jsonl", rows)))
    config = PipelineConfig(data=data)
    validated = validate(config, ingest(config))
    quarantine = {q["line"]: q for q in read_jsonl(validated.dir / "quarantine.jsonl")}
    assert {line: q["code"] for line, q in quarantine.items()} == {
        2: "chat_order", 3: "chat_order", 4: "chat_order", 5: "empty", 6: "chat_turns", 7: "chat_turns",
        9: "chat_order", 10: "chat_order", 11: "empty"}
    assert quarantine[10]["message"].startswith("messages: roles 'user,assistant,user, assistant' are out of order")
    assert quarantine[4]["message"].startswith("messages: roles 'user, user, assistant' are out of order")
    assert quarantine[5]["message"] == "messages: turn 2 is empty"
    assert quarantine[6]["message"] == "messages: turn 2: content is a number, not text"
    assert quarantine[7]["message"] == "messages: a string where a list of turns is expected"
    assert quarantine[11]["message"] == "messages: turn 1 is empty"
    assert [r["_line"] for r in table_rows(validated.dir / "valid")] == [1, 8, 12]


def test_csv_line_numbers_survive_blank_lines_and_short_rows(tmp_path: Path) -> None:
    path = tmp_path / "gaps.csv"
    path.write_text("text\nfirst\n\nthird\n\n\n\"sixth,\nspans two lines\"\neighth\n")
    record = ingest(PipelineConfig(data=DataConfig(kind="text", path=str(path))))
    rows = [(r["text"], r["_line"]) for r in read_records(record.dir)]
    assert rows == [("first", 2), ("third", 4), ("sixth,\nspans two lines", 7), ("eighth", 9)]
    wide = tmp_path / "wide.csv"
    wide.write_text("text,label\na,b,c\nd\n")
    rejected = list(read_jsonl(ingest(PipelineConfig(data=DataConfig(kind="classification", labels=["b", "x"],
                                                                  path=str(wide)))).dir / "rejected.jsonl"))
    assert [(r["line"], r["code"], r["message"]) for r in rejected] == [
        (2, "fields_mismatch", "3 fields where the header has 2"),
        (3, "fields_mismatch", "1 fields where the header has 2")]


def test_rejects_with_unpaired_surrogates_are_written(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "\\ud83d ' + "x" * 200 + '"}\n{"text": "fine"}\n')
    record = ingest(PipelineConfig(data=DataConfig(kind="text", path=str(path), max_record_bytes=150)))
    rejected = list(read_jsonl(record.dir / "rejected.jsonl"))
    assert rejected[0]["line"] == 1 and rejected[0]["code"] == "too_large"
    assert record.figures.rows_read == 2
