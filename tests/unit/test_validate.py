import json
from pathlib import Path

import pytest

from llmops.config.engine import EngineConfig
from llmops.config.schema import DataConfig, PipelineConfig, ValidateConfig
from llmops.data.ingest import record_files
from llmops.data.validate import DataQualityError, check_bad_fraction, record_shards
from llmops.io.files import read_jsonl
from llmops.io.tables import table_rows
from llmops.pipeline.runner import run_stage
from tests.helpers import project_at, stage

GOOD = {"instruction": "Write this number in words.", "input": "7", "output": "seven"}


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(autouse=True)
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path as the project the stages run in: the source names are relative to it."""
    return project_at(tmp_path, monkeypatch)


def run_validate(path: Path, **config: object):
    """The validate record of one source (without the stage's gate: the tests apply check_bad_fraction)."""
    pipeline = PipelineConfig(data=DataConfig(path=str(path)), validate=ValidateConfig(**config))
    return stage("validate", pipeline, stage("ingest", pipeline))


def test_each_bad_row_is_quarantined_with_its_line_code_and_message(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [
        GOOD,                                              # 1 good
        {**GOOD, "output": "   "},                         # 2 whitespace only
        {"instruction": "no output"},                      # 3 missing field
        {**GOOD, "output": 7},                             # 4 wrong type
        {**GOOD, "input": "a\u0000b"},                     # 5 NUL byte
        "{not json",                                       # 6 broken JSON
        {**GOOD, "output": "x" * 50},                      # 7 too long
        {**GOOD, "input": None},                           # 8 good: input is optional
        {**GOOD, "output": "a\u001bb"},                    # 9 a control character
        {**GOOD, "output": "tab\tand\nnewline"},            # 10 good: tab and newline are text
        {**GOOD, "output": "\u200b\u00ad \ufeff\u200d"},    # 11 only invisible characters
        {**GOOD, "output": "\u200bseven"},                  # 12 good: a zero-width space before text
    ])
    record = run_validate(path, max_chars=40, max_bad_fraction=1.0)
    quarantine = {row["line"]: row for row in read_jsonl(record.dir / "quarantine.jsonl")}
    assert {line: (row["code"], row["field"]) for line, row in quarantine.items()} == {
        2: ("empty", "output"), 3: ("missing_field", "output"), 4: ("wrong_type", "output"),
        5: ("nul_byte", "input"), 6: ("json_broken", None), 7: ("too_long", "output"), 9: ("control_char", "output"),
        11: ("empty", "output")}
    assert quarantine[2]["message"] == "output: empty or only whitespace"
    assert quarantine[3]["message"] == "output: missing"
    assert quarantine[4]["message"] == "output: a number where text is expected"
    assert quarantine[5]["message"] == "input: a NUL character at position 1"
    assert quarantine[6]["message"].startswith("not valid JSON: ")
    assert quarantine[7]["message"] == "output: 50 characters, over validate.max_chars (40)"
    assert quarantine[9]["message"] == "output: a control character (U+001B at position 1)"
    assert all(row["source"] == "d.jsonl" and row["excerpt"] for row in quarantine.values())
    assert all(list(row) == ["source", "line", "code", "field", "message", "excerpt"] for row in quarantine.values())
    kept = list(table_rows(record.dir / "valid"))
    assert [row["_line"] for row in kept] == [1, 8, 10, 12]
    stats = record.figures
    assert stats.rows_read == stats.rows_kept + stats.rows_quarantined == 12
    assert sum(stats.codes.values()) == stats.rows_quarantined
    assert stats.loggable()["codes.control_char"] == 1.0


def test_too_many_bad_rows_stop_the_run_with_counts_codes_and_path(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [GOOD, {**GOOD, "output": ""}, {**GOOD, "output": ""}, "{"])
    record = run_validate(path)
    with pytest.raises(DataQualityError) as err:
        check_bad_fraction(limit(0.25), record)
    message = str(err.value)
    assert "3 of 4 rows failed validation (75.0% > validate.max_bad_fraction 25.0%)" in message
    assert "main reasons: empty (2), json_broken (1);" in message
    assert str(record.dir / "quarantine.jsonl") in message
    check_bad_fraction(limit(0.75), record)  # at the limit: the run goes on
    # the runner applies the stage's gate, as the flow does
    pipeline = limit_config(path, 0.25)
    with pytest.raises(DataQualityError, match=r"3 of 4 rows failed validation"):
        run_stage("validate", pipeline, [stage("ingest", pipeline)])
    assert run_stage("validate", limit_config(path, 0.75), [stage("ingest", pipeline)]).reused


def limit(fraction: float) -> PipelineConfig:
    return PipelineConfig(validate=ValidateConfig(max_bad_fraction=fraction))


def limit_config(path: Path, fraction: float) -> PipelineConfig:
    return PipelineConfig(data=DataConfig(path=str(path)), validate=ValidateConfig(max_bad_fraction=fraction))


def test_validation_is_chunked_and_reused(tmp_path: Path) -> None:
    rows = [GOOD if i % 10 else {**GOOD, "output": ""} for i in range(95)]
    path = write_lines(tmp_path / "d.jsonl", rows)
    record = run_validate(path, chunk_rows=20, max_bad_fraction=1.0)
    bad_lines = sorted(row["line"] for row in read_jsonl(record.dir / "quarantine.jsonl"))
    assert bad_lines == [i + 1 for i in range(0, 95, 10)]
    assert run_validate(path, chunk_rows=20, max_bad_fraction=1.0).reused


def test_kept_rows_read_back_as_ingest_wrote_them_and_a_kind_that_changes_rows_writes_its_change(
        tmp_path: Path) -> None:
    # a kept row reads back from the table as ingest wrote it, whatever it holds
    rows = [{**GOOD, "output": "naïve 😀 \"quoted\" \\ back\tslash"}, {**GOOD, "extra": {"score": 0.1, "n": 10**20}},
            {**GOOD, "extra": [1.5e-300, -0.0, None, True]}]
    record = run_validate(write_lines(tmp_path / "d.jsonl", rows))
    (ingested,) = record_files(next(p for p in (record.dir.parent.parent / "ingest").iterdir() if p.is_dir()))
    kept = list(table_rows(record.dir / "valid"))
    assert [json.dumps(row, ensure_ascii=False) for row in kept] == ingested.read_text(encoding="utf-8").splitlines()
    # token classification writes integer tags as their names
    tagged = write_lines(tmp_path / "t.jsonl", [{"tokens": ["Ada", "wrote"], "tags": [1, 0]}])
    pipeline = PipelineConfig(data=DataConfig(path=str(tagged), kind="tokens", labels=["O", "B-PER"]))
    kept = list(table_rows(stage("validate", pipeline, stage("ingest", pipeline)).dir / "valid"))
    assert [row["tags"] for row in kept] == [["B-PER", "O"]]


def test_validating_leaves_the_libraries_batch_fingerprint_setting_as_it_found_it(tmp_path: Path) -> None:
    """Skipping great-expectations' batch fingerprints is for validate's own chunks only: a notebook's other pandas
    validations in the same process keep theirs, also after a chunk fails to validate."""
    from great_expectations.execution_engine import pandas_execution_engine

    from llmops.data.validate import without_batch_fingerprints

    before = pandas_execution_engine.HASH_THRESHOLD
    assert before > 0
    record = run_validate(write_lines(tmp_path / "d.jsonl", [GOOD, {**GOOD, "output": " "}]), chunk_rows=1)
    assert record.figures.rows_kept == 1 and record.figures.rows_quarantined == 1
    assert before == pandas_execution_engine.HASH_THRESHOLD
    with pytest.raises(RuntimeError), without_batch_fingerprints():
        assert pandas_execution_engine.HASH_THRESHOLD == 0
        raise RuntimeError("a chunk that could not be validated")
    assert before == pandas_execution_engine.HASH_THRESHOLD


def test_ingests_parts_are_validated_in_shards_of_about_the_shard_size(tmp_path: Path) -> None:
    """Small parts are taken together and a part of twice the shard size or more is cut into equal ones, every line
    in exactly one shard, in order."""
    files = []
    for number, lines in enumerate((3, 2, 40, 1, 9)):
        files.append(tmp_path / f"part-{number}.jsonl")
        files[-1].write_text("".join(json.dumps({"n": number, "i": i, "pad": "x" * 80}) + "\n" for i in range(lines)))
    shards = record_shards(files, EngineConfig(shard_bytes=1024))
    # lines of about 108 bytes: 40 of them (4.4 kB) are four pieces of 10 or 11
    assert [[(path.name, path.read_bytes()[start:end].count(b"\n")) for path, start, end in shard]
            for shard in shards] == [
        [("part-0.jsonl", 3), ("part-1.jsonl", 2), ("part-2.jsonl", 11)], [("part-2.jsonl", 10)],
        [("part-2.jsonl", 10)], [("part-2.jsonl", 9), ("part-3.jsonl", 1)], [("part-4.jsonl", 9)]]
    assert all(sum(end - start for _, start, end in shard) >= 1024 for shard in shards[:-1])


def test_no_row_left_to_train_on_stops_the_run_at_validation_naming_why(tmp_path: Path) -> None:
    """An empty file, or one whose every row fails, passed validation (max_bad_fraction 1.0 allows it) and stopped
    later at dedup's empty split, far from the cause."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    config = PipelineConfig(data=DataConfig(path=str(empty)), validate=ValidateConfig(max_bad_fraction=1.0))
    with pytest.raises(DataQualityError, match=r"^nothing to train on: the data holds no rows \(sources: "
                                               rf"{empty}\); quarantine: "):
        check_bad_fraction(config, run_validate(empty, max_bad_fraction=1.0))
    failing = write_lines(tmp_path / "d.jsonl", [{**GOOD, "output": ""}, {**GOOD, "output": " "}])
    config = PipelineConfig(data=DataConfig(path=str(failing)), validate=ValidateConfig(max_bad_fraction=1.0))
    with pytest.raises(DataQualityError, match=r"^nothing to train on: all 2 rows failed validation; main reasons: "
                                               r"empty \(2\); quarantine: "):
        check_bad_fraction(config, run_validate(failing, max_bad_fraction=1.0))
