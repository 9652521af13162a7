"""Files as real corpora ship them: unquoted TSV, stray quotes, oversized quoted fields, repeated column names,
UTF-16 text, folders with hidden files, NaN answers."""

import json
import os
from pathlib import Path

import pytest

from llmops.config.schema import DataConfig, PipelineConfig
from llmops.data.ingest import read_records
from llmops.data.readers import CsvPart, DataSourceError, read_csv_part
from llmops.io.files import read_jsonl
from llmops.io.rejects import json_kind
from llmops.io.tables import table_rows
from tests.helpers import project_at, stage

ROWS = [f"Write the number {i} in words\tnumber {i}\n" for i in range(4)]


@pytest.fixture(autouse=True)
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return project_at(tmp_path, monkeypatch)


def ingested(path: Path, **source: object) -> tuple[list[dict], list[dict]]:
    record = stage("ingest", PipelineConfig(data=DataConfig(kind="instruction", path=str(path), **source)))
    return list(read_records(record.dir)), list(read_jsonl(record.dir / "rejected.jsonl"))


def test_a_tsv_reads_its_quotes_as_text(tmp_path: Path) -> None:
    """A quote that starts a field of a TSV file is text: under CSV rules it opened a field that ran three rows
    into one without a word."""
    path = tmp_path / "d.tsv"
    path.write_text("instruction\toutput\n" + ROWS[0] + '"Hide new secretions\tx\n' + ROWS[1] + 'He said "hi\tz\n'
                    + ROWS[2])
    records, rejected = ingested(path)
    assert rejected == []
    assert [(r["instruction"], r["output"], r["_line"]) for r in records] == [
        ("Write the number 0 in words", "number 0", 2), ('"Hide new secretions', "x", 3),
        ("Write the number 1 in words", "number 1", 4), ('He said "hi', "z", 5),
        ("Write the number 2 in words", "number 2", 6)]


def test_a_tsv_written_with_csv_quoting_reads_as_csv_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "d.tsv"
    path.write_text('instruction\toutput\n"two\nlines"\t"said ""hi"""\n' + ROWS[0])
    records, rejected = ingested(path, quoting="csv")
    assert rejected == []
    assert [(r["instruction"], r["output"], r["_line"]) for r in records] == [
        ("two\nlines", 'said "hi"', 2), ("Write the number 0 in words", "number 0", 4)]


