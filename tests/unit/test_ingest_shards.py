"""Ingest shard by shard: records, rejects and figures the same bytes whatever the shard size and worker count, with
line numbers, byte-order marks, line ends, broken rows and CSV fields that span lines as in one read of each file."""

from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmops.config.engine import EngineConfig, usable_cpus
from llmops.config.schema import DataConfig
from llmops.data.ingest import locate_all, record_files, write_records
from llmops.data.readers import split_lines
from llmops.io.shards import array_ranges, byte_ranges, count_lines, field_array, keep_as_parts, kept_parts
from llmops.objectives import record_kind
from llmops.pipeline.engine import Engine, Progress, in_order


def jsonl_bytes(rng: random.Random, rows: int) -> bytes:
    """JSON lines with what a reader must number right: CRLF ends, a lone CR inside a record (whitespace, not a line
    end), blank lines, a byte-order mark, broken JSON, bad UTF-8, a line over the size limit, a non-object."""
    lines: list[bytes] = []
    for number in range(rows):
        text = json.dumps({"text": f"row {number} " + " ".join(rng.choice("abcdef") for _ in range(30))}).encode()
        text = damaged(rng, text, (b'{"text": "broken', b'{"text": "bad \xff utf-8"}', b"[1, 2]"))
        text = text.replace(b"{", b"{\r", 1) if rng.random() < 0.1 else text
        lines.append(text + rng.choice([b"\n", b"\n", b"\r\n", b"\n\n", b"\n \n"]))
    return b"\xef\xbb\xbf" + b"".join(lines)


def damaged(rng: random.Random, row: bytes, bad: tuple[bytes, bytes, bytes]) -> bytes:
    """The row as it is, or (about one time in eight) a broken row, one with bad UTF-8, one over 2 kB, or the third
    kind of bad row."""
    roll = rng.random()
    choices = ((0.05, bad[0]), (0.08, bad[1]), (0.1, json.dumps({"text": "x" * 3000}).encode()), (0.12, bad[2]))
    return next((choice for limit, choice in choices if roll < limit), row)


def csv_text(rng: random.Random, rows: int, delimiter: str) -> str:
    """A header, then rows some of which hold a line break inside a quoted field, and some with too many fields."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, delimiter=delimiter, lineterminator=rng.choice(["\n", "\r\n"]))
    writer.writerow(["text", "note"])
    for number in range(rows):
        text = f"row {number} " + " ".join(rng.choice("ghijk") for _ in range(25))
        if rng.random() < 0.1:
            text += "\nwith a second line, \"quoted\"\nand a third"
        writer.writerow([text, "n"] + (["extra"] if rng.random() < 0.05 else []))
    return buffer.getvalue()


def corpus(folder: Path) -> DataConfig:
    rng = random.Random(7)
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(jsonl_bytes(rng, 160))
    (folder / "b.csv").write_text(csv_text(rng, 120, ","), newline="")
    (folder / "c.tsv").write_text(csv_text(rng, 60, "\t"), newline="")
    (folder / "d.txt").write_bytes(b"".join(f"document {n} {'z ' * 40}".encode() + rng.choice([b"\n", b"\r\n", b"\n\n"])
                                            for n in range(120)))
    (folder / "e.json").write_text("\n".join(json.dumps({"text": f"not an array {n} " + "y " * 40})
                                             for n in range(60)))
    (folder / "f.json").write_text(json.dumps([{"text": f"an array {n}"} for n in range(20)]))
    parquet_file(folder / "g.parquet", rng, 200)
    return DataConfig(kind="text", max_record_bytes=2048, sources=[
        {"path": str(folder / name)} for name in ("a.jsonl", "b.csv", "c.tsv", "e.json", "f.json", "g.parquet")
    ] + [{"path": str(folder / "d.txt"), "format": "text"}])


def parquet_file(path: Path, rng: random.Random, rows: int) -> None:
    """Row groups of 20 rows, some rows without text or with a number for it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [None if rng.random() < 0.05 else f"parquet row {n} " + " ".join(rng.choice("lmnop") for _ in range(30))
             for n in range(rows)]
    pq.write_table(pa.table({"text": texts, "n": list(range(rows))}), path, row_group_size=20, compression="snappy")


def ingested(tmp_path: Path, name: str, data: DataConfig, engine: EngineConfig) -> tuple[dict, dict[str, bytes]]:
    folder = tmp_path / name
    folder.mkdir()
    stats = write_records(locate_all(data, tmp_path), data, record_kind(data), folder, tmp_path, engine)
    files = {"records": b"".join(path.read_bytes() for path in record_files(folder)),
             "rejected.jsonl": (folder / "rejected.jsonl").read_bytes()}
    assert sorted(path.name for path in folder.iterdir()) == ["records", "rejected.jsonl"]  # no scratch left
    return stats, files


