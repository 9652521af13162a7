"""One file holding every malformed case: each lands in the quarantine, the good rows all reach training."""

import json
from pathlib import Path

from datasets import load_from_disk

from llmops.io.files import read_jsonl
from llmops.io.tables import table_rows
from llmops.objectives import load_config
from tests.helpers import stage

REPO = Path(__file__).resolve().parents[2]


def good(i: int) -> bytes:
    return json.dumps({"instruction": "Write this number in words.", "input": str(i),
                       "output": f"number {i}"}).encode()


def test_every_malformed_case_is_quarantined_and_the_rest_trains(tmp_path: Path) -> None:
    lines = [
        b"\xef\xbb\xbf" + good(1) + b"\r\n",                                       # 1 byte-order mark, CRLF
        good(2) + b"\r\n",                                                          # 2 CRLF
        b'{"instruction": "broken", "output": \r\n',                                # 3 broken JSON
        b'{"instruction": "caf\xe9", "output": "x"}\n',                             # 4 invalid UTF-8
        b'{"instruction": "nul", "output": "a\\u0000b"}\n',                         # 5 NUL byte
        b'{"instruction": "big", "output": "' + b"a" * (50 << 20) + b'"}\n',       # 6 a single 50 MB line
        b'{"instruction": "mixed", "output": 42}\n',                                # 7 a column of mixed types
        b"\n",                                                                      # (blank: not a row)
        b'{"instruction": "lone", "output": "\\ud83d"}\n',                          # 9 invalid UTF-8 escape
        *[good(i) + b"\n" for i in range(10, 70)],                                 # 10..69 good rows
    ]
    data_file = tmp_path / "messy.jsonl"
    data_file.write_bytes(b"".join(lines))
    empty_file = tmp_path / "empty.jsonl"
    empty_file.write_bytes(b"")
    config = load_config(REPO / "configs" / "tiny_sft_cpu.yaml", ["validate.max_bad_fraction=0.2"])
    config = config.model_copy(update={"data": config.data.model_copy(update={"sources": [
        config.data.sources[0].model_copy(update={"path": str(data_file)}),
        config.data.sources[0].model_copy(update={"path": str(empty_file)}),
    ]})})

    ingested = stage("ingest", config)
    validated = stage("validate", config, ingested)
    quarantine = {row["line"]: row for row in read_jsonl(validated.dir / "quarantine.jsonl")}
    codes = {line: row["code"] for line, row in quarantine.items()}
    assert codes == {3: "json_broken", 4: "utf8_invalid", 5: "nul_byte", 6: "too_large", 7: "wrong_type",
                     9: "utf8_invalid"}
    messages = {line: row["message"] for line, row in quarantine.items()}
    assert messages[4] == "invalid UTF-8 at byte 20"
    assert messages[5] == "output: a NUL character at position 1"
    assert messages[6].startswith("record is 52,428,8") and "over data.max_record_bytes (1,000,000)" in messages[6]
    assert messages[7] == "output: a number where text is expected"
    # a source outside the project is named by its full path (one inside it, relative to the project)
    assert all(row["source"] == str(data_file) and len(row["excerpt"]) <= 200 for row in quarantine.values())
    assert ingested.figures.rows_per_source == {str(data_file): 68}  # the empty file adds no rows

    deduped = stage("dedup", config, validated)
    stats = deduped.figures
    read = ingested.figures.rows_read
    assert read == validated.figures.rows_kept + validated.figures.rows_quarantined
    assert read == stats.rows_out + validated.figures.rows_quarantined + stats.duplicates + \
        stats.near_duplicates + stats.contaminated
    kept_lines = {r["_line"] for split in ("train", "eval") for r in table_rows(deduped.dir / split)}
    assert kept_lines == {1, 2, *range(10, 70)}

    tokenized = stage("tokenize", config, deduped)
    trained_on = len(load_from_disk(str(tokenized.dir / "train"))) + len(load_from_disk(str(tokenized.dir / "eval")))
    assert trained_on == len(kept_lines)
