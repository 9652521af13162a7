"""Masked language modelling: encoders (BERT, RoBERTa) trained to restore hidden tokens of plain text.

Training hides 15% of each row's tokens afresh in every batch (transformers'
DataCollatorForLanguageModeling: 80% become the mask token, 10% a random token, 10% stay), and the
loss is on the hidden positions only. Held-out rows are scored on a fixed mask instead: each row's
positions are drawn by a generator seeded with a hash of its text, and every chosen position becomes
the mask token. So the trained model, its untrained twin and a champion re-scored later all see the
same hidden positions of the same row (given the same tokenizer), and the masked-token accuracy and
loss pair up example by example.

A tokenizer trained here is the byte-level BPE tokenizer of the other objectives (one trainer, no
unknown tokens, digits single tokens) with a class token and a mask token added; a post-processor
frames every text as `<|cls|> text <|end|>`, so the fill-mask pipeline and the tokenize stage encode
alike. The mask token strips the space before it, as the tokens it stands for carry their leading
space.
"""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING, Any

import numpy as np

from llmops.config.schema import ModelConfig
from llmops.models import modeling
from llmops.objectives.base import (
    Encoding,
    Objective,
    ObjectiveError,
    Request,
    RowError,
    ScoringContext,
    Served,
    padded,
    string_field,
)
from llmops.objectives.metrics import Metric, Scored, exp_ratio, likelihood_parts, ratio, table
from llmops.records.base import TEXT
from llmops.text.encoding import IGNORE_INDEX
from llmops.text.tokenizers import CLS, MASK, train_encoder_bpe

if TYPE_CHECKING:
    from collections.abc import Iterable

    from llmops.objectives.base import Collator, Model, Tokenizer

CLS_TOKEN, MASK_TOKEN = CLS, MASK
# written in a predict row in place of the model's own mask token
MASK_PLACEHOLDER = "[MASK]"
MLM_PROBABILITY = 0.15
# the per-row seed of the held-out mask: a hash of this and the row's text
EVAL_MASK_SALT = "llmops-masked-lm-eval"
TOP_K = 5

METRICS = table(Metric("masked_accuracy", ratio, True, "share of the held-out mask's hidden tokens restored (top-1)"),
                Metric("masked_loss", ratio, False,
                       "mean negative log-likelihood of the held-out mask's hidden tokens"),
                Metric("masked_perplexity", exp_ratio, False, "exp of the masked-token loss"))