def test_a_stray_quote_in_a_csv_is_a_reject_naming_its_lines_not_rows_run_together(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    rows = [row.replace("\t", ",") for row in ROWS]
    path.write_text("instruction,output\n" + rows[0] + '"Hide new secretions,x\n' + rows[1] + 'He said "hi,z\n'
                    + rows[2])
    records, rejected = ingested(path)
    assert [r["_line"] for r in records] == [2, 6]
    assert [(r["line"], r["code"]) for r in rejected] == [(3, "csv_broken")]
    assert "lines 3-5 read as one row" in rejected[0]["message"]


def test_a_quoted_field_over_the_record_limit_is_one_reject_not_made_up_rows(tmp_path: Path) -> None:
    """The reader stops inside a field over the limit; what is left of it must not be read as rows."""
    path = tmp_path / "d.csv"
    injected = "\n".join(f"Injected instruction {k},injected output {k}" for k in range(60))
    path.write_text("instruction,output\nfirst,one\n" + f'"{injected}",big\nlast,two\n')
    records, rejected = ingested(path, max_record_bytes=500)
    assert [(r["instruction"], r["_line"]) for r in records] == [("first", 2), ("last", 63)]
    assert [(r["line"], r["code"]) for r in rejected] == [(3, "too_large")]
    assert "lines 3-62 read as one row" in rejected[0]["message"]


def test_a_repeated_column_name_keeps_both_columns_the_first_under_its_name(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("instruction,output,output,output.1\nAdd.,5,five,V\n")
    rows = list(read_csv_part(path, 10_000, CsvPart(",")))
    assert rows == [(2, {"instruction": "Add.", "output": "5", "output.2": "five", "output.1": "V"}, None)]
    records, _ = ingested(path)
    assert records[0]["output"] == "5"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_wide_encoding_is_one_error_naming_the_file(tmp_path: Path, encoding: str) -> None:
    path = tmp_path / "d.jsonl"
    text = json.dumps({"instruction": "Add.", "output": "5"}) + "\n"
    path.write_bytes(("\ufeff" + text).encode(encoding) if encoding == "utf-16-be" else text.encode(encoding))
    with pytest.raises(DataSourceError, match=r"d\.jsonl: the file is UTF-(16|32) .* save it as UTF-8"):
        ingested(path)


def test_a_folder_skips_hidden_files_and_folders(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "__MACOSX").mkdir(parents=True)
    (data / ".ipynb_checkpoints").mkdir()
    good = json.dumps({"instruction": "Add.", "output": "5"}) + "\n"
    (data / "train.jsonl").write_text(good)
    (data / "__MACOSX" / "._train.jsonl").write_bytes(b"\x00\x05\x16\x07Mac OS X\x00\x00ATTR")
    (data / ".ipynb_checkpoints" / "train-checkpoint.jsonl").write_text(good)
    (data / ".hidden.jsonl").write_text(good)
    records, rejected = ingested(data)
    assert (len(records), rejected) == (1, [])
    records, _ = ingested(tmp_path / "data" / "*.jsonl")
    assert [r["_source"] for r in records] == ["data/train.jsonl"]


def test_nan_and_infinity_are_no_answer(tmp_path: Path) -> None:
    assert [json_kind(v) for v in (float("nan"), float("inf"), -float("inf"), 1.5, 2)] == [
        "non-finite number", "non-finite number", "non-finite number", "number", "number"]
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "0/0?", "answer": NaN}\n{"prompt": "1/0?", "answer": Infinity}\n'
                    '{"prompt": "1+1?", "answer": 2}\n')
    config = PipelineConfig(data=DataConfig(kind="prompts", path=str(path)))
    validated = stage("validate", config, stage("ingest", config))
    quarantine = list(read_jsonl(validated.dir / "quarantine.jsonl"))
    assert [(r["line"], r["code"], r["field"]) for r in quarantine] == [(1, "wrong_type", "answer"),
                                                                       (2, "wrong_type", "answer")]
    assert "non-finite number" in quarantine[0]["message"]
    assert [r["answer"] for r in table_rows(validated.dir / "valid")] == ["2"]


def validated_pairs(tmp_path: Path, rows: list[dict]) -> tuple[list[dict], list[dict]]:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = PipelineConfig(data=DataConfig(kind="preference", path=str(path)))
    validated = stage("validate", config, stage("ingest", config))
    return list(table_rows(validated.dir / "valid")), list(read_jsonl(validated.dir / "quarantine.jsonl"))


def test_pairs_whose_answers_hold_the_conversation_get_their_prompt_from_it(tmp_path: Path) -> None:
    """HH-RLHF keeps the prompt inside each answer as a transcript; UltraFeedback's chosen and rejected are whole
    conversations next to a prompt column. The turns both answers share are the prompt."""
    hh = {"chosen": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant: It is 4.",
          "rejected": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant: Five."}
    user = {"role": "user", "content": "Name a colour."}
    ultra = {"prompt": "Name a colour.", "chosen": [user, {"role": "assistant", "content": "Blue."}],
             "rejected": [user, {"role": "assistant", "content": "A dog."}]}
    other = {"prompt": "Something else.", "chosen": ultra["chosen"], "rejected": ultra["rejected"]}
    plain = {"prompt": "Say yes.", "chosen": "Yes.", "rejected": "No."}
    valid, quarantine = validated_pairs(tmp_path, [hh, ultra, other, plain])
    assert [(row["prompt"], row["chosen"], row["rejected"]) for row in valid] == [
        ([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "What is 2+2?"}], [{"role": "assistant", "content": "It is 4."}],
         [{"role": "assistant", "content": "Five."}]),
        ([user], [{"role": "assistant", "content": "Blue."}], [{"role": "assistant", "content": "A dog."}]),
        ("Say yes.", "Yes.", "No.")]
    # a prompt column that names another prompt than the conversations' is not overridden
    assert [(row["line"], row["code"], row["field"]) for row in quarantine] == [(3, "chat_order", "chosen")]


