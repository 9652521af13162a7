"""Question-answering records in the SQuAD layout: `context`, `question`, `answers: {text: [...], answer_start:
[...]}`, or a flat `answer` with an optional `answer_start` (found in the context when missing); empty answers
(SQuAD 2.0's) mark a question the context does not answer. An answer must be a span of its context.
"""

from __future__ import annotations

from typing import Any

from llmops.config.schema import ValidateConfig
from llmops.io.rejects import RejectCode, blank, json_kind
from llmops.records.base import Expect, RecordKind, describe_text

NOT_IN_CONTEXT = "answer_not_in_context"


class QARecords(RecordKind):
    """A context, a question about it, and the answers: spans of the context."""

    name = "qa"
    fields = ("context", "question", "answers")
    columns = {"context": ("context", "passage", "document"), "question": ("question", "query")}
    text_fields = (("context", True), ("question", True))
    reject_codes = {NOT_IN_CONTEXT: "an answer that is not a span of its context (at its answer_start, when given)"}

    def canonical(self, row: dict[str, Any], mapped: dict[str, str]) -> dict[str, Any]:
        """SQuAD's answers as they are; a flat answer (with its answer_start, if any) as SQuAD's."""
        record = super().canonical(row, mapped)
        if record["answers"] is None:
            answer = row.get(mapped.get("answer", "answer"))
            if answer is not None:
                start = row.get(mapped.get("answer_start", "answer_start"))
                record["answers"] = {"text": [answer], "answer_start": [start]}
        return record

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        super().expectations(expect, gxe, settings, labels)
        code = RejectCode
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_answers_type"), code.MISSING_FIELD, "answers")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_answers_shape", value_set=[True]), code.WRONG_TYPE, "answers")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_empty_answers", max_value=0), code.EMPTY, "answers")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_in_context", value_set=[True]), NOT_IN_CONTEXT, "answers")

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        columns = super().frame(chunk, labels)
        summaries = [answers_summary(row.get("answers"), row.get("context")) for row in chunk]
        for name in ("_answers_type", "_answers_shape", "_answer_count", "_empty_answers", "_in_context"):
            columns[name] = [summary[name] for summary in summaries]
        return columns

    def describe(self, code: str, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        if field != "answers":
            return describe_text(code, field, row.get(field), settings)
        answers = row.get("answers")
        if code == RejectCode.MISSING_FIELD:
            return ("answers: missing (expected answers: {text: [...], answer_start: [...]}, or a flat answer with an "
                    "optional answer_start)")
        if code == RejectCode.WRONG_TYPE:
            return (f"answers: a {json_kind(answers)} that is not {{text: [strings], answer_start: [integers or "
                    "null]}} with one start per text")
        if code == RejectCode.EMPTY:
            return "answers: an answer is empty or only whitespace"
        return f"answers: {misplaced(answers, row.get('context'))}"

    def valid_row(self, row: dict[str, Any], labels: list[str]) -> dict[str, Any]:
        """Each answer's start, found in the context where it was not given."""
        answers = row["answers"]
        starts = [start if start is not None else row["context"].index(text)
                  for text, start in zip(answers["text"], given_starts(answers), strict=True)]
        return {**row, "answers": {"text": list(answers["text"]), "answer_start": starts}}

    def content(self, row: dict[str, Any]) -> list[str]:
        return [row["context"], row["question"], *row["answers"]["text"]]

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"question": row["question"], "context": row["context"], "reference": references_of(row)[0]}


def answers_summary(answers: Any, context: Any) -> dict[str, Any]:
    """Columns the expectations read about the answers; None where a more basic check already fails."""
    shaped = (isinstance(answers, dict) and isinstance(answers.get("text"), list) and
              isinstance(answers.get("answer_start") or [], list) and
              all(isinstance(text, str) for text in answers["text"]) and
              len(given_starts(answers)) == len(answers["text"]) and
              all(start is None or isinstance(start, int) and not isinstance(start, bool)
                  for start in given_starts(answers)))
    texts = answers["text"] if shaped else []
    return {"_answers_type": None if answers is None else json_kind(answers),
            "_answers_shape": shaped if answers is not None else None,
            "_answer_count": len(texts) if shaped else None,
            "_empty_answers": sum(blank(text) for text in texts) if shaped else None,
            "_in_context": (misplaced(answers, context) is None) if shaped and isinstance(context, str) else None}


def given_starts(answers: dict[str, Any]) -> list[Any]:
    """Each answer's start as the record gives it: None for every answer where answer_start is missing, null or an
    empty list (each is then found in the context)."""
    return answers.get("answer_start") or [None] * len(answers["text"])


def misplaced(answers: dict[str, Any], context: Any) -> str | None:
    """Why an answer is not a span of the context, or None when every answer is (a negative start is none: Python
    would count it from the context's end)."""
    for text, start in zip(answers["text"], given_starts(answers), strict=True):
        if start is None and text not in context:
            return f"{text[:60]!r} does not occur in the context"
        if start is not None and (start < 0 or context[start:start + len(text)] != text):
            found = context[start:start + len(text)] if 0 <= start < len(context) else "nothing (out of range)"
            return f"{text[:60]!r} is not at answer_start {start} of the context, which holds {found[:60]!r}"
    return None


QA = QARecords()


def references_of(row: dict[str, Any]) -> list[str]:
    """A row's answers; the empty answer for a question its context does not answer."""
    return list(row["answers"]["text"]) or [""]
