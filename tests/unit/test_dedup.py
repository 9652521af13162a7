import json
from pathlib import Path

import pytest

from flows.config import DataConfig, DedupConfig, ValidateConfig
from tasks.dedup import EmptySplitError, dedup, in_eval, normalize
from tasks.ingest import ingest
from tasks.validate import validate
from tasks.workspace import read_jsonl


def deduped(rows: list[dict], root: Path, casefold: bool = False, eval_fraction: float = 0.2):
    path = root / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(path=str(path), eval_fraction=eval_fraction)
    validated = validate(ValidateConfig(), "instruction", ingest(data, root))
    return dedup(DedupConfig(casefold=casefold), data, validated)


def row(i: int, output: str = "x") -> dict:
    return {"instruction": f"Question {i}", "input": "", "output": output}


def test_normalization_folds_unicode_and_whitespace() -> None:
    assert normalize("  ﬁne\u00a0\n day  ", casefold=False) == "fine day"
    assert normalize("Fine DAY", casefold=True) == "fine day"


def test_exact_duplicates_are_removed_keeping_the_first(tmp_path: Path) -> None:
    rows = [row(i) for i in range(40)] + [row(3), {**row(5), "instruction": "Question  5 "}]
    record = deduped(rows, tmp_path)
    assert record.stats["duplicates"] == 2 and record.stats["rows_out"] == 40
    dupes = list(read_jsonl(record.dir / "duplicates.jsonl"))
    assert [(d["line"], d["kept_line"]) for d in dupes] == [(41, 4), (42, 6)]
    kept = list(read_jsonl(record.dir / "train.jsonl")) + list(read_jsonl(record.dir / "eval.jsonl"))
    assert sorted(r["_line"] for r in kept) == list(range(1, 41))


def test_casefold_is_optional(tmp_path: Path) -> None:
    rows = [row(i) for i in range(20)] + [{**row(1), "instruction": "QUESTION 1"}]
    assert deduped(rows, tmp_path).stats["duplicates"] == 0
    assert deduped(rows, tmp_path, casefold=True).stats["duplicates"] == 1


def test_split_depends_only_on_the_row(tmp_path: Path) -> None:
    rows = [row(i) for i in range(200)]
    first = {r["instruction"] for r in read_jsonl(deduped(rows, tmp_path).dir / "eval.jsonl")}
    more = {r["instruction"] for r in read_jsonl(deduped(rows + [row(i) for i in range(200, 400)],
                                                                tmp_path).dir / "eval.jsonl")}
    assert first and first <= more  # adding data never moves an existing row out of eval
    assert 0.1 < len(more) / 400 < 0.3
    assert in_eval("abc", "s", 1.0) and not in_eval("abc", "s", 0.0)


def test_an_empty_split_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EmptySplitError, match="the eval split is empty"):
        deduped([row(1)], tmp_path, eval_fraction=0.01)