def test_a_csv_whose_header_holds_no_field_of_the_kind_is_one_error_with_the_likely_cause(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("instruction;output\nAdd 2 and 3.;5\n")
    with pytest.raises(DataSourceError, match=r"d\.csv: no column of its header \(instruction;output\) holds a field "
                                              r"of kind instruction .*one column holds ';': set the source's delim"):
        ingested(path)
    records, rejected = ingested(path, delimiter=";")
    assert (records[0]["instruction"], records[0]["output"], rejected) == ("Add 2 and 3.", "5", [])
    other = tmp_path / "e.csv"
    other.write_text("question,reply\nAdd 2 and 3.,5\n")
    with pytest.raises(DataSourceError, match="map your columns to the fields with the source's columns"):
        ingested(other)
    records, _ = ingested(other, columns={"instruction": "question", "output": "reply"})
    assert records[0]["output"] == "5"


def test_an_unpaired_surrogate_escape_names_its_field(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"instruction": "emoji \\ud83d broken", "output": "fine"}\n')
    _, rejected = ingested(path)
    assert [(r["code"], r["field"]) for r in rejected] == [("utf8_invalid", "instruction")]


def test_integer_labels_in_a_config_read_as_the_rows_integer_labels(tmp_path: Path) -> None:
    assert DataConfig(kind="classification", labels=[0, 1]).labels == ["0", "1"]
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "great film", "label": 1}\n{"text": "dull plot", "label": 0}\n'
                    '{"text": "odd one", "label": 2}\n')
    config = PipelineConfig(data=DataConfig(kind="classification", labels=[0, 1], path=str(path)),
                            validate={"max_bad_fraction": 0.5})
    validated = stage("validate", config, stage("ingest", config))
    assert [r["line"] for r in read_jsonl(validated.dir / "quarantine.jsonl")] == [3]


def instruction_rows(count: int, first: int = 0) -> list[dict]:
    return [{"instruction": f"Write the number {i} in words", "output": f"number {i}"}
            for i in range(first, first + count)]


