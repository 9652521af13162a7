"""Reward models on preference pairs: one score per prompt and response, trained with TRL's RewardTrainer.

The model is a sequence classifier with one output, built here (a small decoder) or from a
pretrained model (a LoRA adapter of task SEQ_CLS trains beside a whole score head). A prompt and a
response are rendered through the chat template exactly as SFT renders an instruction and its
answer, through the end-of-turn marker, and the score is read at that last token; a sequence
longer than `tokenize.max_length` keeps its last tokens, so the score still reads the whole end of
the response. RewardTrainer learns -log sigmoid(score(chosen) - score(rejected)). Held out:
`pairwise_accuracy`, the share of pairs whose chosen answer scores strictly above the rejected one
(a tie is a miss), `score_margin`, the mean score difference (its scale is the model's own: it is
reported, never a primary), and `pair_loss`, the training loss on held-out pairs.

Asked through `llmops predict` (a pyfunc of this code: registry/flavors.py), a version scores
`{"prompt", "response"}` rows, and compares `{"prompt", "chosen", "rejected"}` rows as evaluation
did. A later stage scores with an exported version's folder: `score(model_dir, rows)`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmops.config.schema import PipelineConfig
from llmops.io.files import load_dataset_dir
from llmops.models import modeling
from llmops.objectives.base import Encoding, Objective, Request, RowError, ScoringContext, Served, answered_by_ask
from llmops.objectives.encoded import pre_encoded
from llmops.objectives.metrics import Metric, Scored, means, ratio, table
from llmops.records.preference import PREFERENCE
from llmops.records.turns import Messages, conversation, prompt_messages
from llmops.text import packing
from llmops.text.encoding import IGNORE_INDEX, response_labels
from llmops.text.templates import renderer_for

if TYPE_CHECKING:
    import pyarrow as pa
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from llmops.config.schema import ModelConfig, PipelineConfig
    from llmops.objectives.base import Model, Tokenizer

ID_COLUMNS = ("chosen_ids", "rejected_ids")
ROLES = ("system", "user", "assistant")
METRICS = table(
    Metric("pairwise_accuracy", ratio, True, "share of pairs whose chosen answer scores above the rejected one (a "
           "tie is a miss)"),
    Metric("score_margin", ratio, None, "mean score of the chosen answer minus that of the rejected one (in the "
           "model's own scale)"),
    Metric("pair_loss", ratio, False, "mean -log sigmoid(chosen score - rejected score), the training loss"))
PRIMARY = ("pairwise_accuracy", "reward model: how often it scores the chosen answer above the rejected one")


class RewardModel(Objective):
    name = "reward"
    needs_offsets = True
    kinds = (PREFERENCE,)
    summary = "a reward model: one score for a prompt and its response, trained on chosen/rejected answer pairs"
    # the Hub's pipeline tag of a sequence classifier; MLflow serves the version as a pyfunc of this code
    task = "text-classification"
    metrics = METRICS
    peft_task = "SEQ_CLS"
    peft_auto = "AutoPeftModelForSequenceClassification"
    pipeline_served = False

    # --- tokenize ------------------------------------------------------------------------------------------

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """Each pair as two sequences, prompt and answer through its end-of-turn marker, cut to their last
        `max_length` tokens."""
        sides = {answer: rendered_ids(tokenizer, [conversation(row["prompt"], row[answer]) for row in rows])
                 for answer in ("chosen", "rejected")}
        limit = encoding.max_length
        batch: dict[str, list[Any]] = {"chosen_ids": [tail(ids, limit) for ids in sides["chosen"]],
                                       "rejected_ids": [tail(ids, limit) for ids in sides["rejected"]]}
        batch["raw_length"] = [max(len(c), len(r)) for c, r in zip(sides["chosen"], sides["rejected"], strict=True)]
        batch["length"] = [min(length, limit) for length in batch["raw_length"]]
        batch["has_target"] = [True] * len(rows)
        batch["target_tokens"] = [2] * len(rows)  # a score is read at each sequence's last token
        return batch

    def arrow_schema(self) -> pa.Schema:
        import pyarrow as pa

        return pa.schema([(name, pa.list_(pa.int32())) for name in ID_COLUMNS] +
                         [("raw_length", pa.int32()), ("length", pa.int32())])

    # --- model ---------------------------------------------------------------------------------------------

    def auto_class(self) -> type:
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification

    def label_settings(self, labels: list[str]) -> dict[str, Any]:
        return {"num_labels": 1}

    def build_model(self, model_config: ModelConfig, tokenizer: Tokenizer, seed: int, labels: list[str],
                    quantize: bool = False, dtype: str | None = None) -> Model:
        model = super().build_model(model_config, tokenizer, seed, labels, quantize, dtype)
        if model.config.pad_token_id is None:
            # a sequence classifier finds each row's last token through the pad id
            model.config.pad_token_id = tokenizer.pad_token_id
        return model

    def load_trained(self, model_dir: Path) -> Model:
        """The trained model; an adapter's base keeps its own config, which may name no pad token: the saved
        tokenizer's is the one training read each row's end by."""
        model = super().load_trained(model_dir)
        config = modeling.base_of(model).config
        if config.pad_token_id is None:
            from transformers import AutoTokenizer

            config.pad_token_id = AutoTokenizer.from_pretrained(str(model_dir)).pad_token_id
        return model

    # --- train ---------------------------------------------------------------------------------------------

    def datasets(self, tokenized_dir: Path, packed: bool, max_length: int) -> tuple[Dataset, Dataset]:
        """Training pairs with their sample ids (for the ledger) and lengths (for length grouping); held-out pairs
        as they are."""
        train_set = packing.with_sample_ids(load_dataset_dir(tokenized_dir / "train"), per_token=False)
        eval_set = load_dataset_dir(tokenized_dir / "eval").select_columns(list(ID_COLUMNS))
        return train_set.select_columns([*ID_COLUMNS, "length", packing.SAMPLE_IDS]), eval_set

    def meter(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> packing.BatchMeter:
        """RewardTrainer's collator (chosen rows, then rejected rows), counted for the padding fraction and the
        ledger."""
        from trl.trainer.reward_trainer import DataCollatorForPreference

        return PairMeter(DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id))

    def arguments(self, common: dict[str, Any], config: PipelineConfig) -> TrainingArguments:
        from trl import RewardConfig

        # the tokenize stage already cut each sequence to tokenize.max_length; TRL would drop longer pairs
        return RewardConfig(**common, max_length=None)

    def trainer(self, model: Model, settings: dict[str, Any], model_config: ModelConfig, tokenizer: Tokenizer,
                seed: int) -> Trainer:
        """TRL's RewardTrainer on the encoded pairs; a LoRA adapter is already on the model (with_adapter)."""
        from trl import RewardTrainer

        return pre_encoded(RewardTrainer)(model=model, **settings)

    # --- evaluate ------------------------------------------------------------------------------------------

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return PRIMARY

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        """Per pair: whether the chosen answer scores higher, the score difference and the pair's loss; the answer
        the model prefers."""
        encoded = self.encode(tokenizer, rows, context.encoding) if rows else {name: [] for name in ID_COLUMNS}
        found = sequence_scores(model, [*encoded["chosen_ids"], *encoded["rejected_ids"]], tokenizer.pad_token_id,
                                context.settings.batch_size)
        chosen, rejected = found[:len(rows)], found[len(rows):]
        return Scored(pair_parts(chosen, rejected), ["chosen" if c > r else "rejected" for c, r in
                                                     zip(chosen, rejected, strict=True)], self.metrics)

    # --- register ------------------------------------------------------------------------------------------

    def request_example(self) -> dict[str, Any]:
        return {"prompt": "Write this number in words.\n\n42", "response": "forty-two"}

    def limitations(self, config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
        return ["A score has no unit: compare the scores of responses to the same prompt, not scores across prompts "
                "or across versions.",
                f"It ranks answers like the held-out pairs ({metrics.get('pairwise_accuracy', math.nan):.0%} of them "
                "ranked right); answers unlike its training pairs get scores nobody has checked."]

    # --- predict -------------------------------------------------------------------------------------------

    def request(self, line: int, row: dict[str, Any], served: Served) -> Request:
        if "prompt" not in row or not {"response", "chosen", "rejected"} & set(row):
            raise RowError("expected fields prompt and response (or prompt, chosen and rejected); got "
                           f"{', '.join(sorted(row)) or 'an empty object'}")
        prompt = prompt_turns(row["prompt"])
        if "response" in row:
            return Request(line, "score", {"conversations": [conversation(prompt, response_text(row, "response"))]})
        return Request(line, "compare", {"conversations": [conversation(prompt, response_text(row, side))
                                                           for side in ("chosen", "rejected")]})

    def answer(self, served: Served, requests: list[Request]) -> list[dict[str, Any]]:
        return answered_by_ask(served, requests, {"score": scored_answers, "compare": compared_answers})

    def limits(self, served: Served) -> str:
        return f"prompt and response cut to their last {served.encoding.max_length} tokens"


class PairMeter(packing.BatchMeter):
    """Counts both sequences of a pair: the collator makes a row of each."""

    def measure(self, examples: list[dict[str, Any]]) -> tuple[Any, packing.BatchFigures]:
        batch = self.collate([{name: example[name] for name in ID_COLUMNS} for example in examples])
        real = sum(len(example[name]) for example in examples for name in ID_COLUMNS)
        return batch, packing.BatchFigures(real=real, slots=int(batch["input_ids"].numel()))


# --- scoring, shared by evaluation, predict and later stages ---------------------------------------------------

def rendered_ids(tokenizer: Tokenizer, conversations: list[Messages]) -> list[list[int]]:
    """Each conversation's token ids through the chat template, as SFT renders it, ending with the answer's
    end-of-turn marker (a template's text after the marker is left out: the score reads the marker)."""
    render = renderer_for(tokenizer)
    rendered = [render(messages) for messages in conversations]
    encodings = tokenizer.backend_tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
    sequences = []
    for item, (_, spans) in zip(encodings, rendered, strict=True):
        labels = response_labels(item, item.ids, spans[-1:])
        last = max((i for i, label in enumerate(labels) if label != IGNORE_INDEX), default=len(item.ids) - 1)
        sequences.append(list(item.ids[:last + 1]))
    return sequences


def tail(ids: list[int], limit: int | None) -> list[int]:
    """The last `limit` tokens: the end of the answer is where the score is read."""
    return ids[-limit:] if limit and len(ids) > limit else ids


def sequence_scores(model: Model, sequences: list[list[int]], pad_token_id: int, batch_size: int) -> list[float]:
    """The model's one output for each sequence, in batches padded on the right."""
    import torch

    found: list[float] = []
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start:start + batch_size]
            width = max(len(ids) for ids in chunk)
            ids = torch.tensor([row + [pad_token_id] * (width - len(row)) for row in chunk])
            mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in chunk])
            batch = modeling.on_device({"input_ids": ids, "attention_mask": mask}, model)
            found.extend(model(**batch).logits.float()[:, 0].tolist())
    return found


