"""Sequence classification: a label per text, from `data.labels` (AutoModelForSequenceClassification).

Held out: accuracy and macro-F1 (the primary: rare labels count as much as common ones). Asked
through `llmops predict`, a classifier gives each text's label and the probability of every label.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from llmops.models import modeling
from llmops.objectives.base import Encoding, Objective, Request, ScoringContext, Served, string_field
from llmops.objectives.metrics import Metric, Scored, means, ratio, table
from llmops.records.classification import CLASSIFICATION
from llmops.text.encoding import token_ids, truncated

if TYPE_CHECKING:
    import pyarrow as pa

    from llmops.config.schema import ModelConfig
    from llmops.objectives.base import Collator, Model, Tokenizer


def macro_f1(sums: np.ndarray) -> np.ndarray:
    """Parts are per-class (true positives, predicted, actual); F1 = 2·tp / (predicted + actual), averaged over
    the classes that occur in the predictions or the truth, as scikit-learn's macro average does."""
    classes = sums.shape[1] // 3
    tp, predicted, actual = sums[:, :classes], sums[:, classes:2 * classes], sums[:, 2 * classes:]
    with np.errstate(divide="ignore", invalid="ignore"):
        f1 = np.where(predicted + actual > 0, 2 * tp / (predicted + actual), np.nan)
    counted = np.isfinite(f1).sum(axis=1)
    return np.where(counted > 0, np.nansum(f1, axis=1) / np.maximum(counted, 1), np.nan)


METRICS = table(Metric("accuracy", ratio, True, "share of rows given their label"),
                Metric("macro_f1", macro_f1, True, "F1 averaged over labels"))


class SequenceClassification(Objective):
    name = "classification"
    kinds = (CLASSIFICATION,)
    summary = "sequence classification"
    task = "text-classification"
    metrics = METRICS
    architectures = ("llama", "gpt2", "bert", "roberta")
    peft_task = "SEQ_CLS"
    peft_auto = "AutoPeftModelForSequenceClassification"

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        ids = token_ids(tokenizer, [row["text"] for row in rows])
        batch = truncated(ids, [[] for _ in ids], encoding.max_length)
        index = {label: position for position, label in enumerate(encoding.labels)}
        batch["labels"] = [index[str(row["label"])] for row in rows]
        batch["has_target"] = [True] * len(rows)
        return batch

    def arrow_schema(self) -> pa.Schema:
        import pyarrow as pa

        return pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.int64()), ("raw_length", pa.int32()),
                          ("length", pa.int32())])

    def auto_class(self) -> type:
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification

    def label_settings(self, labels: list[str]) -> dict[str, Any]:
        return modeling.label_maps(labels)

    def build_model(self, model_config: ModelConfig, tokenizer: Tokenizer, seed: int, labels: list[str],
                    quantize: bool = False, dtype: str | None = None) -> Model:
        model = super().build_model(model_config, tokenizer, seed, labels, quantize, dtype)
        if model.config.pad_token_id is None:
            # sequence classifiers find each row's last token through the pad id
            model.config.pad_token_id = tokenizer.pad_token_id
        return model

    def collator(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> Collator:
        from transformers import DataCollatorWithPadding

        return DataCollatorWithPadding(tokenizer)

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return "macro_f1", "classification: F1 averaged over labels, so rare labels count"

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        labels = list(context.encoding.labels)
        encoded = self.encode(tokenizer, rows, context.encoding) if rows else {"input_ids": [], "labels": []}
        predicted = [int(np.argmax(row)) for row in probabilities(model, tokenizer, encoded["input_ids"],
                                                                  context.settings.batch_size)]
        return Scored(parts(predicted, encoded["labels"], len(labels)), [labels[i] for i in predicted], self.metrics)

    def usage(self) -> str:
        return 'pipe = mlflow.transformers.load_model(uri)\nprint(pipe("some text"))'

    def request(self, line: int, row: dict[str, Any], served: Served) -> Request:
        return Request(line, "classify", {"text": string_field(row, "text")})

    def answer(self, served: Served, requests: list[Request]) -> list[dict[str, Any]]:
        """The most probable label and the probability of each label."""
        ids = served.tokenizer([r.fields["text"] for r in requests], add_special_tokens=True)["input_ids"]
        limit = served.encoding.max_length
        rows = probabilities(served.model, served.tokenizer, [seq[:limit] for seq in ids], len(requests))
        labels = served.labels or []
        return [{"label": labels[max(range(len(row)), key=row.__getitem__)],
                 "scores": dict(zip(labels, row, strict=True)), "truncated": len(seq) > limit}
                for row, seq in zip(rows, ids, strict=True)]


def probabilities(model: Model, tokenizer: Tokenizer, ids: list[list[int]], batch_size: int) -> list[list[float]]:
    """Each row's probability of every label."""
    import torch
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tokenizer)
    found: list[list[float]] = []
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            batch = modeling.on_device(collate([{"input_ids": row} for row in ids[start:start + batch_size]]), model)
            found.extend(model(**batch).logits.float().softmax(-1).tolist())
    return found


def parts(predicted: list[int], truth: list[int], classes: int) -> dict[str, np.ndarray]:
    hits = [float(p == t) for p, t in zip(predicted, truth, strict=True)]
    eye = np.eye(classes)
    predicted_onehot, truth_onehot = eye[predicted].reshape(-1, classes), eye[truth].reshape(-1, classes)
    return {"accuracy": means(hits),
            "macro_f1": np.hstack([predicted_onehot * truth_onehot, predicted_onehot, truth_onehot])}
