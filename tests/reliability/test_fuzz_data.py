"""Fuzzing ingest, validate and dedup with every format and record kind: whatever the bytes, no crash, and every
row read ends in exactly one of kept (train or eval), quarantined, duplicate or contaminated.

Each example writes a file in one format, runs the three stages on it, and checks that the rows each stage
counts reconcile, that every outcome carries its row's source and line, that the rows of a file whose rows
can be counted independently are exactly those, and that the bad-fraction gate stops in one line exactly when
it should.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, reject
from hypothesis import strategies as st

from llmops.config.schema import DataConfig, DedupConfig, PipelineConfig, ValidateConfig
from llmops.data.dedup import EmptySplitError, write_splits
from llmops.data.ingest import read_records
from llmops.data.readers import DataSourceError
from llmops.data.validate import DataQualityError, check_bad_fraction
from llmops.io.files import read_jsonl
from llmops.io.rejects import QUARANTINE_COLUMNS, RejectCode
from llmops.io.tables import table_rows
from tests.helpers import stage

pytestmark = pytest.mark.reliability

KINDS = ("text", "instruction", "chat", "classification")
LABELS = ["neg", "pos"]
MAX_RECORD_BYTES = 4096
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
BOM = b"\xef\xbb\xbf"

# text: odd unicode (lone surrogates, controls, NUL, right-to-left marks, emoji), or a few words that repeat
texts = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=40),
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=25).map(" ".join),
    st.sampled_from(["", "   ", "a\x00b", "a\x1bb", "tab\there", "\u202eevil", "\U0001f600", "line\nbreak"]),
)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=12)


def turn(role: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"role": role, "content": st.one_of(texts, json_values)})


roles = st.sampled_from(["system", "user", "assistant", "user", "assistant", "bot", "x"])
chats = st.one_of(st.lists(turn(roles), max_size=5),
                  st.integers(1, 3).map(lambda n: [{"role": r, "content": f"turn {i}"} for i in range(n)
                                                   for r in ("user", "assistant")]))
FIELDS = {
    "text": {"text": texts},
    "instruction": {"instruction": texts, "input": st.one_of(st.none(), texts), "output": texts},
    "chat": {"messages": chats},
    "classification": {"text": texts, "label": st.sampled_from([*LABELS, "other", 1, None, True])},
}


@st.composite
def records(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """A record of `kind`, good or not: fields may be missing, of another type, or hold anything."""
    record = {}
    for field, values in FIELDS[kind].items():
        choice = draw(st.integers(0, 9))
        if choice == 0:
            continue  # the field is missing
        record[field] = draw(json_values if choice == 1 else values)
    return record


# JSON text that json.dumps cannot make: huge numbers, deep nesting, duplicate keys, control characters, a BOM
SPECIAL_JSON = [
    '{"text": ' + "9" * 5000 + "}",
    "[" * 3000 + "]" * 3000,
    '{"text": ' + "[" * 80 + "]" * 80 + "}",
    '{"text": "first", "text": "second"}',
    '{"text": "raw\x01control"}',
    '{"text": "\\ud83d lone surrogate"}',
    '{"text": "' + "a" * (MAX_RECORD_BYTES + 10) + '"}',
    "\ufeff{}",
    "null",
    "[1, 2]",
    '{"text": "truncated',
]


@st.composite
def json_lines(draw: st.DrawFn, kind: str) -> bytes:
    """JSONL with good and bad rows, random bytes, mixed line ends and maybe a byte-order mark."""
    pieces: list[bytes] = []
    for _ in range(draw(st.integers(0, 24))):
        choice = draw(st.integers(0, 9))
        if choice <= 5:
            pieces.append(json.dumps(draw(records(kind)), ensure_ascii=draw(st.booleans())).encode("utf-8",
                                                                                                   "surrogatepass"))
        elif choice == 6:
            pieces.append(json.dumps(draw(json_values)).encode())
        elif choice == 7:
            pieces.append(draw(st.binary(max_size=60)))
        elif choice == 8:
            pieces.append(draw(st.sampled_from(SPECIAL_JSON)).encode("utf-8", "surrogatepass"))
        else:
            text = json.dumps(draw(records(kind)))
            pieces.append(text[: draw(st.integers(0, len(text)))].encode("utf-8", "surrogatepass"))
    ends = [draw(st.sampled_from([b"\n", b"\r\n", b"\r"])) for _ in pieces]
    body = b"".join(piece + end for piece, end in zip(pieces, ends, strict=True))
    if draw(st.booleans()) and body:
        body = body[: -len(ends[-1])]  # no line end after the last line
    return (BOM if draw(st.booleans()) else b"") + body


def counted_lines(content: bytes, lone_cr: bool = True) -> list[int]:
    """The line numbers of the non-blank lines, counted here independently of ingest: JSON Lines end at \\n only,
    plain text at a lone \\r too."""
    body = content.removeprefix(BOM)
    lines = body.splitlines() if lone_cr else body.split(b"\n")
    return [number for number, line in enumerate(lines, start=1) if line.strip()]


def pipeline(kind: str, source: dict[str, Any], max_bad: float = 1.0, **data: Any) -> PipelineConfig:
    return PipelineConfig(
        data=DataConfig(kind=kind, sources=[source], labels=LABELS if kind == "classification" else [],
                        max_record_bytes=MAX_RECORD_BYTES, eval_fraction=0.3, **data),
        validate=ValidateConfig(max_bad_fraction=max_bad, max_chars=1000, chunk_rows=64),
        dedup=DedupConfig(min_words=4, num_perm=16))


@contextlib.contextmanager
def project() -> Iterator[Path]:
    """A fresh project folder, the working directory while in use: the stages name each source relative to it."""
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
        root = Path(folder)
        (root / "dvc.yaml").write_text("stages: {}\n")
        yield root


def ingest(config: PipelineConfig) -> Any:
    return stage("ingest", config)


def run_and_account(config: PipelineConfig, expected: Counter | None = None) -> None:
    """Run ingest, validate and dedup; check that every row read has exactly one outcome."""
    ingested = ingest(config)
    validated = stage("validate", config, ingested)
    figures = validated.figures
    assert figures.rows_read == ingested.figures.rows_read == figures.rows_kept + figures.rows_quarantined
    assert sum(figures.codes.values()) == figures.rows_quarantined
    quarantine = list(read_jsonl(validated.dir / "quarantine.jsonl"))
    for entry in quarantine:
        assert tuple(entry) == QUARANTINE_COLUMNS and RejectCode(entry["code"])
        assert isinstance(entry["line"], int) and entry["line"] >= 1 and entry["message"].strip()
    check_gate(config, validated)
    outcomes = Counter((entry["source"], entry["line"]) for entry in quarantine)
    outcomes.update(dedup_outcomes(config, validated))
    assert sum(outcomes.values()) == figures.rows_read
    kept_and_bad = Counter((row["_source"], row["_line"]) for row in read_records(ingested.dir))
    kept_and_bad.update((row["source"], row["line"]) for row in read_jsonl(ingested.dir / "rejected.jsonl"))
    assert outcomes == kept_and_bad
    if expected is not None and not figures.sources_not_read_to_the_end:
        assert outcomes == expected


def dedup_outcomes(config: PipelineConfig, validated: Any) -> list[tuple[str, int]]:
    """The (source, line) of every row dedup kept (train or eval), clustered or found contaminated."""
    with tempfile.TemporaryDirectory() as scratch:
        try:
            folder = stage("dedup", config, validated).dir
        except EmptySplitError:  # a split came out empty: account for the rows all the same
            folder = Path(scratch)
            counts = write_splits(config.dedup, config.data, validated.dir / "valid", folder)
            assert counts["rows_in"] == validated.figures.rows_kept
        found = [(row["_source"], row["_line"]) for name in ("train", "eval") for row in table_rows(folder / name)]
        found += [(row["source"], row["line"]) for name in ("clusters.jsonl", "contaminated.jsonl")
                  for row in read_jsonl(folder / name)]
    assert len(found) == validated.figures.rows_kept
    return found


def check_gate(config: PipelineConfig, validated: Any) -> None:
    """The gate stops the run exactly past max_bad_fraction (or on a file not read to its end), in one line."""
    figures = validated.figures
    should_stop = bool(figures.sources_not_read_to_the_end) or figures.bad_fraction > \
        config.validation.max_bad_fraction or figures.rows_kept == 0
    try:
        check_bad_fraction(config, validated)
    except DataQualityError as err:
        message = str(err)
        assert should_stop and "\n" not in message and str(validated.dir / "quarantine.jsonl") in message
        if not figures.sources_not_read_to_the_end and figures.rows_read:
            top, count = next(iter(figures.codes.items()))
            assert f"main reasons: {top} ({count})" in message
        return
    assert not should_stop


kinds = st.sampled_from(KINDS)
limits = st.sampled_from([0.0, 0.05, 0.5, 1.0])


@given(kind=kinds, content=st.data(), limit=limits, held_out=st.booleans())
def test_jsonl_and_text_lines(kind: str, content: st.DataObject, limit: float, held_out: bool) -> None:
    """Line formats: the rows are exactly the non-blank lines, whatever their bytes and line ends."""
    data = content.draw(json_lines(kind))
    as_text = kind == "text" and content.draw(st.booleans())
    with project() as root:
        path = root / ("d.txt" if as_text else "d.jsonl")
        path.write_bytes(data)
        extra: dict[str, Any] = {}
        if held_out:  # a held-out file that repeats some rows: they are contaminated, not trained on
            eval_rows = [content.draw(records(kind)) for _ in range(3)]
            (root / "e.jsonl").write_text("".join(json.dumps(row) + "\n" for row in eval_rows))
            extra["eval_sources"] = [{"path": str(root / "e.jsonl")}]
        expected = Counter(("d.txt" if as_text else "d.jsonl", line) for line in counted_lines(data, as_text))
        if held_out:
            expected.update(("e.jsonl", line) for line in range(1, 4))
        run_and_account(pipeline(kind, {"path": str(path)}, limit, **extra), expected)


@st.composite
def json_arrays(draw: st.DrawFn, kind: str) -> tuple[bytes, int | None]:
    """A JSON array file, maybe truncated or with bytes spliced in; with its element count when intact."""
    elements = [json.dumps(draw(records(kind))) if draw(st.integers(0, 3)) else
                draw(st.sampled_from(SPECIAL_JSON[3:6] + [json.dumps(draw(json_values))]))
                for _ in range(draw(st.integers(0, 12)))]
    separator = draw(st.sampled_from([", ", ",\n  ", ",\r\n", ","]))
    text = "[" + separator.join(elements) + "]"
    data = (BOM if draw(st.booleans()) else b"") + text.encode("utf-8", "surrogatepass")
    damage = draw(st.integers(0, 3))
    if damage == 1:
        return data[: draw(st.integers(1, len(data)))], None
    if damage == 2:
        at = draw(st.integers(1, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=20)) + data[at:], None
    return data, len(elements)


@given(kind=kinds, content=st.data(), limit=limits)
def test_json_arrays(kind: str, content: st.DataObject, limit: float) -> None:
    data, count = content.draw(json_arrays(kind))
    with project() as root:
        (root / "d.json").write_bytes(data)
        config = pipeline(kind, {"path": str(root / "d.json")}, limit)
        ingested = ingest(config)
        if count is not None and not ingested.figures.sources_not_read_to_the_end:
            assert ingested.figures.rows_read == count
        run_and_account(config)


cells = st.one_of(texts.filter(lambda t: "\x00" not in t and not any(0xD800 <= ord(c) < 0xE000 for c in t)),
                  st.sampled_from(['say "hi"', "a,b", "a\tb", "multi\nline", "cr\rlf", ""]))


@st.composite
def delimited(draw: st.DrawFn, kind: str, delimiter: str) -> tuple[bytes, int | None]:
    """CSV/TSV with quoted newlines, ragged rows, an odd header, maybe bytes that are not UTF-8."""
    header = [column for column in ("text", "instruction", "input", "output", "label", "messages")
              if column in FIELDS[kind] or draw(st.integers(0, 5)) == 0]
    header = header or ["text"]
    rows = [draw(st.lists(cells, min_size=max(1, len(header) - 1), max_size=len(header) + 1))
            for _ in range(draw(st.integers(0, 15)))]
    rows = [row for row in rows if row != [""] or len(header) == 1]
    buffer = io.StringIO()
    # a bare \r in a field is quoted only when it is part of the line terminator: quote all fields with "\n"
    ending, quoting = draw(st.sampled_from([("\r\n", csv.QUOTE_MINIMAL), ("\n", csv.QUOTE_ALL)]))
    writer = csv.writer(buffer, delimiter=delimiter, lineterminator=ending, quoting=quoting)
    writer.writerow(header)
    writer.writerows(rows)
    data = (BOM if draw(st.booleans()) else b"") + buffer.getvalue().encode("utf-8")
    if draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=12)) + data[at:], None
    return data, len(rows)


@pytest.mark.parametrize(("delimiter", "quoting"), [(",", "auto"), ("\t", "csv"), ("\t", "auto")],
                         ids=["csv", "tsv-quoted", "tsv"])
@given(kind=kinds, content=st.data(), limit=limits)
def test_csv_and_tsv(delimiter: str, quoting: str, kind: str, content: st.DataObject, limit: float) -> None:
    """Files as a CSV writer writes them; a TSV file read as TSV (unquoted) counts its rows by lines, not by the
    writer's rows, and must still account for every one."""
    data, count = content.draw(delimited(kind, delimiter))
    name = "d.csv" if delimiter == "," else "d.tsv"
    with project() as root:
        (root / name).write_bytes(data)
        config = pipeline(kind, {"path": str(root / name), "quoting": quoting}, limit)
        header = first_row(data, delimiter, quoting == "csv" or delimiter == ",")
        if header and not set(header) & set(FIELDS[kind]):
            # a header (damaged, or made of other columns) that holds none of the kind's fields is one error
            with pytest.raises(DataSourceError, match=f"{name}: no column of its header"):
                ingest(config)
            return
        if count is not None and (delimiter == "," or quoting == "csv"):
            assert ingest(config).figures.rows_read == count
        run_and_account(config)


