"""Sequence-to-sequence: an encoder reads the source, a decoder writes the target (T5 and its kin).

Records are `{source, target}`. The source is encoded with the end token appended; the target's ids,
end token included, are the labels, so every target token is learned and nothing else is. The model
is a small T5 built here with the tokenizer trained on the data, or a pretrained seq2seq model.
Evaluation scores the target tokens' loss under teacher forcing and greedy generations against the
reference, with the same metric names as instruction data. A registered version is logged with the
MLflow transformers flavor as `text2text-generation` and answers `llmops predict` rows that carry a
source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from llmops.config.schema import PipelineConfig
from llmops.objectives.base import (
    Encoding,
    Objective,
    Request,
    RowError,
    ScoringContext,
    Served,
    generation_limitations,
    string_field,
)
from llmops.objectives.metrics import (
    GENERATIVE,
    Scored,
    by_answer_length,
    exact_matches,
    generation_parts,
    likelihood_parts,
    rouge_l,
)
from llmops.records.seq2seq import PAIRS, SOURCE_COLUMNS, TARGET_COLUMNS
from llmops.text.encoding import IGNORE_INDEX

if TYPE_CHECKING:
    import torch
    from transformers import EvalPrediction, Trainer, TrainingArguments

    from llmops.config.schema import ModelConfig
    from llmops.objectives.base import Collator, Model, Tokenizer


class Seq2Seq(Objective):
    name = "seq2seq"
    kinds = (PAIRS,)
    summary = ("sequence-to-sequence: an encoder reads the source, a decoder writes the target (loss on the target "
               "tokens)")
    task = "text2text-generation"
    benchmark_backend = "seq2seq"
    metrics = GENERATIVE
    architectures = ("t5",)
    peft_task = "SEQ_2_SEQ_LM"
    peft_auto = "AutoPeftModelForSeq2SeqLM"
    # transformers no longer builds a text2text-generation pipeline by name: a version is a pyfunc of this
    # project's code
    pipeline_served = False

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """Source ids as the input, target ids as the labels, each cut at `max_length` tokens."""
        sources = token_ids(tokenizer, [row["source"] for row in rows])
        targets = token_ids(tokenizer, [row["target"] for row in rows])
        limit = encoding.max_length
        inputs = [ids[:limit] for ids in sources]
        labels = [ids[:limit] for ids in targets]
        # a row counts as truncated when either side was cut
        return {"input_ids": inputs, "labels": labels,
                "raw_length": [max(len(s), len(t)) for s, t in zip(sources, targets, strict=True)],
                "length": [len(ids) for ids in inputs], "has_target": [bool(ids) for ids in labels]}

    def auto_class(self) -> type:
        from transformers import AutoModelForSeq2SeqLM

        return AutoModelForSeq2SeqLM

    def collator(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> Collator:
        return collator(tokenizer, model)

    def arguments(self, common: dict[str, Any], config: PipelineConfig) -> TrainingArguments:
        """Evaluations during training (train.eval_steps) generate greedily, so they report exact match and ROUGE-L."""
        from transformers import Seq2SeqTrainingArguments

        return Seq2SeqTrainingArguments(**common, predict_with_generate=True, generation_num_beams=1)

    def trainer(self, model: Model, settings: dict[str, Any], model_config: ModelConfig, tokenizer: Tokenizer,
                seed: int) -> Trainer:
        from transformers import Seq2SeqTrainer

        return Seq2SeqTrainer(model=model, **settings, compute_metrics=generated_metrics(tokenizer))

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return by_answer_length([row["target"] for row in rows])

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        """Every generative metric, per example: the target tokens' loss, and greedy generations against the
        target."""
        settings = context.settings
        encoded = self.encode(tokenizer, rows, context.encoding) if rows else {"input_ids": [], "labels": []}
        nll, tokens = target_losses(model, tokenizer, encoded, settings.batch_size)
        texts, lengths, truncated = generate(model, tokenizer, encoded["input_ids"], settings.max_new_tokens,
                                             settings.batch_size)
        parts = {**likelihood_parts(nll, tokens, "completion_"),
                 **generation_parts(texts, [row["target"] for row in rows], lengths, truncated)}
        return Scored(parts, texts, self.metrics)

    def limitations(self, config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
        return generation_limitations(config, metrics) + ["Perplexities compare only models that share a tokenizer."]

    def request_example(self) -> dict[str, Any]:
        return {"source": "The bridge over the river opened on 3 May 1990 after four years of work."}

    def request(self, line: int, row: dict[str, Any], served: Served) -> Request:
        """A source (read as ingest reads it), and its target as the reference."""
        source, target = request_columns(row)
        if source is None:
            given = ", ".join(sorted(row)) or "an empty object"
            raise RowError(f"expected a source field ({', '.join(SOURCE_COLUMNS)}), with an optional "
                           f"reference ({', '.join(TARGET_COLUMNS)}); got {given}")
        return Request(line, "seq2seq", {"source": string_field(row, source)},
                       string_field(row, target, required=False) if target else None)

    def answer(self, served: Served, requests: list[Request]) -> list[dict[str, Any]]:
        """Greedy targets for the sources, cut at max_length tokens as the run's tokenize stage cut them."""
        limit = served.encoding.max_length
        ids = token_ids(served.tokenizer, [request.fields["source"] for request in requests])
        texts, _, _ = generate(served.model, served.tokenizer, [seq[:limit] for seq in ids], served.max_new_tokens,
                               len(ids))
        return [{"output": text, "truncated": len(seq) > limit,
                 **({"reference": request.reference} if request.reference is not None else {})}
                for text, seq, request in zip(texts, ids, requests, strict=True)]

    def limits(self, served: Served) -> str:
        return f"targets of up to {served.max_new_tokens} tokens, sources cut at {served.encoding.max_length} tokens"


