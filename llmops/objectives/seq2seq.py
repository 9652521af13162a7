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

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np

from llmops.core.config import EvaluateConfig, ModelConfig

IGNORE_INDEX = -100
TASK = "text2text-generation"
# the column names public datasets give a source and a target, tried in this order when data.sources[].columns
# does not name them (the first one present wins): plain pairs, instruction-style, summarization (XSum,
# CNN/DailyMail) and question answering
SOURCE_COLUMNS = ("source", "input", "document", "article", "question", "text")
TARGET_COLUMNS = ("target", "output", "summary", "highlights", "answer")


# --- ingest and dedup ----------------------------------------------------------------------------------------


def record_fields(row: dict[str, Any]) -> list[str]:
    return [row["source"], row["target"]]


# --- tokenize ------------------------------------------------------------------------------------------------


def with_end(ids: list[int], eos: int) -> list[int]:
    """The ids with the end token last; a tokenizer that appends it itself (T5's) is not given a second one."""
    return ids if ids and ids[-1] == eos else [*ids, eos]


def token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    encoded = tokenizer(texts, add_special_tokens=True)["input_ids"]
    return [with_end(list(ids), tokenizer.eos_token_id) for ids in encoded]


def encode(tokenizer: Any, rows: list[dict[str, Any]], max_length: int) -> dict[str, list[Any]]:
    """Source ids as the input, target ids as the labels, each cut at `max_length` tokens."""
    sources = token_ids(tokenizer, [row["source"] for row in rows])
    targets = token_ids(tokenizer, [row["target"] for row in rows])
    inputs = [ids[:max_length] for ids in sources]
    labels = [ids[:max_length] for ids in targets]
    # a row counts as truncated when either side was cut
    return {"input_ids": inputs, "labels": labels,
            "raw_length": [max(len(s), len(t)) for s, t in zip(sources, targets, strict=True)],
            "length": [len(ids) for ids in inputs], "has_target": [bool(ids) for ids in labels]}


# --- model ---------------------------------------------------------------------------------------------------


class ArchitectureError(ValueError):
    """The configured model cannot read a source and write a target."""


def check_model(model_config: ModelConfig) -> None:
    if not model_config.name_or_path and model_config.architecture != "t5":
        raise ArchitectureError(
            f"data.kind=seq2seq needs an encoder-decoder: set model.architecture=t5 (got "
            f"{model_config.architecture}), or model.name_or_path to a pretrained seq2seq model")