def pair_parts(chosen: list[float], rejected: list[float]) -> dict[str, np.ndarray]:
    """Per-pair parts of the metrics: a hit when chosen scores strictly higher, the difference, -log sigmoid of it."""
    differences = [c - r for c, r in zip(chosen, rejected, strict=True)]
    return {"pairwise_accuracy": means([float(d > 0) for d in differences]),
            "score_margin": means(differences),
            "pair_loss": means([float(np.logaddexp(0.0, -d)) for d in differences])}


def prompt_turns(value: Any) -> Messages:
    """A prediction row's prompt as chat turns, or RowError saying why it is not one."""
    if isinstance(value, str) and value.strip():
        return prompt_messages(value)
    if isinstance(value, str):
        raise RowError("prompt: empty or only whitespace")
    if not isinstance(value, list) or not value:
        raise RowError("prompt: expected text or a non-empty list of {role, content} turns"
                       + (f", got {type(value).__name__}" if value is not None else ", got nothing"))
    for number, turn in enumerate(value, 1):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise RowError(f"prompt: turn {number} is not a {{role: {'|'.join(ROLES)}, content: string}}")
    if value[-1]["role"] != "user":
        raise RowError("prompt: the last turn must be the user's (the response answers it)")
    return prompt_messages(value)


def response_text(row: dict[str, Any], name: str) -> str:
    """An answer field: text, or one assistant turn."""
    value = row.get(name)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict) and \
            value[0].get("role") == "assistant":
        value = value[0].get("content")
    if not isinstance(value, str):
        raise RowError(f"{name}: expected text or one assistant turn, got "
                       f"{'nothing' if value is None else type(value).__name__}")
    if not value.strip():
        raise RowError(f"{name}: empty or only whitespace")
    return value


