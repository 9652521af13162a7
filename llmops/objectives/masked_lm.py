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
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from llmops.core.config import ModelConfig

IGNORE_INDEX = -100
CLS_TOKEN, MASK_TOKEN = "<|cls|>", "<|mask|>"
# closes a text, as `<|end|>` closes a causal LM's text
SEP_TOKEN = "<|end|>"
# written in a predict row in place of the model's own mask token
MASK_PLACEHOLDER = "[MASK]"
MLM_PROBABILITY = 0.15
# the per-row seed of the held-out mask: a hash of this and the row's text
EVAL_MASK_SALT = "llmops-masked-lm-eval"
TOP_K = 5


class MaskedLMError(ValueError):
    """A model or tokenizer cannot do masked language modelling: one line naming the setting to change."""


class NoMaskError(ValueError):
    """A predict row has no masked position to fill."""


# --- tokenizer ---------------------------------------------------------------------------------------------


def train_tokenizer(train_file: Path, vocab_size: int) -> Any:
    """The shared byte-level BPE tokenizer with class and mask tokens, framing each text as CLS ... END."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    from llmops.data.tokenize import SPECIAL_TOKENS, train_core

    mask = AddedToken(MASK_TOKEN, lstrip=True, special=True)
    core = train_core(train_file, "text", vocab_size, [*SPECIAL_TOKENS, CLS_TOKEN, mask])
    cls_id, sep_id = core.token_to_id(CLS_TOKEN), core.token_to_id(SEP_TOKEN)
    core.post_processor = processors.TemplateProcessing(
        single=f"{CLS_TOKEN} $A {SEP_TOKEN}", pair=f"{CLS_TOKEN} $A {SEP_TOKEN} $B {SEP_TOKEN}",
        special_tokens=[(CLS_TOKEN, cls_id), (SEP_TOKEN, sep_id)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token=SEP_TOKEN,
                                   cls_token=CLS_TOKEN, sep_token=SEP_TOKEN, mask_token=MASK_TOKEN)


def check_tokenizer(tokenizer: Any, source: str) -> None:
    if getattr(tokenizer, "mask_token", None) is None or tokenizer.mask_token_id is None:
        raise MaskedLMError(f"tokenizer {source} has no mask token, which data.objective=masked_lm needs: set "
                            "tokenize.tokenizer (or model.name_or_path) to an encoder's tokenizer such as bert's or "
                            "roberta's, or leave both unset to train one here")


# --- model -------------------------------------------------------------------------------------------------


def check_model(model_config: ModelConfig) -> None:
    """Masked LM trains an encoder, fully: a scratch decoder or an adapter is refused in one line."""
    if model_config.adapter != "none":
        raise MaskedLMError(f"model.adapter={model_config.adapter} is not supported with data.objective=masked_lm: "
                            "set model.adapter=none (full fine-tuning)")
    if model_config.name_or_path:
        check_pretrained(model_config)
    elif model_config.architecture not in ("bert", "roberta"):
        raise MaskedLMError(f"data.objective=masked_lm trains an encoder: set model.architecture to bert or roberta "
                            f"(got {model_config.architecture}, decoder-only), or model.name_or_path to a pretrained "
                            "encoder")


def check_pretrained(model_config: ModelConfig) -> None:
    """A pretrained base must have a masked-LM head: a decoder-only model has none."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    from llmops.models.modeling import remote_code_refused

    name = model_config.name_or_path
    with remote_code_refused(name):
        config = AutoConfig.from_pretrained(name, revision=model_config.revision,
                                            trust_remote_code=model_config.trust_remote_code)
    if config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES or getattr(config, "is_decoder", False):
        raise MaskedLMError(f"model.name_or_path={name} is a {config.model_type} model without a masked-LM head "
                            "(decoder-only): data.objective=masked_lm needs an encoder such as bert or roberta, or "
                            "set data.objective=causal_lm")