def scratch_config(model_config: ModelConfig, tokenizer: Any) -> Any:
    """A small T5: the decoder starts from the pad token, as T5 does, and stops at the tokenizer's end token."""
    from transformers import T5Config

    hidden, heads = model_config.hidden_size, model_config.num_heads
    return T5Config(vocab_size=len(tokenizer), d_model=hidden, d_kv=max(1, hidden // heads),
                    d_ff=model_config.intermediate_size or 4 * hidden, num_layers=model_config.num_layers,
                    num_decoder_layers=model_config.num_layers, num_heads=heads, feed_forward_proj="relu",
                    # no dropout, as the decoder-only models built here: small models on small data learn faster
                    dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                    decoder_start_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)


# --- train ---------------------------------------------------------------------------------------------------


def collator(tokenizer: Any, model: Any) -> Any:
    """Sources padded with the pad id, labels with -100; the model shifts labels into decoder inputs."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=IGNORE_INDEX, padding=True)


def training_arguments(common: dict[str, Any]) -> Any:
    """Evaluations during training (train.eval_steps) generate greedily, so they report exact match and ROUGE-L."""
    from transformers import Seq2SeqTrainingArguments

    return Seq2SeqTrainingArguments(**common, predict_with_generate=True, generation_num_beams=1)


def trainer_settings(tokenizer: Any) -> tuple[Any, dict[str, Any]]:
    from transformers import Seq2SeqTrainer

    return Seq2SeqTrainer, {"compute_metrics": generated_metrics(tokenizer)}


def generated_metrics(tokenizer: Any) -> Callable[[Any], dict[str, float]]:
    """Exact match and ROUGE-L of the generations an evaluation during training makes."""
    from llmops.core import metrics

    def compute(prediction: Any) -> dict[str, float]:
        predicted = decode_padded(tokenizer, prediction.predictions)
        expected = decode_padded(tokenizer, prediction.label_ids)
        return {"exact_match": float(np.mean(metrics.exact_matches(predicted, expected))),
                "rouge_l": float(np.mean([metrics.rouge_l(p, r) for p, r in zip(predicted, expected, strict=True)]))}

    return compute


def decode_padded(tokenizer: Any, ids: Any) -> list[str]:
    ids = np.where(np.asarray(ids) == IGNORE_INDEX, tokenizer.pad_token_id, np.asarray(ids))
    return [text.strip() for text in tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)]


# --- evaluate ------------------------------------------------------------------------------------------------


def score(model: Any, tokenizer: Any, rows: list[dict[str, Any]], settings: EvaluateConfig,
          max_length: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """Every generative metric, per example: the target tokens' loss, and greedy generations against the target."""
    from llmops.core import metrics

    encoded = encode(tokenizer, rows, max_length) if rows else {"input_ids": [], "labels": []}
    nll, tokens = target_losses(model, tokenizer, encoded, settings.batch_size)
    texts, lengths, truncated = generate(model, tokenizer, encoded["input_ids"], settings.max_new_tokens,
                                         settings.batch_size)
    parts = {**metrics.likelihood_parts(nll, tokens, "completion_"),
             **metrics.generation_parts(texts, [row["target"] for row in rows], lengths, truncated)}
    return parts, texts


def padded(tokenizer: Any, model: Any, inputs: list[list[int]], labels: list[list[int]] | None = None) -> Any:
    """A batch on the model's device (the data stages import this module: it imports no model code of its own)."""
    tokenizer.padding_side = "right"  # labels too: decoder inputs start at the first position
    examples = [{"input_ids": ids} if labels is None else {"input_ids": ids, "labels": target}
                for ids, target in zip(inputs, labels or inputs, strict=True)]
    batch = collator(tokenizer, None)(examples)
    return {name: value.to(model.device) for name, value in batch.items() if value is not None}


def target_losses(model: Any, tokenizer: Any, encoded: dict[str, list[Any]],
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


def generate(model: Any, tokenizer: Any, inputs: list[list[int]], max_new_tokens: int,
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


def sample(row: dict[str, Any]) -> dict[str, Any]:
    return {"source": row["source"], "reference": row["target"]}


# --- register and predict ------------------------------------------------------------------------------------


def pipeline(model: Any, tokenizer: Any) -> Any:
    """The version as MLflow logs it: a text2text-generation pipeline over the model and tokenizer. The installed
    transformers no longer builds that task by name, so the pipeline is made here; what MLflow stores (weights,
    tokenizer, the task) is what `mlflow.transformers.load_model(..., return_type="components")` gives back."""
    return pipeline_class()(model=model, tokenizer=tokenizer, task=TASK, device=model.device)


@functools.cache
def pipeline_class() -> type:
    from transformers import Pipeline

    class Text2TextGenerationPipeline(Pipeline):
        """Greedy generation from a source text: [{"generated_text": ...}] per input."""

        def _sanitize_parameters(self, **settings: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
            return {}, settings, {}

        def preprocess(self, text: str) -> dict[str, Any]:
            ids = token_ids(self.tokenizer, [text])
            return {"input_ids": self.tokenizer.pad({"input_ids": ids}, return_tensors="pt")["input_ids"]}

        def _forward(self, inputs: dict[str, Any], **settings: Any) -> dict[str, Any]:
            return {"ids": self.model.generate(**inputs, do_sample=False, **settings)}

        def postprocess(self, outputs: dict[str, Any]) -> list[dict[str, str]]:
            text = self.tokenizer.decode(outputs["ids"][0], skip_special_tokens=True).strip()
            return [{"generated_text": text}]

    return Text2TextGenerationPipeline


def request_columns(row: dict[str, Any]) -> tuple[str | None, str | None]:
    """Which of a predict row's columns hold the source and the reference, read as ingest reads them."""
    return (next((name for name in SOURCE_COLUMNS if name in row), None),
            next((name for name in TARGET_COLUMNS if name in row), None))


def answer(model: Any, tokenizer: Any, sources: list[str], max_length: int,
           max_new_tokens: int) -> list[dict[str, Any]]:
    """Greedy targets for source texts, cut at max_length tokens as the run's tokenize stage cut them."""
    ids = token_ids(tokenizer, sources)
    texts, _, _ = generate(model, tokenizer, [seq[:max_length] for seq in ids], max_new_tokens, len(ids))
    return [{"output": text, "truncated": len(seq) > max_length} for text, seq in zip(texts, ids, strict=True)]


# --- example data --------------------------------------------------------------------------------------------


def pair_records(skill: Callable[[random.Random], dict[str, str]], rows: int, seed: int) -> list[dict[str, str]]:
    """A skill of llmops/data/synthetic.py as pairs, its input the source and its output the target: for the number
    skill, source "4211", target "four thousand two hundred eleven"."""
    rng = random.Random(seed)
    return [{"source": record["input"], "target": record["output"]} for record in
            (skill(rng) for _ in range(rows))]
