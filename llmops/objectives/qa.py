"""Extractive question answering: the answer is a span of the context, found by an encoder's start and end heads.

Records take the SQuAD layout, `context`, `question`, `answers: {text: [...], answer_start: [...]}`,
or a flat `answer` with an optional `answer_start` (found in the context when missing); empty answers
(SQuAD 2.0's `{text: [], answer_start: []}`) mark a question the context does not answer. A context
longer than `tokenize.max_length` is read in windows that overlap by `tokenize.stride` tokens; each
window is a training example, whose target is the answer's first and last token when the answer
lies whole inside it, and the class token when it does not (in every window, for an unanswered
question). Scoring reads every window of a held-out row and keeps the best span across them (start
and end logits, a span of at most MAX_ANSWER_TOKENS tokens inside the context); it answers nothing
where the class token scores above that span in every window (SQuAD 2.0's null answer). Metrics are
SQuAD's: exact match and token F1 (primary) of the normalized answer against the best of the
references (the empty answer, for an unanswered question).
"""

from __future__ import annotations

import collections
import re
import string
from typing import TYPE_CHECKING, Any

import numpy as np

from llmops.models import modeling
from llmops.objectives.base import (
    Encoding,
    Objective,
    Request,
    RowError,
    ScoringContext,
    Served,
    padded,
    string_field,
)
from llmops.objectives.metrics import Metric, Scored, means, ratio, table
from llmops.records.qa import QA, references_of
from llmops.text import packing
from llmops.text.tokenizers import train_encoder_bpe

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

    import pyarrow as pa
    from datasets import Dataset
    from transformers import BatchEncoding

    from llmops.config.schema import PipelineConfig
    from llmops.objectives.base import Model, Tokenizer

MAX_ANSWER_TOKENS = 30
COLUMNS = ("input_ids", "start_positions", "end_positions")
METRICS = table(
    Metric("f1", ratio, True, "token F1 of the answer against the best reference (SQuAD normalization: lower "
                              "case, no punctuation, articles or extra spaces)"),
    Metric("exact_match", ratio, True, "share of answers equal to a reference after SQuAD normalization"))