def scored_sequences(served: Served, conversations: list[Messages]) -> tuple[list[float], list[bool]]:
    """Scores of conversations as the version's evaluation read them, and which were cut."""
    sequences = rendered_ids(served.tokenizer, conversations)
    limit = served.encoding.max_length
    found = sequence_scores(served.model, [tail(ids, limit) for ids in sequences], served.tokenizer.pad_token_id,
                            max(len(sequences), 1))
    return found, [len(ids) > limit for ids in sequences]


def scored_answers(served: Served, requests: list[Request]) -> list[dict[str, Any]]:
    found, cut = scored_sequences(served, [r.fields["conversations"][0] for r in requests])
    return [{"score": value, "truncated": truncated} for value, truncated in zip(found, cut, strict=True)]


def compared_answers(served: Served, requests: list[Request]) -> list[dict[str, Any]]:
    """Both answers' scores, and which the version prefers (as evaluation counted a hit)."""
    found, cut = scored_sequences(served, [c for r in requests for c in r.fields["conversations"]])
    return [{"chosen_score": found[2 * i], "rejected_score": found[2 * i + 1],
             "preferred": "chosen" if found[2 * i] > found[2 * i + 1] else "rejected",
             "truncated": cut[2 * i] or cut[2 * i + 1]} for i in range(len(requests))]