def saved_as_masked_lm(model_dir: Path) -> bool:
    """Whether a saved model folder holds a masked-LM head (its config names a ...ForMaskedLM class)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    architectures = json.loads(path.read_text()).get("architectures") or []
    return any(name.endswith("ForMaskedLM") for name in architectures)


# --- encoding and training ---------------------------------------------------------------------------------


def encode(tokenizer: Any, rows: list[dict[str, Any]], max_length: int) -> dict[str, list[Any]]:
    """Token ids framed by the tokenizer's own special tokens; labels are the ids wherever a token may be hidden
    and -100 on the special tokens. A long row keeps its closing special token."""
    encoded = tokenizer([row["text"] for row in rows], add_special_tokens=True, return_special_tokens_mask=True)
    ids_out, labels_out, raw = [], [], []
    for ids, special in zip(encoded["input_ids"], encoded["special_tokens_mask"], strict=True):
        raw.append(len(ids))
        if len(ids) > max_length:
            ids, special = ids[:max_length - 1] + ids[-1:], special[:max_length - 1] + special[-1:]
        ids_out.append(list(ids))
        labels_out.append([IGNORE_INDEX if flag else token for token, flag in zip(ids, special, strict=True)])
    return {"input_ids": ids_out, "labels": labels_out, "raw_length": raw,
            "length": [len(ids) for ids in ids_out],
            "has_target": [any(label != IGNORE_INDEX for label in labels) for labels in labels_out]}


class MaskingCollator:
    """Rows of the tokenize stage to a masked batch: transformers' 80/10/10 masking of 15% of the positions the
    stored labels mark as maskable (never a special token or padding), loss on the masked positions only."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        from transformers import DataCollatorForLanguageModeling

        self.collate = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=MLM_PROBABILITY,
                                                       seed=seed)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        features = [{"input_ids": list(example["input_ids"]),
                     "special_tokens_mask": [int(label == IGNORE_INDEX) for label in example["labels"]]}
                    for example in examples]
        return self.collate(features)


# --- evaluation --------------------------------------------------------------------------------------------


def eval_positions(text: str, maskable: list[int]) -> list[int]:
    """The held-out mask of one row: 15% of its maskable positions (at least one), drawn by a generator seeded
    with the row's text, so every model scored on the row sees the same positions."""
    if not maskable:
        return []
    seed = int.from_bytes(hashlib.sha256(f"{EVAL_MASK_SALT}\n{text}".encode()).digest()[:8], "big")
    count = max(1, round(MLM_PROBABILITY * len(maskable)))
    return sorted(random.Random(seed).sample(maskable, count))


def eval_batch(tokenizer: Any, rows: list[dict[str, Any]], max_length: int) -> list[tuple[list[int], list[int]]]:
    """Each row's input with its held-out positions replaced by the mask token, and labels on those only."""
    encoded = encode(tokenizer, rows, max_length)
    masked = []
    for row, ids, labels in zip(rows, encoded["input_ids"], encoded["labels"], strict=True):
        positions = eval_positions(row["text"], [i for i, label in enumerate(labels) if label != IGNORE_INDEX])
        inputs, targets = list(ids), [IGNORE_INDEX] * len(ids)
        for position in positions:
            inputs[position], targets[position] = tokenizer.mask_token_id, ids[position]
        masked.append((inputs, targets))
    return masked


def padded(rows: list[list[int]], value: int) -> Any:
    import torch

    width = max(len(row) for row in rows)
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])


def score(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_length: int,
          batch_size: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """Per row: (masked tokens restored, masked tokens) and (their summed negative log-likelihood, masked
    tokens); and the row's text with the model's top-1 fills in brackets."""
    import torch

    from llmops.core import metrics
    from llmops.models import modeling

    hits, nll, counts, filled = [], [], [], []
    masked = eval_batch(tokenizer, rows, max_length) if rows else []
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
            filled.extend(shown_fills(tokenizer, ids, labels, chosen[row]) for row, (ids, labels) in enumerate(chunk))
    parts = {"masked_accuracy": np.column_stack([np.asarray(hits, float), np.asarray(counts, float)])
             if hits else np.zeros((0, 2)), **metrics.likelihood_parts(nll, counts, "masked_")}
    return parts, filled


def shown_fills(tokenizer: Any, ids: list[int], labels: list[int], chosen: list[int]) -> str:
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


# --- predict -----------------------------------------------------------------------------------------------


def request_text(text: str, mask_token: str) -> str:
    """A predict row's text with the placeholder [MASK] written as the model's own mask token."""
    text = text.replace(MASK_PLACEHOLDER, mask_token) if mask_token != MASK_PLACEHOLDER else text
    if mask_token not in text:
        raise NoMaskError(f"text: no masked position to fill: write {mask_token} (or {MASK_PLACEHOLDER}) where a "
                          "token is to be filled")
    return text


def fill(model: Any, tokenizer: Any, texts: list[str], max_length: int, top_k: int = TOP_K) -> list[dict[str, Any]]:
    """For each text: the top-k fills of every masked position with their probabilities, and the text with the
    top-1 fills in place."""
    import torch

    from llmops.models import modeling

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
