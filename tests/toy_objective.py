"""A toy objective defined outside the package, as a team would add its own: is a number even or odd?

It brings its own record kind (a `number` and its `parity`, with its own column names and checks)
and reuses sequence classification for the rest: the model, the trainer, the metrics. A config
selects it by path: `data.objective: tests.toy_objective:Parity`, `data.kind: parity`.
"""

from __future__ import annotations

from typing import Any

from llmops.config.schema import DataConfig, ValidateConfig
from llmops.io.rejects import RejectCode
from llmops.objectives.base import Encoding, ScoringContext
from llmops.objectives.classification import METRICS, SequenceClassification
from llmops.objectives.metrics import Scored, table
from llmops.records.base import Expect, Problem, RecordKind

PARITIES = ("even", "odd")


class ParityRecords(RecordKind):
    name = "parity"
    fields = ("number", "parity")
    columns = {"number": ("number", "n"), "parity": ("parity", "label")}
    text_fields = (("number", True),)

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        super().expectations(expect, gxe, settings, labels)
        expect(gxe.ExpectColumnValuesToMatchRegex(column="number", regex=r"^[0-9]+$"), RejectCode.WRONG_TYPE,
               "number")
        expect(gxe.ExpectColumnValuesToBeInSet(column="parity", value_set=list(PARITIES)), RejectCode.LABEL_UNKNOWN,
               "parity")

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        return {**super().frame(chunk, labels), "parity": [row.get("parity") for row in chunk]}

    def describe(self, code: RejectCode, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        if field == "parity":
            return f"parity: {row.get('parity')!r} is not even or odd"
        if code == RejectCode.WRONG_TYPE and isinstance(row.get("number"), str):
            return f"number: {row['number']!r} is not written in digits"
        return super().describe(code, field, row, settings, labels)

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"number": row["number"], "reference": row["parity"]}

    def check(self, data: DataConfig) -> list[Problem]:
        return super().check(data) + ([("data.labels", "the parity objective has its own labels: leave data.labels "
                                                       "empty")] if data.labels else [])


PARITY = ParityRecords()


class Parity(SequenceClassification):
    name = "tests.toy_objective:Parity"
    kinds = (PARITY,)
    summary = "parity: whether a number is even or odd"
    metrics = table(METRICS["accuracy"])

    def encode(self, tokenizer: Any, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        rows = [{"text": row["number"], "label": row["parity"]} for row in rows]
        return super().encode(tokenizer, rows, Encoding(encoding.max_length, PARITIES))

    def label_settings(self, labels: list[str]) -> dict[str, Any]:
        return super().label_settings(list(PARITIES))

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return "accuracy", "parity: two balanced labels, accuracy says it all"

    def score(self, model: Any, tokenizer: Any, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        context = ScoringContext(context.settings, Encoding(context.encoding.max_length, PARITIES), context.reference)
        scored = super().score(model, tokenizer, rows, context)
        return Scored({"accuracy": scored.parts["accuracy"]}, scored.outputs, self.metrics)
