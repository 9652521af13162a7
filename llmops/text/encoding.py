"""Token ids and labels: the label that carries no loss, response spans as labels, and truncation."""

from __future__ import annotations

from typing import Any

# the label of a position that carries no loss (PyTorch's cross-entropy ignore_index, as transformers uses it)
IGNORE_INDEX = -100
Span = tuple[int, int]


def token_ids(tokenizer: Any, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Each text's token ids (new lists), as `tokenizer(texts)["input_ids"]` gives them. A fast tokenizer's backend
    encodes without tracking character offsets, which nothing here reads: about a third faster on long texts. Not where
    the backend would truncate or pad by itself (a tokenizer.json can say so; the tokenizer's own call turns that
    off), or splits special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast") or backend.truncation is not None or \
            backend.padding is not None or getattr(tokenizer, "split_special_tokens", False):
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [encoded.ids for encoded in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]


def response_labels(encoding: Any, ids: list[int], spans: list[Span]) -> list[int]:
    """Token ids of the tokens that start inside a span of the text; IGNORE_INDEX for every other token."""
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        first, last = first_token_from(encoding, start, end), last_token_before(encoding, start, end)
        if first is not None and last is not None and first <= last:
            labels[first:last + 1] = ids[first:last + 1]
    return labels


def first_token_from(encoding: Any, start: int, end: int) -> int | None:
    """The first token that starts at or after `start` (a token straddling `start` belongs to the prompt)."""
    for position in range(start, end):
        index = encoding.char_to_token(position)
        if index is not None:
            return index if encoding.offsets[index][0] >= start else index + 1
    return None


def last_token_before(encoding: Any, start: int, end: int) -> int | None:
    """The last token that starts before `end`."""
    for position in range(end - 1, start - 1, -1):
        index = encoding.char_to_token(position)
        if index is not None:
            return index
    return None


def truncated(ids: list[list[int]], labels: list[list[int]], limit: int) -> dict[str, list[Any]]:
    """Rows cut at `limit` tokens, with their lengths before and after, and whether any label survived the cut.
    Labels that are the ids themselves stay the same lists as the cut ids."""
    cut_ids = [seq if len(seq) <= limit else seq[:limit] for seq in ids]
    cut_labels = cut_ids if labels is ids else [seq if len(seq) <= limit else seq[:limit] for seq in labels]
    return {"input_ids": cut_ids, "labels": cut_labels,
            "raw_length": [len(seq) for seq in ids], "length": [min(len(seq), limit) for seq in ids],
            "has_target": [has_target(seq) for seq in cut_labels]}


def has_target(labels: list[int]) -> bool:
    """Whether any position carries a loss; most rows end in a target, which saves counting."""
    return bool(labels) and labels[-1] != IGNORE_INDEX or labels.count(IGNORE_INDEX) < len(labels)


def last_span_length(labels: list[int]) -> int:
    """How many tokens the last labelled run of a row holds: its last response (an assistant turn with its
    end-of-turn marker), the most a model has to generate to say it."""
    end = len(labels)
    while end and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    start = end
    while start and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return end - start
