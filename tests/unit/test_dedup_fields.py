"""Near duplicates of records of several fields: a long field that distinct records share (a system prompt, a QA
context, an instruction's input) does not make them duplicates; near copies, field by field, still are."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from llmops.config.engine import EngineConfig
from llmops.config.schema import DataConfig, DedupConfig
from llmops.data.dedup import write_splits
from llmops.data.near_fields import field_shingles, jaccard
from llmops.objectives.config import complete
from tests.helpers import output_bytes, stage, write_rows_table

VOCAB = [f"w{i}" for i in range(5000)]


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(count))


def edited(text: str, rng: random.Random, changes: int = 2) -> str:
    """`text` with a few of its words replaced."""
    tokens = text.split()
    for _ in range(changes):
        tokens[rng.randrange(len(tokens))] = f"edit{rng.randrange(10**6)}"
    return " ".join(tokens)


def dedup_figures(kind: str, rows: list[dict[str, Any]], root: Path) -> Any:
    """The dedup figures of the rows, ingested and validated first."""
    path = root / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # the model is never built: only what qa checks of it
    config = complete({"data": {"path": str(path), "kind": kind, "eval_fraction": 0.3},
                       "model": {"architecture": "bert"} if kind == "qa" else {}})
    return stage("dedup", config, stage("validate", config, stage("ingest", config))).figures


def chat(system: str, question: str, answer: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question},
                         {"role": "assistant", "content": answer}]}


def test_chats_that_share_a_long_system_prompt_are_not_near_duplicates(tmp_path: Path) -> None:
    system = words(random.Random(0), 150)
    rows = [chat(system, f"What is {i} plus {i}?", str(2 * i)) for i in range(20)]
    figures = dedup_figures("chat", rows, tmp_path)
    assert (figures.near_duplicates, figures.duplicates, figures.rows_out) == (0, 0, 20)


def test_questions_on_one_context_are_not_near_duplicates(tmp_path: Path) -> None:
    rng = random.Random(1)
    context = words(rng, 150)
    picks = context.split()

    def qa(context: str, question: str, answer: str) -> dict[str, Any]:
        return {"context": context, "question": question,
                "answers": {"text": [answer], "answer_start": [context.index(answer)]}}

    shared = [qa(context, f"Which word comes at place {i} of the passage?", picks[10 * i]) for i in range(5)]
    others = [qa(text, "Which word comes first?", text.split()[0]) for text in (words(rng, 150) for _ in range(10))]
    figures = dedup_figures("qa", shared + others, tmp_path)
    assert (figures.near_duplicates, figures.duplicates, figures.rows_out) == (0, 0, 15)


def test_instructions_that_share_a_long_input_are_not_near_duplicates(tmp_path: Path) -> None:
    rng = random.Random(2)
    passage = words(rng, 200)
    tasks = ["Summarize the passage.", "Translate the passage into French.", "List the names in the passage.",
             "Give the passage a title.", "Count the sentences of the passage."]
    shared = [{"instruction": task, "input": passage, "output": words(rng, 8)} for task in tasks]
    others = [{"instruction": f"Summarize document {i}.", "input": words(rng, 60), "output": words(rng, 8)}
              for i in range(10)]
    figures = dedup_figures("instruction", shared + others, tmp_path)
    assert (figures.near_duplicates, figures.duplicates, figures.rows_out) == (0, 0, 15)


def test_near_and_exact_copies_of_records_of_several_fields_are_still_found(tmp_path: Path) -> None:
    rng = random.Random(3)
    originals = [{"instruction": words(rng, 40), "input": "", "output": words(rng, 60)} for _ in range(20)]
    near = [{**row, "instruction": edited(row["instruction"], rng), "output": edited(row["output"], rng)}
            for row in originals[:4]]
    figures = dedup_figures("instruction", originals + near + [dict(originals[5]), dict(originals[6])], tmp_path)
    assert (figures.near_duplicates, figures.duplicates, figures.rows_out) == (4, 2, 20)


def test_near_copies_of_chats_that_share_a_system_prompt_are_still_found(tmp_path: Path) -> None:
    rng = random.Random(4)
    system = words(rng, 150)
    originals = [chat(system, words(rng, 40), words(rng, 40)) for _ in range(20)]
    near = [chat(system, edited(turns[1]["content"], rng, 1), edited(turns[2]["content"], rng, 1))
            for turns in (row["messages"] for row in originals[:3])]
    figures = dedup_figures("chat", originals + near + [originals[7]], tmp_path)
    assert (figures.near_duplicates, figures.duplicates, figures.rows_out) == (3, 1, 20)


def test_a_different_number_of_turns_is_not_a_near_copy(tmp_path: Path) -> None:
    rng = random.Random(5)
    system, question, answer = words(rng, 150), words(rng, 30), words(rng, 30)
    longer = chat(system, question, answer)
    longer["messages"] += [{"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You're welcome."}]
    rows = [chat(system, question, answer), longer] + [chat(words(rng, 40), words(rng, 20), "ok") for _ in range(10)]
    figures = dedup_figures("chat", rows, tmp_path)
    assert (figures.near_duplicates, figures.duplicates, figures.rows_out) == (0, 0, 12)


def test_field_shingles_and_their_jaccard() -> None:
    assert field_shingles("  The  CAT sat ", 2) == {("the", "cat"), ("cat", "sat")}
    assert field_shingles("Hello world", 3) == {("hello", "world")}  # shorter than a shingle: one of all its words
    assert field_shingles("机器学习", 2) == {("机", "器"), ("器", "学"), ("学", "习")}  # a character is a word
    assert field_shingles("", 2) == frozenset()
    assert jaccard(field_shingles("", 2), field_shingles(" ", 2)) == 1.0  # two empty fields are the same
    assert jaccard(field_shingles("", 2), field_shingles("x", 2)) == 0.0
    assert jaccard(field_shingles("a b c d", 2), field_shingles("a b c e", 2)) == 0.5


def test_verdicts_on_records_of_several_fields_do_not_depend_on_the_shard_size(tmp_path: Path) -> None:
    """Pairs whose rows are read back from other shards: the same outputs whatever the cut and the workers."""
    rng = random.Random(6)
    system = words(rng, 150)
    rows = [chat(system, f"What is {i} plus {i}?", str(2 * i)) for i in range(30)]
    rows += [chat(system, words(rng, 40), words(rng, 40)) for _ in range(30)]
    rows += [chat(system, edited(turns[1]["content"], rng, 1), edited(turns[2]["content"], rng, 1))
             for turns in (row["messages"] for row in rng.sample(rows[30:], 10))]
    rows += rng.sample(rows, 5)
    source = write_rows_table([{**row, "_source": "d.jsonl", "_line": line, "_weight": 1.0}
                               for line, row in enumerate(rows, 1)], tmp_path / "valid", rows_per_group=8)
    data = DataConfig(kind="chat", path="unused.jsonl", eval_fraction=0.2)
    outputs, shards = [], []
    for name, engine in (("whole", EngineConfig(workers=1)), ("cut", EngineConfig(workers=1, shard_bytes=4096)),
                         ("two", EngineConfig(workers=2, shard_bytes=8192))):
        folder = tmp_path / name
        folder.mkdir()
        counts = write_splits(DedupConfig(), data, source, folder, engine)
        assert (counts["near_duplicates"], counts["duplicates"]) == (10, 5)
        outputs.append(output_bytes(folder, "train", "eval", "clusters.jsonl"))
        shards.append(counts["shards"])
    assert outputs[0] == outputs[1] == outputs[2]
    assert shards[0] < shards[1] and shards[0] < shards[2]
