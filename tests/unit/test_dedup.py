import json
import random
from pathlib import Path

import numpy as np
import pytest

from llmops.config.schema import DataConfig, DedupConfig, PipelineConfig
from llmops.data.dedup import EmptySplitError
from llmops.data.duplicates import (
    FIELD_SEPARATOR,
    in_eval,
    near_text,
    normalize,
    shingle_hashes,
    unique_rows,
    word_hashes,
)
from llmops.data.near_fields import unspaced_apart
from llmops.io.files import read_jsonl
from llmops.io.tables import table_rows
from tests.helpers import stage


def deduped(rows: list[dict], root: Path, casefold: bool = False, eval_fraction: float = 0.2):
    path = root / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(path=str(path), eval_fraction=eval_fraction)
    config = PipelineConfig(data=data, dedup=DedupConfig(casefold=casefold))
    return dedup(config)


def dedup(config: PipelineConfig):
    """The dedup record of the config's sources, ingested and validated first."""
    return stage("dedup", config, stage("validate", config, stage("ingest", config)))


def row(i: int, output: str = "x") -> dict:
    return {"instruction": f"Question {i}", "input": "", "output": output}


def test_normalization_folds_unicode_and_whitespace() -> None:
    assert normalize("  ﬁne\u00a0\n day  ", casefold=False) == "fine day"
    assert normalize("Fine DAY", casefold=True) == "fine day"


def test_ascii_text_is_normalized_as_splitting_and_joining_its_words_would() -> None:
    """ASCII text already spaced once is taken as it is, without splitting: every other ASCII character split
    at, a run of spaces, or a space at either end must still be folded."""
    rng = random.Random(0)
    alphabet = [chr(code) for code in range(128)] + [" "] * 30
    texts = ["", " ", "a", "a b", " a", "a ", "a  b", "a\x1fb", "a\x0bb", "a\x85b", "a\u00a0b"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(5000)]
    for text in texts:
        assert normalize(text, casefold=False) == " ".join(text.split()), repr(text)


def test_unique_rows_are_numpys_distinct_rows_in_its_order() -> None:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 50, (4000, 2)).astype(np.uint64)
    rows[::7, 0] = np.uint64(2**64 - 1)  # above int64: compared as unsigned
    for table in (rows, rows[:1], rows[:0], rng.integers(0, 3, (500, 3)).astype(np.uint64)):
        assert np.array_equal(unique_rows(table), np.unique(table, axis=0))


def test_exact_duplicates_are_removed_keeping_the_first(tmp_path: Path) -> None:
    rows = [row(i) for i in range(40)] + [row(3), {**row(5), "instruction": "Question  5 "}]
    record = deduped(rows, tmp_path)
    assert record.figures.duplicates == 2 and record.figures.rows_out == 40
    clusters = list(read_jsonl(record.dir / "clusters.jsonl"))
    assert [(c["kind"], c["line"], c["kept_line"]) for c in clusters] == [("duplicate", 41, 4), ("duplicate", 42, 6)]
    kept = list(table_rows(record.dir / "train")) + list(table_rows(record.dir / "eval"))
    assert sorted(r["_line"] for r in kept) == list(range(1, 41))


def test_casefold_is_optional(tmp_path: Path) -> None:
    rows = [row(i) for i in range(20)] + [{**row(1), "instruction": "QUESTION 1"}]
    assert deduped(rows, tmp_path).figures.duplicates == 0
    assert deduped(rows, tmp_path, casefold=True).figures.duplicates == 1


def test_split_depends_only_on_the_row(tmp_path: Path) -> None:
    rows = [row(i) for i in range(200)]
    first = {r["instruction"] for r in table_rows(deduped(rows, tmp_path).dir / "eval")}
    more = {r["instruction"] for r in table_rows(deduped(rows + [row(i) for i in range(200, 400)],
                                                         tmp_path).dir / "eval")}
    assert first and first <= more  # adding data never moves an existing row out of eval
    assert 0.1 < len(more) / 400 < 0.3
    assert in_eval("abc", "s", 1.0) and not in_eval("abc", "s", 0.0)


def test_an_empty_split_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EmptySplitError, match="the eval split is empty"):
        deduped([row(1)], tmp_path, eval_fraction=0.01)


def long_row(i: int, words: list[str]) -> dict:
    return {"instruction": f"Summarize document {i}.", "input": " ".join(words), "output": "A summary."}