class MaskedLM(Objective):
    name = "masked_lm"
    kinds = (TEXT,)
    summary = "masked language modelling (15% of tokens hidden in each batch, loss on those only)"
    task = "fill-mask"
    metrics = METRICS
    architectures = ("bert", "roberta")
    # an adapter of an encoder's masked-LM head is not a use anyone has: full fine-tuning
    adapters = ("none",)

    # --- tokenizer -----------------------------------------------------------------------------------------

    def train_tokenizer(self, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """The shared byte-level BPE tokenizer with class and mask tokens, framing each text as CLS ... END."""
        return train_encoder_bpe(texts, vocab_size)

    def check_tokenizer(self, tokenizer: Tokenizer, source: str) -> None:
        super().check_tokenizer(tokenizer, source)
        if getattr(tokenizer, "mask_token", None) is None or tokenizer.mask_token_id is None:
            raise ObjectiveError(f"tokenizer {source} has no mask token, which data.objective=masked_lm needs: set "
                                 "tokenize.tokenizer (or model.name_or_path) to an encoder's tokenizer such as bert's "
                                 "or roberta's, or leave both unset to train one here")

    # --- model ---------------------------------------------------------------------------------------------

    def auto_class(self) -> type:
        from transformers import AutoModelForMaskedLM

        return AutoModelForMaskedLM

    def check_model(self, model_config: ModelConfig) -> None:
        """A pretrained base must have a masked-LM head: a decoder-only model has none."""
        if not model_config.name_or_path:
            return
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

        config = modeling.pretrained_config(model_config)
        if config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES or getattr(config, "is_decoder", False):
            raise ObjectiveError(f"model.name_or_path={model_config.name_or_path} is a {config.model_type} model "
                                 "without a masked-LM head (decoder-only): data.objective=masked_lm needs an encoder "
                                 "such as bert or roberta, or set data.objective=causal_lm")

    # --- encoding and training -----------------------------------------------------------------------------

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """Token ids framed by the tokenizer's own special tokens; labels are the ids wherever a token may be hidden
        and IGNORE_INDEX on the special tokens. A long row keeps its closing special token."""
        encoded = tokenizer([row["text"] for row in rows], add_special_tokens=True, return_special_tokens_mask=True)
        ids_out, labels_out, raw = [], [], []
        for ids, special in zip(encoded["input_ids"], encoded["special_tokens_mask"], strict=True):
            raw.append(len(ids))
            if len(ids) > encoding.max_length:
                keep = encoding.max_length - 1
                ids, special = ids[:keep] + ids[-1:], special[:keep] + special[-1:]
            ids_out.append(list(ids))
            labels_out.append([IGNORE_INDEX if flag else token for token, flag in zip(ids, special, strict=True)])
        return {"input_ids": ids_out, "labels": labels_out, "raw_length": raw,
                "length": [len(ids) for ids in ids_out],
                "has_target": [any(label != IGNORE_INDEX for label in labels) for labels in labels_out]}

    def collator(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> Collator:
        return MaskingCollator(tokenizer, seed)

    # --- evaluation ----------------------------------------------------------------------------------------

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return "masked_accuracy", ("masked LM: the share of hidden held-out tokens restored, what a fill-mask user "
                                   "sees first; bounded and read without a tokenizer's vocabulary size in mind")

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        """Per row: (masked tokens restored, masked tokens) and (their summed negative log-likelihood, masked
        tokens); and the row's text with the model's top-1 fills in brackets."""
        import torch

        hits, nll, counts, filled = [], [], [], []
        masked = self.eval_batch(tokenizer, rows, context.encoding) if rows else []
        batch_size = context.settings.batch_size
        with torch.no_grad():
            for start in range(0, len(masked), batch_size):
                chunk = masked[start:start + batch_size]
                batch = modeling.on_device({"input_ids": padded([ids for ids, _ in chunk], tokenizer.pad_token_id),
                                            "attention_mask": padded([[1] * len(ids) for ids, _ in chunk], 0)}, model)
                logits = model(**batch).logits
                targets = padded([labels for _, labels in chunk], IGNORE_INDEX).to(logits.device)
                counted = targets != IGNORE_INDEX
                # only the hidden positions' distributions: a full [rows, length, vocabulary] copy is large
                picked, wanted = logits[counted].float(), targets[counted]
                row_of = counted.nonzero()[:, 0]
                per_row = torch.zeros(2, len(chunk), device=logits.device)
                per_row[0].index_add_(0, row_of, (picked.argmax(-1) == wanted).float())
                per_row[1].index_add_(0, row_of, torch.nn.functional.cross_entropy(picked, wanted, reduction="none"))
                hits.extend(per_row[0].tolist())
                nll.extend(per_row[1].tolist())
                counts.extend(counted.sum(-1).tolist())
                chosen = logits.argmax(-1).tolist()
                filled.extend(shown_fills(tokenizer, ids, labels, chosen[row])
                              for row, (ids, labels) in enumerate(chunk))
        parts = {"masked_accuracy": np.column_stack([np.asarray(hits, float), np.asarray(counts, float)])
                 if hits else np.zeros((0, 2)), **likelihood_parts(nll, counts, "masked_")}
        return Scored(parts, filled, self.metrics)

    def eval_batch(self, tokenizer: Tokenizer, rows: list[dict[str, Any]],
                   encoding: Encoding) -> list[tuple[list[int], list[int]]]:
        """Each row's input with its held-out positions replaced by the mask token, and labels on those only."""
        encoded = self.encode(tokenizer, rows, encoding)
        masked = []
        for row, ids, labels in zip(rows, encoded["input_ids"], encoded["labels"], strict=True):
            positions = eval_positions(row["text"], [i for i, label in enumerate(labels) if label != IGNORE_INDEX])
            inputs, targets = list(ids), [IGNORE_INDEX] * len(ids)
            for position in positions:
                inputs[position], targets[position] = tokenizer.mask_token_id, ids[position]
            masked.append((inputs, targets))
        return masked

    # --- register and predict ------------------------------------------------------------------------------

    def serving_body(self) -> dict[str, Any]:
        """The fill-mask pipeline reads the tokenizer's own mask token (`llmops predict` also reads [MASK])."""
        return {"inputs": ["The bridge over the river opened on 3 <the tokenizer's mask token> 1990."]}

    def usage(self) -> str:
        return ('pipe = mlflow.transformers.load_model(uri)  # a fill-mask pipeline\n'
                'print(pipe(f"some {pipe.tokenizer.mask_token} text"))')

    def request(self, line: int, row: dict[str, Any], served: Served) -> Request:
        """A text holding the model's mask token, or [MASK] written in its place."""
        mask_token = served.tokenizer.mask_token
        text = string_field(row, "text")
        text = text.replace(MASK_PLACEHOLDER, mask_token) if mask_token != MASK_PLACEHOLDER else text
        if mask_token not in text:
            raise RowError(f"text: no masked position to fill: write {mask_token} (or {MASK_PLACEHOLDER}) where a "
                           "token is to be filled")
        return Request(line, "fill_mask", {"text": text})

    def answer(self, served: Served, requests: list[Request]) -> list[dict[str, Any]]:
        return fill(served.model, served.tokenizer, [r.fields["text"] for r in requests], served.encoding.max_length)

    def limits(self, served: Served) -> str:
        marks = f"{served.tokenizer.mask_token} or {MASK_PLACEHOLDER}"
        return f"top {TOP_K} fills of each {marks}, texts cut at {served.encoding.max_length} tokens"


class MaskingCollator:
    """Rows of the tokenize stage to a masked batch: transformers' 80/10/10 masking of 15% of the positions the
    stored labels mark as maskable (never a special token or padding), loss on the masked positions only."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        from transformers import DataCollatorForLanguageModeling

        self.collate = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=MLM_PROBABILITY,
                                                       seed=seed)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        features = [{"input_ids": list(example["input_ids"]),
                     "special_tokens_mask": [int(label == IGNORE_INDEX) for label in example["labels"]]}
                    for example in examples]
        return self.collate(features)


def eval_positions(text: str, maskable: list[int]) -> list[int]:
    """The held-out mask of one row: 15% of its maskable positions (at least one), drawn by a generator seeded
    with the row's text, so every model scored on the row sees the same positions."""
    if not maskable:
        return []
    seed = int.from_bytes(hashlib.sha256(f"{EVAL_MASK_SALT}\n{text}".encode()).digest()[:8], "big")
    count = max(1, round(MLM_PROBABILITY * len(maskable)))
    return sorted(random.Random(seed).sample(maskable, count))


def shown_fills(tokenizer: Tokenizer, ids: list[int], labels: list[int], chosen: list[int]) -> str:
    """The row as text, each hidden token replaced by the model's choice in brackets."""
    special = set(tokenizer.all_special_ids)
    pieces = []
    for position, (token, label) in enumerate(zip(ids, labels, strict=True)):
        original = tokenizer.decode([label if label != IGNORE_INDEX else token])
        if label != IGNORE_INDEX:
            space = " " if original.startswith(" ") else ""
            pieces.append(f"{space}[{tokenizer.decode([chosen[position]]).strip()}]")
        elif token not in special:
            pieces.append(original)
    return " ".join("".join(pieces).split())


def fill(model: Model, tokenizer: Tokenizer, texts: list[str], max_length: int,
         top_k: int = TOP_K) -> list[dict[str, Any]]:
    """For each text: the top-k fills of every masked position with their probabilities, and the text with the
    top-1 fills in place."""
    import torch

    encoded = tokenizer(texts, add_special_tokens=True)["input_ids"]
    cut = [len(ids) > max_length for ids in encoded]
    encoded = [ids if len(ids) <= max_length else ids[:max_length - 1] + ids[-1:] for ids in encoded]
    batch = modeling.on_device({"input_ids": padded(encoded, tokenizer.pad_token_id),
                                "attention_mask": padded([[1] * len(ids) for ids in encoded], 0)}, model)
    with torch.no_grad():
        logits = model(**batch).logits
    answers = []
    for row, ids in enumerate(encoded):
        positions = [i for i, token in enumerate(ids) if token == tokenizer.mask_token_id]
        masks, best = [], list(ids)
        for position in positions:
            top = logits[row, position].float().softmax(-1).cpu().topk(top_k)
            masks.append({"position": position, "fills": [
                {"token": tokenizer.decode([token]), "token_id": int(token), "probability": float(p)}
                for p, token in zip(top.values.tolist(), top.indices.tolist(), strict=True)]})
            best[position] = int(top.indices[0])
        answers.append({"masks": masks, "filled": tokenizer.decode(best, skip_special_tokens=True).strip(),
                        "truncated": cut[row]})
    return answers