def first_row(data: bytes, delimiter: str, quoted: bool) -> list[str] | None:
    """The header as Python's CSV reader reads it: the first row that is not blank ([] when there is none; None
    when it cannot be read, which the reader quarantines)."""
    text = io.StringIO(data.decode("utf-8-sig", errors="surrogateescape"), newline="")
    reader = csv.reader(text, delimiter=delimiter, strict=True) if quoted else \
        csv.reader(text, delimiter=delimiter, quoting=csv.QUOTE_NONE)
    try:
        return next((row for row in reader if row), [])
    except csv.Error:
        return None


COLUMN_TYPES = {
    "string": (pa.string(), texts.filter(lambda t: not any(0xD800 <= ord(c) < 0xE000 for c in t))),
    "int": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "float": (pa.float64(), st.floats()),
    "bool": (pa.bool_(), st.booleans()),
    "binary": (pa.binary(), st.binary(max_size=20)),
    "strings": (pa.list_(pa.string()), st.lists(st.sampled_from(WORDS), max_size=3)),
    "turns": (pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
              st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                              "content": st.sampled_from(WORDS + [""])}), max_size=4)),
    "timestamp": (pa.timestamp("s"), st.datetimes()),
}


@st.composite
def tables(draw: st.DrawFn, kind: str) -> pa.Table:
    """A table whose columns have any of the types above, some canonical names missing, some extra."""
    names = [n for n in ("text", "instruction", "input", "output", "label", "messages", "extra")
             if n in FIELDS[kind] and draw(st.integers(0, 6)) or n == "extra" and draw(st.booleans())]
    rows = draw(st.integers(0, 12))
    columns = {}
    for name in names:
        arrow_type, values = COLUMN_TYPES[draw(st.sampled_from(sorted(COLUMN_TYPES)))]
        columns[name] = pa.array([draw(st.one_of(st.none(), values)) for _ in range(rows)], type=arrow_type)
    return pa.table(columns) if columns else pa.table({"unrelated": pa.array([None] * rows, type=pa.null())})