def test_near_duplicates_cluster_to_their_first_row(tmp_path: Path) -> None:
    import random

    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(5000)]
    docs = [[rng.choice(vocab) for _ in range(80)] for _ in range(60)]
    edited = list(docs[7])
    edited[10] = "changed"
    edited[50] = "words"
    rows = [long_row(i, d) for i, d in enumerate(docs)] + [long_row(7, edited)]
    record = deduped(rows, tmp_path)
    assert record.figures.near_duplicates == 1 and record.figures.duplicates == 0
    clusters = list(read_jsonl(record.dir / "clusters.jsonl"))
    assert [(c["kind"], c["line"], c["kept_line"]) for c in clusters] == [("near_duplicate", 61, 8)]


def test_near_copies_in_a_script_without_spaces_are_found(tmp_path: Path) -> None:
    """Chinese or Japanese text has no spaces between words: each character is a word, so a paragraph with two
    characters changed is a near copy, and different paragraphs are not."""
    rng = random.Random(1)
    characters = [chr(code) for code in range(0x4E00, 0x4E00 + 3000)] + list("のはにをがでとも。、")
    docs = ["".join(rng.choice(characters) for _ in range(150)) for _ in range(40)]
    edited = docs[5][:30] + "学习" + docs[5][32:]
    record = deduped([long_row(i, [doc]) for i, doc in enumerate(docs)] + [long_row(5, [edited])], tmp_path)
    assert record.figures.near_duplicates == 1 and record.figures.duplicates == 0
    clusters = list(read_jsonl(record.dir / "clusters.jsonl"))
    assert [(c["kind"], c["line"], c["kept_line"]) for c in clusters] == [("near_duplicate", 41, 6)]


def test_training_rows_that_repeat_eval_rows_are_contaminated(tmp_path: Path) -> None:
    import random

    rng = random.Random(1)
    vocab = [f"w{i}" for i in range(5000)]
    benchmark = [long_row(i, [rng.choice(vocab) for _ in range(60)]) for i in range(10)]
    train_rows = [long_row(100 + i, [rng.choice(vocab) for _ in range(60)]) for i in range(30)]
    leaked_exact = dict(benchmark[2])
    leaked_near = {**benchmark[5], "input": benchmark[5]["input"].replace(benchmark[5]["input"].split()[3], "x", 1)}
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in benchmark))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in
                                                  train_rows + [leaked_exact, leaked_near]))
    data = DataConfig(sources=[{"path": str(tmp_path / "train.jsonl")}],
                      eval_sources=[{"path": str(tmp_path / "eval.jsonl")}])
    config = PipelineConfig(data=data)
    record = dedup(config)
    stats = record.figures
    assert (stats.contaminated, stats.eval_rows, stats.train_rows) == (2, 10, 30)
    assert stats.rows_in == stats.rows_out + stats.contaminated + stats.duplicates + \
        stats.near_duplicates
    dropped = list(read_jsonl(record.dir / "contaminated.jsonl"))
    assert sorted(d["line"] for d in dropped) == [31, 32]


def test_source_weights_repeat_training_rows(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(row(i)) + "\n" for i in range(100)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(row(1000 + i)) + "\n" for i in range(100)))
    data = DataConfig(sources=[{"path": str(tmp_path / "a.jsonl"), "weight": 2.0},
                               {"path": str(tmp_path / "b.jsonl"), "weight": 0.5}], eval_fraction=0.1)
    config = PipelineConfig(data=data)
    record = dedup(config)
    train = list(table_rows(record.dir / "train"))
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")  # sources outside the project: full paths
    from_a = sum(r["_source"] == a for r in train)
    from_b = sum(r["_source"] == b for r in train)
    unique_a = len({r["_line"] for r in train if r["_source"] == a})
    assert from_a == 2 * unique_a
    assert 0.3 < from_b / unique_a < 0.7  # about half of b's rows, chosen by a stable hash
    assert record.figures.train_rows_weighted == len(train)


def test_an_exact_copy_of_a_near_duplicate_joins_its_cluster(tmp_path: Path) -> None:
    import random

    rng = random.Random(2)
    words = [f"w{rng.randrange(5000)}" for _ in range(60)]
    near = list(words)
    near[30] = "other"
    rows = [long_row(1, words), long_row(1, near), long_row(1, near)] + [
        long_row(i, [f"w{rng.randrange(5000)}" for _ in range(60)]) for i in range(2, 30)]
    record = deduped(rows, tmp_path)
    assert (record.figures.near_duplicates, record.figures.duplicates) == (1, 1)
    clusters = list(read_jsonl(record.dir / "clusters.jsonl"))
    assert [(c["kind"], c["line"], c["kept_line"]) for c in clusters] == [("near_duplicate", 2, 1),
                                                                          ("duplicate", 3, 1)]