def collator(tokenizer: Tokenizer, model: Model | None) -> Collator:
    """Sources padded with the pad id, labels with IGNORE_INDEX; the model shifts labels into decoder inputs."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=IGNORE_INDEX, padding=True)


def with_end(ids: list[int], eos: int) -> list[int]:
    """The ids with the end token last; a tokenizer that appends it itself (T5's) is not given a second one."""
    return ids if ids and ids[-1] == eos else [*ids, eos]


def token_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    encoded = tokenizer(texts, add_special_tokens=True)["input_ids"]
    return [with_end(list(ids), tokenizer.eos_token_id) for ids in encoded]


def generated_metrics(tokenizer: Tokenizer) -> Callable[[EvalPrediction], dict[str, float]]:
    """Exact match and ROUGE-L of the generations an evaluation during training makes."""
    def compute(prediction: EvalPrediction) -> dict[str, float]:
        predicted = decode_padded(tokenizer, prediction.predictions)
        expected = decode_padded(tokenizer, prediction.label_ids)
        return {"exact_match": float(np.mean(exact_matches(predicted, expected))),
                "rouge_l": float(np.mean([rouge_l(p, r) for p, r in zip(predicted, expected, strict=True)]))}

    return compute


def decode_padded(tokenizer: Tokenizer, ids: Any) -> list[str]:
    ids = np.where(np.asarray(ids) == IGNORE_INDEX, tokenizer.pad_token_id, np.asarray(ids))
    return [text.strip() for text in tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)]


def padded(tokenizer: Tokenizer, model: Model, inputs: list[list[int]],
           labels: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """A batch on the model's device, right-padded."""
    tokenizer.padding_side = "right"  # labels too: decoder inputs start at the first position
    examples = [{"input_ids": ids} if labels is None else {"input_ids": ids, "labels": target}
                for ids, target in zip(inputs, labels or inputs, strict=True)]
    batch = collator(tokenizer, None)(examples)
    return {name: value.to(model.device) for name, value in batch.items() if value is not None}


def target_losses(model: Model, tokenizer: Tokenizer, encoded: dict[str, list[Any]],
                  batch_size: int) -> tuple[list[float], list[int]]:
    """Per row: the summed negative log-likelihood of its target tokens (teacher forcing), and how many there are."""
    import torch

    nll: list[float] = []
    tokens: list[int] = []
    inputs, labels = encoded["input_ids"], encoded["labels"]
    with torch.no_grad():
        for start in range(0, len(inputs), batch_size):
            batch = padded(tokenizer, model, inputs[start:start + batch_size], labels[start:start + batch_size])
            logits = model(**batch).logits
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), batch["labels"],
                                                     ignore_index=IGNORE_INDEX, reduction="none")
            nll.extend(loss.sum(dim=1).tolist())
            tokens.extend((batch["labels"] != IGNORE_INDEX).sum(dim=1).tolist())
    return nll, tokens


def generate(model: Model, tokenizer: Tokenizer, inputs: list[list[int]], max_new_tokens: int,
             batch_size: int) -> tuple[list[str], list[int], list[bool]]:
    """Greedy targets for encoded sources: the texts, their lengths in tokens, and whether each was cut at
    max_new_tokens before it ended."""
    import torch

    eos = tokenizer.eos_token_id
    texts: list[str] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    for start in range(0, len(inputs), batch_size):
        batch = padded(tokenizer, model, inputs[start:start + batch_size])
        with torch.no_grad():
            generated = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                       eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        for sequence in generated[:, 1:].tolist():  # after the decoder's start token
            length = sequence.index(eos) if eos in sequence else len(sequence)
            lengths.append(length)
            truncated.append(eos not in sequence and length >= max_new_tokens)
            texts.append(tokenizer.decode(sequence[:length], skip_special_tokens=True).strip())
    return texts, lengths, truncated


def request_columns(row: dict[str, Any]) -> tuple[str | None, str | None]:
    """Which of a predict row's columns hold the source and the reference, read as ingest reads them."""
    return (next((name for name in SOURCE_COLUMNS if name in row), None),
            next((name for name in TARGET_COLUMNS if name in row), None))