def test_records_and_rejects_are_the_same_bytes_whatever_the_shards(tmp_path: Path) -> None:
    data = corpus(tmp_path / "data")
    whole_stats, whole = ingested(tmp_path, "whole", data, EngineConfig(workers=1))
    assert whole_stats["shards"] == 7  # one per file
    figures = ("rows_read", "rows_rejected", "rows_per_source", "reject_codes", "unread_sources")
    for number, shard_bytes in enumerate((1024, 1500, 4096)):
        stats, files = ingested(tmp_path, f"cut-{number}", data, EngineConfig(workers=1, shard_bytes=shard_bytes))
        assert files == whole
        assert {name: stats[name] for name in figures} == {name: whole_stats[name] for name in figures}
        assert stats["shards"] > 2 * whole_stats["shards"]  # every cuttable file was cut, its lines counted first
    records = [json.loads(line) for line in whole["records"].splitlines()]
    rejects = [json.loads(line) for line in whole["rejected.jsonl"].splitlines()]
    assert whole_stats["rows_read"] == len(records) + len(rejects) > 500
    assert {row["code"] for row in rejects} >= {"json_broken", "utf8_invalid", "too_large", "not_object",
                                                "fields_mismatch"}
    spanning = [row for row in records if row["_source"].endswith("b.csv") and "\nwith a second line" in row["text"]]
    assert spanning, "the corpus holds CSV fields over several lines"


def test_the_records_parts_are_the_same_files_whatever_the_workers(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The cut follows the input's size alone, and each shard's records become a part (small ones joined), so the
    parts are the same files for one worker or two; joined, they are the records of one read."""
    data = corpus(tmp_path / "data")
    _, whole = ingested(tmp_path, "whole", data, EngineConfig(workers=1))
    monkeypatch.setattr("llmops.config.engine.MIN_SHARD", 1024)  # the corpus is far below the real floor
    layouts = []
    for workers in (1, 2):
        folder = tmp_path / f"workers-{workers}"
        _, files = ingested(tmp_path, folder.name, data, EngineConfig(workers=workers))
        assert files == whole
        layouts.append({path.name: path.read_bytes() for path in record_files(folder)})
    assert layouts[0] == layouts[1] and len(layouts[0]) > 10


def test_large_files_become_parts_as_they_are_and_runs_of_small_ones_are_joined(tmp_path: Path) -> None:
    sizes = [0, 300, 2500, 100, 200, 0, 300, 700, 40]
    files = []
    for number, size in enumerate(sizes):
        files.append(tmp_path / f"s{number}")
        files[-1].write_bytes(bytes([65 + number]) * size)
    before = b"".join(path.read_bytes() for path in files)
    keep_as_parts(files, tmp_path / "parts", 1000)
    parts = kept_parts(tmp_path / "parts")
    # 300 alone is under half of 1000, then 2500 comes; 100+200+0+300 reach half; 700 stands alone; 40 is the rest
    assert [path.stat().st_size for path in parts] == [300, 2500, 600, 700, 40]
    assert b"".join(path.read_bytes() for path in parts) == before
    assert not any(path.exists() for path in files)


def test_a_damaged_parquet_row_group_quarantines_its_own_rows_and_the_rest_is_read(tmp_path: Path) -> None:
    """Row groups decode apart: a damaged one costs its rows, each a reject (the footer counts them), and the rows
    after it are read, with the same records and rejects whatever the shards."""
    folder = tmp_path / "data"
    folder.mkdir()
    parquet_file(folder / "good.parquet", random.Random(3), 300)
    damaged = folder / "damaged.parquet"
    parquet_file(damaged, random.Random(4), 300)
    import pyarrow.parquet as pq

    group = pq.ParquetFile(damaged).metadata.row_group(7).column(0)
    raw = bytearray(damaged.read_bytes())
    start = group.data_page_offset + 40
    raw[start:start + 200] = bytes(200)  # zeros over a compressed data page of row group 7 (rows 141-160)
    damaged.write_bytes(bytes(raw))
    data = DataConfig(kind="text", sources=[{"path": str(folder / "good.parquet")}, {"path": str(damaged)}])
    whole_stats, whole = ingested(tmp_path, "whole", data, EngineConfig(workers=1))
    rejects = [json.loads(line) for line in whole["rejected.jsonl"].splitlines()]
    broken = [row for row in rejects if row["code"] == "file_unreadable"]
    assert [row["line"] for row in broken] == list(range(141, 161))
    assert all(row["source"].endswith("damaged.parquet") and "row group 7 (rows 141-160)" in row["message"]
               for row in broken)
    records = [json.loads(line) for line in whole["records"].splitlines()]
    lines = {row["_line"] for row in records if row["_source"].endswith("damaged.parquet")}
    assert max(lines) == 300 and not lines & set(range(141, 161))  # the rows after the damage are read
    assert whole_stats["rows_read"] == 600 and whole_stats["unread_sources"] == []
    for number, shard_bytes in enumerate((1500, 6000)):
        stats, files = ingested(tmp_path, f"cut-{number}", data, EngineConfig(workers=1, shard_bytes=shard_bytes))
        assert files == whole
        assert stats["rows_read"] == 600 and stats["unread_sources"] == []
        assert stats["shards"] > 4


def test_a_parquet_text_that_is_not_utf8_quarantines_its_row_only(tmp_path: Path) -> None:
    """Parquet does not check that a string column holds UTF-8: the row that does not is rejected, naming its
    column, and every other row of its batch is kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {n} of words" for n in range(50)]
    texts[17] = "caf\xe9 broken"
    body = b"".join(text.encode("latin-1") for text in texts)
    ends = [0]
    for text in texts:
        ends.append(ends[-1] + len(text))
    offsets = pa.array(ends, pa.int32()).buffers()[1]
    column = pa.Array.from_buffers(pa.string(), len(texts), [None, offsets, pa.py_buffer(body)])
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"text": column, "n": list(range(50))}), path, row_group_size=20)
    data = DataConfig(kind="text", sources=[{"path": str(path)}])
    stats, files = ingested(tmp_path, "out", data, EngineConfig(workers=1))
    (reject,) = [json.loads(line) for line in files["rejected.jsonl"].splitlines()]
    assert (reject["line"], reject["code"], reject["field"]) == (18, "utf8_invalid", "text")
    assert reject["excerpt"] == "caf\ufffd broken"
    assert len(files["records"].splitlines()) == 49 and stats["rows_read"] == 50


