"""Sequence-to-sequence records: a source text and the target text written from it, with the column names public
datasets give them.
"""

from __future__ import annotations

from typing import Any

from llmops.records.base import RecordKind

# the column names public datasets give a source and a target, tried in this order when data.sources[].columns
# does not name them (the first one present wins): plain pairs, instruction-style, summarization (XSum,
# CNN/DailyMail) and question answering
SOURCE_COLUMNS = ("source", "input", "document", "article", "question", "text")
TARGET_COLUMNS = ("target", "output", "summary", "highlights", "answer")


class PairRecords(RecordKind):
    """A source text and the target text written from it."""

    name = "seq2seq"
    fields = ("source", "target")
    asked_fields = ("source",)
    columns = {"source": SOURCE_COLUMNS, "target": TARGET_COLUMNS}
    text_fields = (("source", True), ("target", True))

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"source": row["source"], "reference": row["target"]}


PAIRS = PairRecords()