@given(kind=kinds, content=st.data(), limit=limits)
def test_parquet_with_unexpected_schemas(kind: str, content: st.DataObject, limit: float) -> None:
    table = content.draw(tables(kind))
    damage = content.draw(st.integers(0, 4))
    with project() as root:
        path = root / "d.parquet"
        pq.write_table(table, path, row_group_size=max(1, content.draw(st.integers(1, 8))))
        if damage == 1:  # cut short, or not Parquet at all: a one-line source error or a reject, never a crash
            path.write_bytes(path.read_bytes()[: content.draw(st.integers(0, path.stat().st_size))])
        elif damage == 2:
            path.write_bytes(content.draw(st.binary(max_size=200)))
        elif damage == 3:  # bytes zeroed before the footer: each row is read or quarantined, as the footer counts
            path.write_bytes(zeroed(path.read_bytes(), content))
        config = pipeline(kind, {"path": str(path)}, limit)
        try:
            read = ingest(config).figures.rows_read
        except DataSourceError as err:
            assert damage and "\n" not in str(err) and "d.parquet" in str(err)
            return
        assert damage in (1, 2) or read == table.num_rows
        run_and_account(config)


def zeroed(raw: bytes, content: st.DataObject) -> bytes:
    """A Parquet file with a run of its data bytes (between the magic and the footer) set to zero."""
    body = len(raw) - int.from_bytes(raw[-8:-4], "little") - 8
    if body <= 4:
        return raw
    start = content.draw(st.integers(4, body - 1))
    end = min(body, start + content.draw(st.integers(1, 64)))
    return raw[:start] + bytes(end - start) + raw[end:]