def test_a_pool_of_two_writes_what_one_process_writes(tmp_path: Path) -> None:
    data = corpus(tmp_path / "data")
    _, alone = ingested(tmp_path, "alone", data, EngineConfig(workers=1, shard_bytes=2048))
    stats, pooled = ingested(tmp_path, "pooled", data, EngineConfig(workers=2, shard_bytes=2048))
    assert pooled == alone and stats["workers"] == 2


def test_lines_are_counted_as_the_readers_number_them(tmp_path: Path) -> None:
    rng = random.Random(1)
    path = tmp_path / "f"
    for _ in range(200):
        body = bytes(rng.choice(b"ab\r\n") for _ in range(rng.randrange(40)))
        path.write_bytes(rng.choice([b"", b"\xef\xbb\xbf"]) + body)
        with path.open("rb") as handle:
            lines = sum(1 for _ in split_lines(handle, 100))
        assert sum(count_lines(path, start, end) for start, end in byte_ranges(path, 5)) == lines


def test_results_come_back_in_job_order_and_a_shard_twice_or_never_is_an_error() -> None:
    progress = Progress("test", 3)
    finished = [(2, ("c", 10)), (0, ("a", 30)), (1, ("b", 20))]
    assert in_order(iter(finished), 3, progress, rows=len) == [("a", 30), ("b", 20), ("c", 10)]
    assert (progress.done, progress.rows) == (3, 3)
    with pytest.raises(RuntimeError, match="shard 0 came back twice"):
        in_order(iter([(0, ("a", 1)), (0, ("a", 1))]), 2, Progress("test", 2), rows=len)
    with pytest.raises(RuntimeError, match=r"shards \[1\] never came back"):
        in_order(iter([(0, ("a", 1))]), 2, Progress("test", 2), rows=len)