def test_fields_are_not_merged_when_normalizing(tmp_path: Path) -> None:
    rows = [row(i) for i in range(20)] + [{"instruction": "Say", "input": "", "output": "hello world"},
                                           {"instruction": "Say hello", "input": "", "output": "world"}]
    assert deduped(rows, tmp_path).figures.duplicates == 0


def string_shingles(words: list[str], size: int) -> set[str]:
    if len(words) <= size:
        return {" ".join(words)}
    return {" ".join(words[i:i + size]) for i in range(len(words) - size + 1)}


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_hashed_shingles_are_the_word_shingles_of_each_text(size: int) -> None:
    """The shingles are hashed without making a string of each: per text, as many distinct hashes as distinct
    runs of words, and two texts share as many hashes as they share runs (word order counts)."""
    words, counts = word_hashes([near_text(FIELD_SEPARATOR.join(["", " ", ""]))])  # empty fields, no word
    assert counts.tolist() == [0] and len(words) == 0
    rng = random.Random(size)
    vocab = ["a", "b", "ab", "ba", "Straße", "STRASSE", "x" * 40, "日本語", "é", "e\u0301", "ภาษา", "中文。",
             *map(str, range(40))]
    for _ in range(30):
        texts = [normalize(" ".join(rng.choice(vocab) for _ in range(rng.randint(1, 25))), casefold=False)
                 for _ in range(rng.randint(1, 12))]
        texts.append(normalize("b a " * 3, casefold=False))  # the reverse of another text's runs
        # a record with empty fields: its compared text starts and ends with a space and has two in a row
        texts.append(FIELD_SEPARATOR.join(["", texts[0], "", texts[-1], ""]))
        compared = [near_text(text) for text in texts]
        words, counts = word_hashes(compared)
        # a character of a script without spaces is a word, in Arrow as in Python (near_fields)
        assert counts.tolist() == [len(unspaced_apart(text).split()) for text in compared]
        flat, offsets = shingle_hashes(words, counts, size)
        hashed = [set(flat[offsets[i]:offsets[i + 1]].tolist()) for i in range(len(texts))]
        expected = [string_shingles(unspaced_apart(text).split(), size) for text in compared]
        for mine, theirs in zip(hashed, expected, strict=True):
            assert len(mine) == len(theirs)
            assert [len(mine & other) for other in hashed] == [len(theirs & other) for other in expected]


def test_an_exact_copy_labelled_otherwise_is_a_conflict_counted_and_listed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The same text is one record whatever its label, so one copy is trained on; a copy whose label disagrees with
    the kept one was dropped as a plain duplicate, the disagreement (label noise) lost without a word."""
    texts = [f"review number {i} says the film was {'good' if i % 2 else 'bad'}" for i in range(30)]
    rows = [{"text": text, "label": "pos" if i % 2 else "neg"} for i, text in enumerate(texts)]
    rows += [{"text": texts[3], "label": "neg"}, {"text": texts[4], "label": "neg"}, {"text": texts[6], "label": "pos"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = PipelineConfig(data=DataConfig(kind="classification", labels=["neg", "pos"], path=str(path)))
    with caplog.at_level("WARNING", logger="llmops.dedup"):
        record = dedup(config)
    assert record.figures.duplicates == 3 and record.figures.conflicts == 2
    clusters = list(read_jsonl(record.dir / "clusters.jsonl"))
    assert [(c["line"], c["kept_line"], c.get("conflict")) for c in clusters] == [
        (31, 4, {"label": ["neg", "pos"]}), (32, 5, None), (33, 7, {"label": ["pos", "neg"]})]
    assert "2 exact duplicates disagree with the copy kept (label)" in caplog.text


def test_copies_labelled_1_and_quoted_1_agree(tmp_path: Path) -> None:
    """Validation reads a label 1 as the declared label "1": the valid rows hold it so, and a copy labelled "1" of a
    row labelled 1 is a plain duplicate, not a conflict."""
    rows = [{"text": f"review number {i} of a film", "label": i % 2} for i in range(30)]
    rows += [{"text": rows[3]["text"], "label": "1"}, {"text": rows[4]["text"], "label": "0"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = PipelineConfig(data=DataConfig(kind="classification", labels=[0, 1], path=str(path)))
    record = dedup(config)
    assert record.figures.duplicates == 2 and not record.figures.conflicts
    assert {row["label"] for split in ("train", "eval") for row in table_rows(record.dir / split)} == {"0", "1"}