def load(model_dir: str | Path) -> tuple[Model, Tokenizer]:
    """A reward model and its tokenizer from a folder: an exported version (`llmops models export`, or a registered
    version resolved with registry/bases.py's `local_folder`) or a train stage's `model/` folder."""
    from transformers import AutoTokenizer

    folder = Path(model_dir)
    model = modeling.place(RewardModel(PREFERENCE).load_trained(folder)).eval()
    return model, AutoTokenizer.from_pretrained(str(folder))


def score(model_dir: str | Path, rows: list[dict[str, Any]], max_length: int | None = None,
          batch_size: int = 32) -> list[float]:
    """The reward model's score of each `{"prompt", "response"}` row (a prompt is text or chat turns ending with a
    user turn), as `llmops predict` scores it; `max_length` cuts each sequence to its last tokens (pass the run's
    tokenize.max_length to match its evaluation). A malformed row raises RowError."""
    model, tokenizer = load(model_dir)
    return scores_of(model, tokenizer, rows, max_length, batch_size)


def scores_of(model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], max_length: int | None = None,
              batch_size: int = 32) -> list[float]:
    """`score` with the model already loaded (`load`), for a caller that scores many batches."""
    conversations = [conversation(prompt_turns(row.get("prompt")), response_text(row, "response")) for row in rows]
    sequences = [tail(ids, max_length) for ids in rendered_ids(tokenizer, conversations)]
    return sequence_scores(model, sequences, tokenizer.pad_token_id, batch_size) if sequences else []
