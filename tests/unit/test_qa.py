"""Extractive QA: SQuAD and flat layouts, the quarantine of answers that are not spans, windows over long contexts,
answer tokens aligned for byte-level BPE and WordPiece, the best span across windows, and SQuAD's metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmops.data.synthetic import qa_records
from llmops.io.files import read_jsonl, write_jsonl
from llmops.io.tables import table_rows
from llmops.objectives import registry
from llmops.objectives.base import Encoding
from llmops.objectives.config import complete
from llmops.objectives.qa import (
    answer_tokens,
    normalized,
    token_f1,
    window_best,
    windowed,
)
from llmops.records.qa import NOT_IN_CONTEXT
from llmops.text.tokenizers import train_encoder_bpe
from tests.helpers import stage

CONTEXT = "The pier opened on 3 May 1990. The pier closed on 7 June 2001."


def qa_config(path: Path, *extra: tuple[str, Any]) -> Any:
    raw: dict[str, Any] = {"data": {"path": str(path), "kind": "qa", "eval_fraction": 0.2},
                           "tokenize": {"vocab_size": 300, "max_length": 32, "stride": 8},
                           "model": {"architecture": "bert", "hidden_size": 16, "num_layers": 1, "num_heads": 2}}
    for dotted, value in extra:
        section, key = dotted.split(".")
        raw.setdefault(section, {})[key] = value
    return complete(raw)


@pytest.fixture(scope="module")
def bpe() -> Any:
    rows = qa_records(300, seed=1)
    return train_encoder_bpe((f"{row['question']}\n{row['context']}" for row in rows), 400)


def test_kind_qa_selects_question_answering_and_its_checks() -> None:
    config = qa_config(Path("qa.jsonl"))
    assert config.data.objective == "qa" and registry.selected(config.data).task == "question-answering"
    with pytest.raises(ValueError, match="model.architecture: qa builds bert or roberta from scratch"):
        qa_config(Path("qa.jsonl"), ("model.architecture", "llama"))


def test_squad_and_flat_layouts_and_every_bad_answer_is_quarantined_with_its_code(tmp_path: Path) -> None:
    good = qa_records(40, seed=2)
    rows = [*good,
            {"context": CONTEXT, "question": "When did the pier close?", "answer": "7 June 2001"},
            {"passage": CONTEXT, "query": "When did the pier open?", "answer": "3 May 1990",
             "answer_start": CONTEXT.index("3 May 1990")},
            {"context": CONTEXT, "question": "When?", "answers": {"text": ["3 May 1990"], "answer_start": [5]}},
            {"context": CONTEXT, "question": "When?", "answer": "12 March 1850"},
            {"context": CONTEXT, "question": "   ", "answer": "3 May 1990"},
            {"context": CONTEXT, "question": "When did the pier open?"},
            {"context": CONTEXT, "question": "When?", "answers": {"text": "3 May 1990"}},
            # SQuAD's layout without a start, or with an empty list of them: found in the context, as a flat answer's
            {"context": CONTEXT, "question": "Opened when?", "answers": {"text": ["3 May 1990"]}},
            {"context": CONTEXT, "question": "Closed when?", "answers": {"text": ["7 June 2001"], "answer_start": []}},
            # a negative start would count from the context's end (where "2001" also is)
            {"context": CONTEXT, "question": "Which year?",
             "answers": {"text": ["2001"], "answer_start": [CONTEXT.index("2001") - len(CONTEXT)]}},
            {"context": CONTEXT, "question": "When?", "answers": {"text": ["3 May 1990", "1990"], "answer_start": [3]}}]
    write_jsonl(tmp_path / "qa.jsonl", rows)
    config = qa_config(tmp_path / "qa.jsonl")
    validated = stage("validate", config, stage("ingest", config))
    quarantine = {row["line"]: row for row in read_jsonl(validated.dir / "quarantine.jsonl")}
    first = len(good) + 3
    assert {line: (row["code"], row["field"]) for line, row in quarantine.items()} == {
        first: (NOT_IN_CONTEXT, "answers"), first + 1: (NOT_IN_CONTEXT, "answers"),
        first + 2: ("empty", "question"), first + 3: ("missing_field", "answers"),
        first + 4: ("wrong_type", "answers"), first + 7: (NOT_IN_CONTEXT, "answers"),
        first + 8: ("wrong_type", "answers")}
    assert "is not at answer_start -" in quarantine[first + 7]["message"]
    assert "is not at answer_start 5 of the context, which holds 'ier opened'" in quarantine[first]["message"]
    assert "'12 March 1850' does not occur in the context" in quarantine[first + 1]["message"]
    kept = list(table_rows(validated.dir / "valid"))
    flat = next(row for row in kept if row["question"] == "When did the pier close?")
    assert flat["answers"] == {"text": ["7 June 2001"], "answer_start": [CONTEXT.index("7 June 2001")]}
    mapped = next(row for row in kept if row["question"] == "When did the pier open?")
    assert mapped["context"] == CONTEXT and mapped["answers"]["answer_start"] == [CONTEXT.index("3 May 1990")]
    for question, answer in (("Opened when?", "3 May 1990"), ("Closed when?", "7 June 2001")):
        found = next(row for row in kept if row["question"] == question)
        assert found["answers"] == {"text": [answer], "answer_start": [CONTEXT.index(answer)]}
    assert validated.figures.codes == {NOT_IN_CONTEXT: 3, "missing_field": 1, "wrong_type": 2, "empty": 1}


def aligned(tokenizer: Any, row: dict[str, Any], max_length: int, stride: int) -> list[str]:
    """The text of the answer tokens each window is labelled with ('' for the class token)."""
    encoding = Encoding(max_length, (), stride)
    windows = windowed(tokenizer, [row], encoding)
    start_char = row["answers"]["answer_start"][0]
    end_char = start_char + len(row["answers"]["text"][0])
    found = []
    for index in range(len(windows["input_ids"])):
        start, end = answer_tokens(windows, index, start_char, end_char)
        offsets = windows["offset_mapping"][index]
        found.append(row["context"][offsets[start][0]:offsets[end][1]].strip() if end else "")
    return found


def long_row() -> dict[str, Any]:
    filler = " ".join(f"Sentence {number} says nothing about the bridge at all." for number in range(12))
    context = f"{filler} The bridge opened on 3 May 1990. {filler}"
    return {"context": context, "question": "When did the pier open?",
            "answers": {"text": ["3 May 1990"], "answer_start": [context.index("3 May 1990")]}}


def test_a_long_context_is_read_in_overlapping_windows_and_the_answer_is_labelled_where_it_lies(bpe: Any) -> None:
    row = long_row()
    labelled = aligned(bpe, row, max_length=48, stride=16)
    assert len(labelled) > 3 and set(labelled) == {"", "3 May 1990"}
    assert labelled.count("3 May 1990") >= 1
    encoded = registry.selected(qa_config(Path("x")).data).encode(bpe, [row], Encoding(48, (), 16))
    assert len(encoded["input_ids"]) == len(labelled) and all(len(ids) <= 48 for ids in encoded["input_ids"])
    assert all(raw > 48 for raw in encoded["raw_length"])
    assert sum(1 for tokens in encoded["target_tokens"] if tokens) == labelled.count("3 May 1990")


def test_answer_tokens_align_for_wordpiece_too(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    core = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    core.train_from_iterator([row["context"] for row in qa_records(300, seed=3)],
                             trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", core.token_to_id("[CLS]")), ("[SEP]", core.token_to_id("[SEP]"))])
    wordpiece = BertTokenizerFast(tokenizer_object=core, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                  cls_token="[CLS]", mask_token="[MASK]")
    # offsets point into the original text, whatever the normalizer did to it
    assert set(aligned(wordpiece, long_row(), max_length=48, stride=16)) == {"", "3 May 1990"}


def test_the_best_span_is_inside_the_context_and_at_most_the_longest_answer(bpe: Any) -> None:
    row = {"context": CONTEXT, "question": "When did the pier close?"}
    windows = windowed(bpe, [row], Encoding(64, (), 16))
    size = len(windows["input_ids"][0])
    starts, ends = np.full(size, -5.0), np.full(size, -5.0)
    offsets = windows["offset_mapping"][0]
    answer = CONTEXT.index("7 June 2001")
    first = next(i for i, (a, b) in enumerate(offsets) if windows.sequence_ids(0)[i] == 1 and b > answer)
    last = max(i for i, (a, b) in enumerate(offsets) if windows.sequence_ids(0)[i] == 1 and a < answer + 11)
    starts[first], ends[last] = 5.0, 5.0
    starts[1], ends[1] = 50.0, 50.0  # a question token: never an answer
    span = window_best(windows, 0, starts, ends)
    assert span is not None and CONTEXT[span["start"]:span["end"]].strip() == "7 June 2001"
    assert 0 < span["score"] <= 1


def test_squad_normalization_and_token_f1() -> None:
    assert normalized("The  Bridge, opened!") == "bridge opened"
    assert token_f1("on 3 May 1990", "3 May 1990") == pytest.approx(2 * (3 / 4) * 1 / (3 / 4 + 1))
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0 and token_f1("a", "an") == 1.0


def test_the_example_data_is_squad_layout_with_answers_at_their_start() -> None:
    rows = qa_records(200, seed=4)
    for row in rows:
        (text,), (start,) = row["answers"]["text"], row["answers"]["answer_start"]
        assert row["context"][start:start + len(text)] == text and row["question"].endswith("?")
    assert json.dumps(rows) == json.dumps(qa_records(200, seed=4))


def test_unanswered_questions_are_kept_learn_the_class_token_and_are_answered_with_nothing(bpe: Any,
                                                                                          tmp_path: Path) -> None:
    """SQuAD 2.0 marks a question its context does not answer with empty answers: such a row is valid, every
    window of it is labelled with the class token, and scoring answers nothing where the class token outscores
    every span."""
    unanswered = {"context": CONTEXT, "question": "Who built the pier?", "answers": {"text": [], "answer_start": []}}
    rows = [*qa_records(40, seed=4), unanswered]
    write_jsonl(tmp_path / "qa.jsonl", rows)
    config = qa_config(tmp_path / "qa.jsonl")
    validated = stage("validate", config, stage("ingest", config))
    assert validated.figures.rows_quarantined == 0
    objective = registry.selected(config.data)
    long = {**long_row(), "answers": {"text": [], "answer_start": []}}
    encoded = objective.encode(bpe, [long], Encoding(48, (), 16))
    assert len(encoded["input_ids"]) > 3
    assert set(encoded["start_positions"]) == set(encoded["end_positions"]) == {0}
    assert objective.kind.sample(unanswered)["reference"] == ""
    assert token_f1("", "") == 1.0 and token_f1("3 May 1990", "") == 0.0


def test_the_class_token_outscoring_every_span_in_every_window_answers_nothing(bpe: Any) -> None:
    import torch

    from llmops.objectives.qa import best_spans

    class Logits(torch.nn.Module):
        """Start and end logits that favour the class token by `margin` over the best span."""

        def __init__(self, margin: float) -> None:
            super().__init__()
            self.margin, self.anchor = margin, torch.nn.Parameter(torch.zeros(1))
            self.device = torch.device("cpu")

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            logits = torch.zeros(input_ids.shape, dtype=torch.float32)
            logits[:, 0] = self.margin
            logits[:, 5] = 0.5
            return type("Out", (), {"start_logits": logits, "end_logits": logits.clone()})()

    pairs = [("When did the pier close?", CONTEXT)]
    assert best_spans(Logits(10.0), bpe, pairs, Encoding(64, (), 16), 4)[0]["answer"] == ""
    assert best_spans(Logits(-10.0), bpe, pairs, Encoding(64, (), 16), 4)[0]["answer"] != ""