@given(kind=kinds, content=st.data(), limit=limits)
def test_saved_datasets(kind: str, content: st.DataObject, limit: float) -> None:
    table = content.draw(tables(kind))
    damage = content.draw(st.booleans())
    with project() as root:
        try:
            datasets.Dataset(table).save_to_disk(str(root / "saved"))
        except (TypeError, ValueError, pa.ArrowException):
            reject()  # a table the datasets library itself will not save
        if damage:
            for arrow_file in (root / "saved").glob("*.arrow"):
                arrow_file.write_bytes(content.draw(st.binary(max_size=100)))
        config = pipeline(kind, {"path": str(root / "saved")}, limit)
        try:
            read = ingest(config).figures.rows_read
        except DataSourceError as err:  # damaged, or empty (datasets cannot load an empty dataset it saved)
            assert (damage or not table.num_rows) and "\n" not in str(err)
            return
        assert damage or read == table.num_rows
        run_and_account(config)


@given(files=st.lists(st.one_of(st.binary(max_size=80), texts.map(lambda t: t.encode("utf-8", "surrogatepass"))),
                      min_size=1, max_size=6), bom=st.booleans(), limit=limits)
def test_text_files(files: list[bytes], bom: bool, limit: float) -> None:
    with project() as root:
        (root / "docs").mkdir()
        for number, content in enumerate(files):
            (root / "docs" / f"{number}.txt").write_bytes((BOM if bom else b"") + content)
        config = pipeline("text", {"path": str(root / "docs" / "*.txt"), "format": "text-files"}, limit)
        expected = Counter((f"docs/{number}.txt", 1) for number in range(len(files)))
        run_and_account(config, expected)