class QuestionAnswering(Objective):
    name = "qa"
    needs_offsets = True
    kinds = (QA,)
    summary = "extractive question answering (the answer is a span of the context: start and end token heads)"
    task = "question-answering"
    metrics = METRICS
    architectures = ("bert", "roberta")
    peft_task = "QUESTION_ANS"
    peft_auto = "AutoPeftModelForQuestionAnswering"
    # transformers no longer builds a question-answering pipeline by name: a version is a pyfunc of this project's code
    pipeline_served = False

    def train_tokenizer(self, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        return train_encoder_bpe(texts, vocab_size)

    def auto_class(self) -> type:
        from transformers import AutoModelForQuestionAnswering

        return AutoModelForQuestionAnswering

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """A window per `max_length` tokens of question and context, overlapping by `stride`: its target is the
        first answer's first and last token when the answer lies whole inside it, else the class token."""
        windows = windowed(tokenizer, rows, encoding)
        batch: dict[str, list[Any]] = {name: [] for name in (*COLUMNS, "raw_length", "length", "has_target",
                                                              "target_tokens")}
        for index, ids in enumerate(windows["input_ids"]):
            answers = rows[windows["overflow_to_sample_mapping"][index]]["answers"]
            first = answers["answer_start"][0] if answers["text"] else None
            # an unanswered question: the class token, in every window
            start, end = (0, 0) if first is None else answer_tokens(windows, index, first,
                                                                     first + len(answers["text"][0]))
            for name, value in (("input_ids", ids), ("start_positions", start), ("end_positions", end),
                                ("raw_length", windows["raw_length"][index]), ("length", len(ids)),
                                ("has_target", True), ("target_tokens", end - start + 1 if end else 0)):
                batch[name].append(value)
        return batch

    def arrow_schema(self) -> pa.Schema:
        import pyarrow as pa

        return pa.schema([("input_ids", pa.list_(pa.int32())), ("start_positions", pa.int32()),
                          ("end_positions", pa.int32()), ("raw_length", pa.int32()), ("length", pa.int32())])

    def datasets(self, tokenized_dir: Path, packed: bool, max_length: int) -> tuple[Dataset, Dataset]:
        from llmops.io.files import load_dataset_dir

        train_set = packing.with_sample_ids(load_dataset_dir(tokenized_dir / "train"), per_token=False)
        eval_set = load_dataset_dir(tokenized_dir / "eval").select_columns(list(COLUMNS))
        return train_set.select_columns([*COLUMNS, "length", packing.SAMPLE_IDS]), eval_set

    def meter(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> packing.BatchMeter:
        from transformers import DataCollatorWithPadding

        return packing.BatchMeter(DataCollatorWithPadding(tokenizer), columns=COLUMNS)

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return "f1", ("extractive QA: token F1 of the answer span against the best reference, SQuAD's measure; it "
                      "credits an answer that is nearly right, where exact match does not")

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        """Per row: exact match and token F1 of the best span across its windows, against its best reference."""
        found = best_spans(model, tokenizer, [(row["question"], row["context"]) for row in rows], context.encoding,
                           context.settings.batch_size)
        predicted = [answer["answer"] for answer in found]
        references = [references_of(row) for row in rows]
        return Scored({"f1": means([max(token_f1(p, r) for r in refs) for p, refs in zip(predicted, references,
                                                                                          strict=True)]),
                       "exact_match": means([max(float(normalized(p) == normalized(r)) for r in refs)
                                             for p, refs in zip(predicted, references, strict=True)])},
                      predicted, self.metrics)

    def request_example(self) -> dict[str, Any]:
        return {"question": "When did the bridge open?", "context": "The bridge opened on 3 May 1990."}

    def limitations(self, config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
        return ["Its answers are spans of the context it is given: it cannot answer what the context does not say. "
                "It answers nothing where it scores no span above the class token, which it learns from unanswered "
                "questions (empty answers) in its training data.",
                f"Contexts longer than tokenize.max_length ({config.tokenize.max_length} tokens with the question) "
                f"are read in windows overlapping by tokenize.stride ({config.tokenize.stride}) tokens."]

    def request(self, line: int, row: dict[str, Any], served: Served) -> Request:
        """A question about a context; a given answer comes back as the reference."""
        question, context = string_field(row, "question"), string_field(row, "context")
        answers = row.get("answers")
        reference = row.get("answer") if isinstance(row.get("answer"), str) else \
            answers["text"][0] if isinstance(answers, dict) and answers.get("text") else None
        if not isinstance(reference, str | type(None)):
            raise RowError("answers: expected {text: [...]} or a flat answer string")
        return Request(line, "answer", {"question": question, "context": context}, reference)

    def answer(self, served: Served, requests: list[Request]) -> list[dict[str, Any]]:
        found = best_spans(served.model, served.tokenizer, [(r.fields["question"], r.fields["context"])
                                                            for r in requests], served.encoding, len(requests))
        return [{**answer, **({"reference": r.reference} if r.reference is not None else {})}
                for answer, r in zip(found, requests, strict=True)]

    def limits(self, served: Served) -> str:
        return (f"answers of up to {MAX_ANSWER_TOKENS} tokens from contexts read in windows of "
                f"{served.encoding.max_length} tokens (overlap {served.encoding.stride})")


def windowed(tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> BatchEncoding:
    """Question and context as windows of `max_length` tokens overlapping by `stride`, with offsets and the row each
    window comes from (`overflow_to_sample_mapping`) and each row's untruncated length (`raw_length`). A question
    keeps at most half the window (its end is cut), so that every window holds some of the context."""
    limit = encoding.max_length // 2
    questions = [clipped(tokenizer, row["question"], limit) for row in rows]
    contexts = [row["context"] for row in rows]
    full = tokenizer(questions, contexts)["input_ids"]
    longest = max(len(ids) for ids in tokenizer(questions, add_special_tokens=False)["input_ids"])
    # the overlap must leave every window new context: at most the room left beside the question, less one
    room = encoding.max_length - longest - tokenizer.num_special_tokens_to_add(pair=True)
    windows = tokenizer(questions, contexts, truncation="only_second", max_length=encoding.max_length,
                        stride=max(0, min(encoding.stride, room - 1)), return_overflowing_tokens=True,
                        return_offsets_mapping=True)
    windows["raw_length"] = [len(full[row]) for row in windows["overflow_to_sample_mapping"]]
    return windows


def clipped(tokenizer: Tokenizer, question: str, limit: int) -> str:
    """The question, cut to `limit` tokens when it is longer."""
    ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    return question if len(ids) <= limit else tokenizer.decode(ids[:limit])


def context_range(windows: BatchEncoding, index: int) -> tuple[int, int]:
    """The first and last token of the context in a window."""
    sequence = windows.sequence_ids(index)
    first = sequence.index(1)
    return first, len(sequence) - 1 - sequence[::-1].index(1)


def answer_tokens(windows: BatchEncoding, index: int, start_char: int, end_char: int) -> tuple[int, int]:
    """The window's first and last token of the answer at [start_char, end_char) of the context; (0, 0), the class
    token, when the answer does not lie whole inside the window."""
    offsets = windows["offset_mapping"][index]
    first, last = context_range(windows, index)
    if offsets[first][0] > start_char or offsets[last][1] < end_char:
        return 0, 0
    start = first
    while start <= last and offsets[start][1] <= start_char:
        start += 1
    end = last
    while end >= first and offsets[end][0] >= end_char:
        end -= 1
    return (start, end) if start <= end else (0, 0)


def best_spans(model: Model, tokenizer: Tokenizer, pairs: list[tuple[str, str]], encoding: Encoding,
               batch_size: int) -> list[dict[str, Any]]:
    """For each (question, context): the best span across its windows, its character offsets and its probability
    (of its start times of its end, in its window)."""
    import torch

    rows = [{"question": question, "context": context} for question, context in pairs]
    windows = windowed(tokenizer, rows, encoding) if rows else {"input_ids": []}
    best: dict[int, dict[str, Any]] = {}
    # per row, the lowest score of its class token across its windows (SQuAD 2.0's null score)
    null: dict[int, float] = {}
    with torch.no_grad():
        for begin in range(0, len(windows["input_ids"]), batch_size):
            chunk = windows["input_ids"][begin:begin + batch_size]
            batch = modeling.on_device({"input_ids": padded(chunk, tokenizer.pad_token_id),
                                        "attention_mask": padded([[1] * len(ids) for ids in chunk], 0)}, model)
            output = model(**batch)
            for offset, (starts, ends) in enumerate(zip(output.start_logits.float().cpu().numpy(),
                                                        output.end_logits.float().cpu().numpy(), strict=True)):
                index = begin + offset
                span = window_best(windows, index, starts[:len(chunk[offset])], ends[:len(chunk[offset])])
                row = windows["overflow_to_sample_mapping"][index]
                null[row] = min(null.get(row, np.inf), float(starts[0] + ends[0]))
                if span is not None and (row not in best or span["logit"] > best[row]["logit"]):
                    best[row] = span
    answers = []
    for row, (_, context) in enumerate(pairs):
        span = best.get(row)
        if span is None or null.get(row, -np.inf) > span["logit"]:
            answers.append({"answer": "", "start": 0, "end": 0, "score": 0.0})
            continue
        text = context[span["start"]:span["end"]]
        lead = len(text) - len(text.lstrip())
        answers.append({"answer": text.strip(), "start": span["start"] + lead,
                        "end": span["start"] + lead + len(text.strip()), "score": span["score"]})
    return answers


def window_best(windows: Any, index: int, starts: np.ndarray, ends: np.ndarray) -> dict[str, Any] | None:
    """The highest-scoring span of the window inside its context, at most MAX_ANSWER_TOKENS long."""
    first, last = context_range(windows, index)
    offsets = windows["offset_mapping"][index]
    scores = starts[first:last + 1, None] + ends[None, first:last + 1]
    allowed = np.triu(np.ones_like(scores, dtype=bool)) & ~np.triu(np.ones_like(scores, dtype=bool),
                                                                   k=MAX_ANSWER_TOKENS)
    scores = np.where(allowed, scores, -np.inf)
    if not np.isfinite(scores).any():
        return None
    start, end = np.unravel_index(int(np.argmax(scores)), scores.shape)
    probabilities = softmax(starts)[first + start] * softmax(ends)[first + end]
    return {"start": int(offsets[first + start][0]), "end": int(offsets[first + end][1]),
            "logit": float(scores[start, end]), "score": float(probabilities)}


def softmax(values: np.ndarray) -> np.ndarray:
    shifted = np.exp(values - values.max())
    return shifted / shifted.sum()


def normalized(text: str) -> str:
    """SQuAD's answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(character for character in text.lower() if character not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1 of two answers (1 when both are empty, 0 when one is)."""
    predicted, expected = normalized(prediction).split(), normalized(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)