def test_a_folder_reads_its_regular_files_and_refuses_a_link_to_nothing(tmp_path: Path) -> None:
    """A folder named like a data file is walked, not opened; a pipe is no file to read (it would never end); a link
    to a missing file is one error naming it, not a traceback or a quiet skip."""
    folder = tmp_path / "data"
    (folder / "sub.jsonl").mkdir(parents=True)
    (folder / "a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in instruction_rows(2)))
    (folder / "sub.jsonl" / "b.jsonl").write_text(json.dumps(instruction_rows(1, 2)[0]) + "\n")
    os.mkfifo(folder / "pipe.jsonl")
    records, rejected = ingested(folder)
    assert rejected == []
    assert [(r["output"], Path(r["_source"]).name) for r in records] == [
        ("number 0", "a.jsonl"), ("number 1", "a.jsonl"), ("number 2", "b.jsonl")]
    (folder / "gone.jsonl").symlink_to(tmp_path / "moved.jsonl")
    with pytest.raises(DataSourceError, match=r"gone.jsonl links to .*moved.jsonl, which does not exist$"):
        ingested(folder)


@pytest.mark.parametrize("after", ["\n" + json.dumps(instruction_rows(2, 3)), " trailing text\n",
                                   '\n{"instruction": "broken', "\n]\n"])
def test_text_after_a_json_arrays_closing_bracket_stops_the_file_with_a_reject(tmp_path: Path, after: str) -> None:
    """A second array, text or a broken object after the array: read as the array alone, the rest was dropped
    without a word; now it is a reject that says so, and validation stops the run on the unread file."""
    array = json.dumps(instruction_rows(3), indent=1)
    path = tmp_path / "d.json"
    path.write_text(array + after)
    records, rejected = ingested(path)
    assert [r["output"] for r in records] == ["number 0", "number 1", "number 2"]
    # the line the text after the bracket starts on
    line = array.count("\n") + 1 + after[:len(after) - len(after.lstrip())].count("\n")
    assert [(r["line"], r["code"], r["message"]) for r in rejected] == [
        (line, "json_broken", "text after the closing bracket of the JSON array; the rest of the file was not read")]


def test_a_json_array_after_many_blank_lines_is_read_as_an_array(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text("\n" * 70 + json.dumps(instruction_rows(3), indent=1) + "\n\n")
    records, rejected = ingested(path)
    assert rejected == []
    assert [(r["output"], r["_line"]) for r in records] == [("number 0", 72), ("number 1", 76), ("number 2", 80)]


def test_a_lone_carriage_return_in_a_json_line_is_not_a_line_end(tmp_path: Path) -> None:
    """JSON Lines ends a line with \\n only: a \\r between a record's tokens is whitespace, and one inside a string
    is kept for validation to name. Read as a line end, it split one record into two broken rows and moved the line
    numbers of every row after it."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"instruction": "q0", "output": "a0"}\n{"instruction": "q1",\r "output": "a1"}\r\n'
                     b'{"instruction": "q2\rx", "output": "a2"}\n{"instruction": "q3", "output": "a3"}\n')
    records, rejected = ingested(path)
    assert rejected == []
    assert [(r["instruction"], r["_line"]) for r in records] == [("q0", 1), ("q1", 2), ("q2\rx", 3), ("q3", 4)]


def test_a_csv_row_the_reader_cannot_split_is_shown_in_its_reject(tmp_path: Path) -> None:
    """A quote opened and never closed runs to the end of the file: the reject names its lines and shows their
    start, so the row can be found and fixed (its excerpt was empty)."""
    path = tmp_path / "d.csv"
    path.write_text('instruction,output\nWrite one,1\n"Never closed,2\nWrite three,3\n')
    records, rejected = ingested(path)
    assert [r["_line"] for r in records] == [2]
    assert [(r["line"], r["code"]) for r in rejected] == [(3, "csv_broken")]
    assert rejected[0]["message"].endswith("lines 3-4 read as one row")
    assert rejected[0]["excerpt"] == '"Never closed,2\nWrite three,3\n'


def test_a_loop_of_links_is_named_a_loop(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").symlink_to("e.jsonl")
    (tmp_path / "e.jsonl").symlink_to("d.jsonl")
    with pytest.raises(DataSourceError, match=r"d.jsonl links to e.jsonl, and the links lead back round in a loop$"):
        ingested(tmp_path / "d.jsonl")


def test_an_element_of_a_json_array_nested_too_deeply_is_one_reject_and_the_rest_is_read(tmp_path: Path) -> None:
    """Valid JSON deeper than the parser recurses: as in a JSON line, a too_deep reject for that element; it stopped
    the whole file with a json_broken reject before."""
    path = tmp_path / "d.json"
    nested = '{"instruction": "q1", "output": "a1", "x": ' + "[" * 3000 + "]" * 3000 + "}"
    path.write_text('[\n{"instruction": "q0", "output": "a0"},\n' + nested + ',\n{"instruction": "q2", "output": "a2"}'
                    '\n]\n')
    records, rejected = ingested(path)
    assert [(r["instruction"], r["_line"]) for r in records] == [("q0", 2), ("q2", 4)]
    assert [(r["line"], r["code"], r["message"]) for r in rejected] == [
        (3, "too_deep", "JSON nested too deeply to read")]


def test_a_row_with_none_of_the_kinds_fields_is_rejected_showing_its_own_columns(tmp_path: Path) -> None:
    """Data of another shape than data.kind (a prompt and response under names the kind does not know): each row
    was quarantined as a missing instruction with an excerpt of nulls, which hid what the row held."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "Say hi", "response": "hi"}) + "\n"
                    + json.dumps({"instruction": "Say ho", "output": "ho"}) + "\n")
    records, rejected = ingested(path)
    assert [r["_line"] for r in records] == [2]
    (reject,) = rejected
    assert (reject["line"], reject["code"]) == (1, "missing_field")
    assert reject["message"] == ("none of the instruction fields (instruction, input, output) is in the row, which "
                                 "holds 'prompt', 'response': map them with the source's columns, or set data.kind")
    assert reject["excerpt"] == '{"prompt": "Say hi", "response": "hi"}'


def test_a_csv_header_not_in_utf8_or_without_a_mapped_column_is_one_error(tmp_path: Path) -> None:
    """Both passed without a word before: every row then quarantined for a missing field, the cause unnamed."""
    path = tmp_path / "d.csv"
    path.write_bytes(b"instr\xffuction,outp\xffut\nSay hi,hi\n")
    with pytest.raises(DataSourceError, match=r"d.csv: no column of its header .* holds a field of kind instruction "
                                              r".*; its column 1 is not UTF-8 text: save the file as UTF-8$"):
        ingested(path)
    path.write_text("question,output\nSay hi,hi\n")
    with pytest.raises(DataSourceError, match=r"d.csv: the source's columns map instruction to 'prompt', which is "
                                              r"no column of its header \(question, output\)$"):
        ingested(path, columns={"instruction": "prompt"})
    records, _ = ingested(path, columns={"instruction": "question"})
    assert [r["instruction"] for r in records] == ["Say hi"]


def test_a_file_whose_name_is_not_utf8_is_one_error_naming_it(tmp_path: Path) -> None:
    """The records name their file, in UTF-8: a name of other bytes (read as surrogates) failed the first write with
    a traceback. It is refused with its bytes shown."""
    folder = tmp_path / "data"
    folder.mkdir()
    named = Path(os.fsdecode(bytes(folder) + b"/caf\xe9.jsonl"))
    named.write_text(json.dumps({"instruction": "Add.", "output": "5"}) + "\n")
    with pytest.raises(DataSourceError, match=r"the name b'.*/caf\\xe9\.jsonl' is not UTF-8, .*: rename the file$"):
        ingested(folder)


def test_parquet_columns_of_one_name_are_told_apart_as_a_csv_headers_are(tmp_path: Path) -> None:
    """Arrow allows two columns of one name: a row as a dict kept only the second's value, without a word."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["Add.", "Sub."]), pa.array(["5", "1"]), pa.array(["x", "y"])],
                                        names=["instruction", "output", "instruction"]), path)
    records, rejected = ingested(path)
    assert [(r["instruction"], r["output"]) for r in records] == [("Add.", "5"), ("Sub.", "1")] and rejected == []


def test_parquet_is_read_in_batches_of_bytes_not_of_a_fixed_row_count(tmp_path: Path) -> None:
    """10,000 rows of a few megabytes each were gigabytes at once: a batch holds about BATCH_BYTES of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from llmops.data.parquet_rows import BATCH_BYTES, BATCH_ROWS, batch_rows

    for size, expected in ((1 << 20, BATCH_BYTES // (1 << 20)), (20, BATCH_ROWS)):
        path = tmp_path / f"rows-{size}.parquet"
        pq.write_table(pa.table({"text": [f"{n} " + "a" * size for n in range(200)]}), path, compression="zstd")
        found = batch_rows(pq.ParquetFile(path).metadata)
        assert abs(found - expected) <= expected // 10, (size, found)