def test_the_automatic_shard_size_gives_every_worker_several_shards_within_its_bounds() -> None:
    from llmops.config.engine import MAX_SHARD, MIN_SHARD, MIN_SHARDS, SHARDS_PER_WORKER

    mib = 2**20
    two = EngineConfig(workers=2)
    assert two.shard_size(200 * mib) == -(-200 * mib // MIN_SHARDS)  # 100k documents: 16 shards, not 7 of 32 MiB
    assert two.shard_size(2000 * mib) == MAX_SHARD  # a large input: the cap bounds a worker's memory
    assert two.shard_size(3 * mib) == two.shard_size(0) == MIN_SHARD  # a small one: not cut below a shard's cost
    many = EngineConfig(workers=32)
    assert -(-1000 * mib // many.shard_size(1000 * mib)) >= SHARDS_PER_WORKER * 32  # several shards a worker
    assert EngineConfig(workers=2, shard_bytes=4096).shard_size(2000 * mib) == 4096  # a configured size is kept
    # an input that does not pay for a worker's start is one shard, worked in this process (tokenize's 8 MiB)
    assert two.shard_size(10 * mib, worth_a_worker=8 * mib) == 10 * mib
    assert two.shard_size(20 * mib, worth_a_worker=8 * mib) == two.shard_size(20 * mib) < 20 * mib
    assert EngineConfig(workers=2, shard_bytes=4096).shard_size(mib, worth_a_worker=8 * mib) == 4096


def test_more_workers_than_cpus_start_one_process_a_cpu_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    """A thousand workers on a laptop would be a thousand processes, each holding its libraries and a shard."""
    asked = EngineConfig(workers=usable_cpus() + 998)
    with caplog.at_level("WARNING", logger="llmops.engine"), Engine(asked) as engine:
        assert engine.workers == usable_cpus()
        assert engine.map("square", abs, [-1, -2, -3]) == [1, 2, 3]
    assert f"engine.workers {usable_cpus() + 998}: this machine has {usable_cpus()} usable CPUs" in caplog.text
    # the shards are still cut for the workers asked for (a Ray cluster's, say)
    assert asked.shard_size(1000 * 2**20) < EngineConfig(workers=usable_cpus()).shard_size(1000 * 2**20)


def json_array_bytes(rng: random.Random, rows: int, indent: int | None, line_end: bytes) -> bytes:
    """A JSON array a cut must respect: strings holding brackets, braces, escaped quotes and backslashes, nested
    objects and arrays, elements that are no object, bad UTF-8, an element over the size limit; a byte-order mark."""
    elements: list[bytes] = []
    for number in range(rows):
        words = " ".join(rng.choice(["[a]", "{b}", 'c "d"', "e\\f", "g\nh", "ĳ", "k,l", "m"]) for _ in range(20))
        element = json.dumps({"text": f"row {number} {words}", "meta": {"tags": [[1, {"x": "]}"}], []]}},
                             indent=indent, ensure_ascii=rng.random() < 0.5).encode()
        element = damaged(rng, element, (json.dumps(["a", {"b": 1}]).encode(), b'{"text": "bad \xff utf-8 {["}', b"7"))
        elements.append(element.replace(b"\n", line_end))
    body = (b"," + line_end + b"  ").join(elements)
    return b"\xef\xbb\xbf" + line_end + b"[" + line_end + b"  " + body + line_end + b"]" + line_end


def test_a_json_array_is_cut_at_its_objects_and_reads_as_in_one_read(tmp_path: Path) -> None:
    """Compact, indented, CRLF and lone-CR arrays: the same records, rejects, line numbers and figures whatever the
    shard size, every later shard starting at one of the array's own objects."""
    rng = random.Random(11)
    folder = tmp_path / "data"
    folder.mkdir()
    shapes = {"compact.json": (None, b""), "indented.json": (2, b"\n"), "crlf.json": (1, b"\r\n"),
              "cr.json": (1, b"\r")}
    for name, (indent, line_end) in shapes.items():
        (folder / name).write_bytes(json_array_bytes(rng, 90, indent, line_end))
    data = DataConfig(kind="text", max_record_bytes=2048, sources=[{"path": str(folder / name)} for name in shapes])
    whole_stats, whole = ingested(tmp_path, "whole", data, EngineConfig(workers=1))
    assert whole_stats["shards"] == len(shapes)
    for number, shard_bytes in enumerate((1024, 3000)):
        stats, files = ingested(tmp_path, f"cut-{number}", data, EngineConfig(workers=1, shard_bytes=shard_bytes))
        assert files == whole
        assert stats["rows_read"] == whole_stats["rows_read"] == 4 * 90 and stats["shards"] > 4 * len(shapes)
        for name in shapes:
            raw = (folder / name).read_bytes()
            ranges = array_ranges(folder / name, shard_bytes, 2048)
            assert ranges[0][0] == 0 and ranges[-1][1] == len(raw) and len(ranges) > 4
            assert all(raw[start:start + 1] == b"{" and start == end for (start, _), (_, end) in
                       zip(ranges[1:], ranges, strict=False))
    records = [json.loads(line) for line in whole["records"].splitlines()]
    lines = {(row["_source"].rsplit("/", 1)[-1], row["_line"]) for row in records}
    assert {line for name, line in lines if name == "compact.json"} == {1}  # all on the file's one line
    assert len({line for name, line in lines if name == "indented.json"}) > 50  # each object on a line of its own
    rejects = [json.loads(line) for line in whole["rejected.jsonl"].splitlines()]
    assert {row["code"] for row in rejects} >= {"utf8_invalid", "too_large", "not_object"}


@pytest.mark.parametrize("damage", ["broken", "unclosed", "unbalanced"])
def test_a_json_array_that_breaks_partway_reads_as_in_one_read(tmp_path: Path, damage: str) -> None:
    """An invalid element in the middle stops the file where one read stops (its shards are read again as one); a
    file cut short or whose nesting does not add up is not cut at all. The rows and rejects are the same."""
    rows = [{"text": f"row {n} " + "w " * 30} for n in range(60)]
    raw = json.dumps(rows, indent=1)
    raw = {"broken": raw.replace('"text": "row 31 ', '"text": tru, "t": "row 31 ', 1), "unclosed": raw[:-40],
           "unbalanced": raw.replace('"row 31 ', '"row 31 ": [{', 1)}[damage]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.json").write_text(raw)
    data = DataConfig(kind="text", sources=[{"path": str(folder / "a.json")}])
    whole_stats, whole = ingested(tmp_path, "whole", data, EngineConfig(workers=1))
    assert whole_stats["unread_sources"] and whole_stats["rows_rejected"] == 1 and whole_stats["rows_read"] <= 60
    for number, shard_bytes in enumerate((1024, 2000)):
        stats, files = ingested(tmp_path, f"cut-{number}", data, EngineConfig(workers=1, shard_bytes=shard_bytes))
        assert files == whole and stats["unread_sources"] == whole_stats["unread_sources"]
        assert (stats["shards"] > 2) == (damage == "broken")  # cut, then read again whole; or never cut
    assert (array_ranges(folder / "a.json", 300, 1 << 20) == []) == (damage != "broken")


ROW_31 = '},\n {\n  "text": "row 31 '
COMMA_FAULTS = {
    "no comma between two elements": lambda raw: raw.replace(ROW_31, ROW_31.replace(",", "")),
    "2 commas between two elements": lambda raw: raw.replace(ROW_31, ROW_31.replace(",", ",,")),
    "a comma before the closing bracket": lambda raw: raw.replace("}\n]", "},\n]"),
    "a comma before the array's first element": lambda raw: raw.replace("[\n {", "[,\n {", 1),
}


@pytest.mark.parametrize("problem", COMMA_FAULTS)
def test_a_comma_missing_or_too_many_stops_the_file_where_one_read_stops(tmp_path: Path, problem: str) -> None:
    """JSON puts one comma between two elements and none elsewhere: any other is not JSON, and stops the file at the
    element after it (the one-line reject names it), read whole or cut, a cut then falling at every element."""
    rows = [{"text": f"row {n} " + "w " * 600} for n in range(60)]
    raw = json.dumps(rows, indent=1)
    damaged = COMMA_FAULTS[problem](raw)
    assert damaged != raw
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.json").write_text(damaged)
    data = DataConfig(kind="text", sources=[{"path": str(folder / "a.json")}])
    whole_stats, whole = ingested(tmp_path, "whole", data, EngineConfig(workers=1))
    (reject,) = [json.loads(line) for line in whole["rejected.jsonl"].splitlines()]
    assert reject["code"] == "json_broken" and reject["message"] == f"not valid JSON: {problem}; the rest of the " \
        "file was not read"
    kept = {"no comma": 31, "2 commas": 31, "a comma before the closing": 60, "a comma before the array's": 0}
    expected = next(count for start, count in kept.items() if problem.startswith(start))
    assert whole_stats["rows_read"] == expected + 1 and whole_stats["unread_sources"]
    # the line of what follows the separators: the element after them, or the closing bracket
    assert reject["line"] == {31: 2 + 3 * 31, 60: 2 + 3 * 60, 0: 2}[expected]
    stats, files = ingested(tmp_path, "cut", data, EngineConfig(workers=1, shard_bytes=1024))
    assert files == whole and stats["rows_read"] == whole_stats["rows_read"] and stats["shards"] > 30


def test_the_array_scan_follows_strings_across_its_reading_blocks(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks far smaller than a string: a bracket, brace or escaped quote inside one never moves the nesting, and a
    string longer than the record limit leaves the file uncut."""
    monkeypatch.setattr("llmops.io.shards.BLOCK", 16)
    rows = [{"text": '"]}{[\\' * n, "n": [n, {"m": "x"}]} for n in range(40)]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(rows))
    ranges = array_ranges(path, 100, 1024)
    raw = path.read_bytes()
    assert len(ranges) > 10
    pieces = [raw[start:end].decode().strip().strip("[]").strip().rstrip(",") for start, end in ranges]
    assert [row for piece in pieces for row in json.loads(f"[{piece}]")] == rows
    assert array_ranges(path, 100, 64) == []  # the longest string is over 64 bytes


def field_file(path: Path, rows: int, line_end: str) -> None:
    """One JSON object whose `data` holds the records, one a line from line 5, between keys that hold arrays too
    (one of them under a nested `data`)."""
    head = ['{', ' "version": "1.1",', ' "meta": {"data": [{"text": "not a record"}], "tags": ["[", "{"]},',
            ' "data": [']
    body = [f'  {{"text": "row {n} {"w " * 20}"}}' + ("," if n < rows - 1 else "") for n in range(rows)]
    path.write_bytes(line_end.join([*head, *body, ' ],', ' "after": [{"text": "not a record"}]', '}', '']).encode())


@pytest.mark.parametrize("line_end", ["\n", "\r\n"])
def test_a_json_objects_field_is_read_as_its_array_with_the_files_line_numbers(tmp_path: Path, line_end: str) -> None:
    """Only the array under the top-level key is read, each record with its line in the file; cut or whole, the same
    bytes."""
    folder = tmp_path / "data"
    folder.mkdir()
    field_file(folder / "a.json", 80, line_end)
    data = DataConfig(kind="text", sources=[{"path": str(folder / "a.json"), "field": "data"}])
    whole_stats, whole = ingested(tmp_path, "whole", data, EngineConfig(workers=1))
    records = [json.loads(line) for line in whole["records"].splitlines()]
    assert [(row["text"].split()[1], row["_line"]) for row in records] == [(str(n), 5 + n) for n in range(80)]
    assert whole["rejected.jsonl"] == b""
    stats, files = ingested(tmp_path, "cut", data, EngineConfig(workers=1, shard_bytes=1024))
    assert files == whole and stats["shards"] > whole_stats["shards"] + 4
    raw = (folder / "a.json").read_bytes()
    (folder / "a.json").write_bytes(raw.replace(b'"text": "row 40 ', b'"text": tru, "t": "row 40 '))
    _, broken = ingested(tmp_path, "broken-whole", data, EngineConfig(workers=1))
    _, broken_cut = ingested(tmp_path, "broken-cut", data, EngineConfig(workers=1, shard_bytes=1024))
    assert broken_cut == broken and len(broken["records"].splitlines()) == 40
    assert json.loads(broken["rejected.jsonl"])["line"] == 45


@pytest.mark.parametrize(("content", "field"), [
    ('[{"text": "an array, no object"}]', "data"),
    ('{"data": {"text": "an object, no array"}}', "data"),
    ('{"meta": {"data": [{"text": "nested only"}]}, "rows": [{"text": "x"}]}', "data"),
    ('{"data": [{"text": "x"}]}', "rows"),
])
def test_a_field_that_names_no_top_level_array_is_one_clear_error(tmp_path: Path, content: str, field: str) -> None:
    from llmops.data.readers import DataSourceError

    (tmp_path / "a.json").write_text(content)
    data = DataConfig(kind="text", sources=[{"path": str(tmp_path / "a.json"), "field": field}])
    with pytest.raises(DataSourceError, match=rf"a.json: the source's field '{field}' names no array at the top"):
        ingested(tmp_path, "out", data, EngineConfig(workers=1))


def test_a_field_is_only_for_a_json_file() -> None:
    from pydantic import ValidationError

    assert DataConfig(path="a.json", field="data").sources[0].field == "data"  # the one source's, at the top

    with pytest.raises(ValidationError, match="field is the key of a JSON file's array"):
        DataConfig(sources=[{"name": "some/dataset", "field": "data"}])
    with pytest.raises(ValidationError, match="field is the key of a JSON file's array"):
        DataConfig(sources=[{"path": "a.csv", "format": "csv", "field": "data"}])


tricky_text = st.text(alphabet=st.sampled_from(list('ab "\\[]{},:\n\r\té✓') + ["\ud800"]), max_size=60)
elements = st.one_of(
    st.builds(lambda text, tags: json.dumps({"text": text, "tags": tags}, ensure_ascii=False),
              tricky_text, st.lists(st.one_of(tricky_text, st.integers()), max_size=3)),
    st.sampled_from(['{"text": tru}', '[1, {"a": "]"}]', "12345", '"a string"', '{"text": "x"',
                     '{"text": "x", "m": {"a": "]", "a": 1}}']),
)


@st.composite
def json_array_files(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """An array of elements (some broken or no object), maybe under a key of an object, maybe damaged."""
    # a comma too many or too few is not JSON either
    separator = draw(st.sampled_from([", ", ",\n  ", ",\r\n", ",", " ,\r", " ", ",,", "\n"]))
    body = "[" + separator.join(draw(st.lists(elements, min_size=5, max_size=60))) + "]"
    field = draw(st.sampled_from([None, "data"]))
    if field:
        body = '{"meta": {"data": [1]}, "data":\n' + body + ',\n"after": [{"text": "no"}]}'
    data = draw(st.sampled_from([b"", b"\xef\xbb\xbf"])) + body.encode("utf-8", "surrogatepass")
    damage = draw(st.integers(0, 4))
    at = draw(st.integers(1, len(data)))
    if damage == 1:
        data = data[:at]
    elif damage == 2:
        data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
    return data, field


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=json_array_files())
def test_any_json_array_reads_the_same_cut_or_whole(tmp_path_factory: pytest.TempPathFactory,
                                                    case: tuple[bytes, str | None]) -> None:
    """Whatever the bytes: the records, rejects and figures of a JSON array (or a field's) cut into 1 KiB shards are
    those of one read of the file, or both reads fail with the same one-line error."""
    from llmops.data.readers import DataSourceError

    data, field = case
    root = tmp_path_factory.mktemp("array")
    (root / "data").mkdir()
    (root / "data" / "a.json").write_bytes(data)
    config = DataConfig(kind="text", max_record_bytes=600,
                        sources=[{"path": str(root / "data" / "a.json"), **({"field": field} if field else {})}])
    outcomes = []
    for name, engine in (("whole", EngineConfig(workers=1)), ("cut", EngineConfig(workers=1, shard_bytes=1024))):
        try:
            stats, files = ingested(root, name, config, engine)
            outcomes.append((files, {key: stats[key] for key in ("rows_read", "rows_rejected", "unread_sources")}))
        except DataSourceError as err:
            outcomes.append((str(err), None))
    assert outcomes[0] == outcomes[1]


def compressed_copy(path: Path, suffix: str) -> Path:
    """The file compressed as its suffix says, beside it."""
    import bz2
    import gzip
    import lzma

    import pyarrow as pa

    target = path.with_name(path.name + suffix)
    raw = path.read_bytes()
    if suffix == ".zst":
        with pa.CompressedOutputStream(str(target), "zstd") as out:
            out.write(raw)
    else:
        target.write_bytes({".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[suffix](raw))
    return target


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_files_read_as_the_files_they_hold(tmp_path: Path, suffix: str) -> None:
    """JSONL, CSV, a JSON array, text lines and a text file, each compressed, found in a folder by their inner
    suffix: the same records and rejects, line for line, as the files uncompressed."""
    rng = random.Random(5)
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    (plain / "a.jsonl").write_bytes(jsonl_bytes(rng, 80))
    (plain / "b.csv").write_text(csv_text(rng, 40, ","), newline="")
    (plain / "c.json").write_bytes(json_array_bytes(rng, 30, 1, b"\n"))
    (plain / "d.txt").write_text("".join(f"line {n} {'q ' * 10}\n" for n in range(25)))
    for name in ("a.jsonl", "b.csv", "c.json", "d.txt"):
        compressed_copy(plain / name, suffix).rename(packed / (name + suffix))
    runs = {}
    for folder in (plain, packed):
        data = DataConfig(kind="text", max_record_bytes=2048, sources=[{"path": str(folder)}])
        stats, files = ingested(tmp_path, f"out-{folder.name}", data, EngineConfig(workers=1, shard_bytes=1024))
        runs[folder.name] = (stats["rows_read"], stats["rows_rejected"],
                             *(files[name].replace(suffix.encode() + b'"', b'"').replace(b"packed/", b"plain/")
                               for name in ("records", "rejected.jsonl")))
    assert runs["packed"] == runs["plain"] and runs["plain"][0] > 150
    text_file = DataConfig(kind="text", sources=[{"path": str(packed / ("d.txt" + suffix)), "format": "text-files"}])
    _, files = ingested(tmp_path, "text-file", text_file, EngineConfig(workers=1))
    assert json.loads(files["records"])["text"] == (plain / "d.txt").read_text()


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_streams_one_after_another_are_all_read_and_bytes_after_them_that_are_none_stop_the_file(
        tmp_path: Path, suffix: str) -> None:
    """Concatenated streams (as `cat a.gz b.gz` makes) are one file of all their rows. Bytes after a stream that
    start no other (a damaged second stream, rows appended uncompressed) are an unreadable rest of the file, which
    stops the run: the standard library's bz2 and xz readers dropped them without a word."""
    halves = []
    for half in range(2):
        plain = tmp_path / f"half-{half}.jsonl"
        plain.write_text("".join(json.dumps({"text": f"half {half} row {n} " + "w " * 20}) + "\n" for n in range(400)))
        halves.append(compressed_copy(plain, suffix).read_bytes())
    (tmp_path / f"both.jsonl{suffix}").write_bytes(halves[0] + halves[1])
    (tmp_path / f"tail.jsonl{suffix}").write_bytes(halves[0] + b'{"text": "appended, not compressed"}\n')
    data = DataConfig(kind="text", sources=[{"path": str(tmp_path / f"both.jsonl{suffix}")}])
    stats, files = ingested(tmp_path, "both", data, EngineConfig(workers=1))
    assert stats["rows_read"] == 800 and not stats["unread_sources"]
    assert [json.loads(line)["text"].split(" w ")[0] for line in files["records"].splitlines()][399:401] == [
        "half 0 row 399", "half 1 row 0"]
    data = DataConfig(kind="text", sources=[{"path": str(tmp_path / f"tail.jsonl{suffix}")}])
    stats, files = ingested(tmp_path, "tail", data, EngineConfig(workers=1))
    (reject,) = [json.loads(line) for line in files["rejected.jsonl"].splitlines()]
    assert reject["code"] == "file_unreadable" and "cannot decompress the file from here" in reject["message"]
    assert stats["unread_sources"] == [f"tail.jsonl{suffix}"]


def test_a_damaged_compressed_file_keeps_its_rows_so_far_and_quarantines_the_rest_in_one_line(tmp_path: Path) -> None:
    import gzip

    rng = random.Random(2)
    rows = "".join(json.dumps({"text": f"row {n} " + " ".join(rng.choice("abcdefgh") * 3 for _ in range(30))}) + "\n"
                   for n in range(25_000))
    packed = gzip.compress(rows.encode())  # about 3 MB of rows: a damage halfway comes after the first block read
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    (tmp_path / "garbage.jsonl.gz").write_bytes(b"\x1f\x8b not gzip at all")
    data = DataConfig(kind="text", sources=[{"path": str(tmp_path / "cut.jsonl.gz")},
                                            {"path": str(tmp_path / "garbage.jsonl.gz")}])
    stats, files = ingested(tmp_path, "out", data, EngineConfig(workers=1))
    rejects = [json.loads(line) for line in files["rejected.jsonl"].splitlines()]
    assert [(row["source"], row["code"]) for row in rejects] == [("cut.jsonl.gz", "file_unreadable"),
                                                               ("garbage.jsonl.gz", "file_unreadable")]
    assert all("cannot decompress the file from here" in row["message"] for row in rejects)
    kept = len(files["records"].splitlines())
    assert 0 < kept < 25_000 and rejects[0]["line"] == kept + 1
    assert sorted(stats["unread_sources"]) == ["cut.jsonl.gz", "garbage.jsonl.gz"]


def test_a_compressed_parquet_file_or_field_is_one_clear_error(tmp_path: Path) -> None:
    from llmops.data.readers import DataSourceError

    (tmp_path / "a.json").write_text(json.dumps({"data": [{"text": "x"}]}))
    packed = compressed_copy(tmp_path / "a.json", ".gz")
    data = DataConfig(kind="text", sources=[{"path": str(packed), "field": "data"}])
    with pytest.raises(DataSourceError, match="a.json.gz: a field is read from a JSON file as it is on disk"):
        ingested(tmp_path, "out", data, EngineConfig(workers=1))


def test_a_fields_array_is_found_past_strings_far_longer_than_a_block_or_a_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Strings before the key, with escaped quotes, backslashes and brackets, over many reading blocks and over the
    record limit, are followed to their end; a key written with \\u escapes is the key."""
    monkeypatch.setattr("llmops.io.shards.BLOCK", 16)
    blob = 'x\\"]}{[:\\\\' * 700
    path = tmp_path / "a.json"
    path.write_text('{"blob": "' + blob + '", "d\\u0061ta": [{"text": "a"}, {"text": "b"}], "tail": "' + blob + '"}')
    start = field_array(path, "data")
    assert start is not None and path.read_bytes()[start - 1:start + 14] == b'[{"text": "a"},'
    monkeypatch.undo()
    data = DataConfig(kind="text", max_record_bytes=1024, sources=[{"path": str(path), "field": "data"}])
    _, files = ingested(tmp_path, "out", data, EngineConfig(workers=1))
    assert [json.loads(line)["text"] for line in files["records"].splitlines()] == ["a", "b"]
