"""Token classification: one tag per word (BIO / IOB2 tags such as O, B-PER, I-PER, or plain tags such as POS).

Records hold `tokens` (the words) and `tags` (one per word, from `data.labels`; integer tags, as
datasets store ClassLabel ids, index into `data.labels` and are stored as names once validated).

Alignment: words are tokenized with `is_split_into_words=True`; the first sub-token of each word
carries the word's tag id, continuation sub-tokens and special tokens carry IGNORE_INDEX. A byte-level
tokenizer that adds no prefix space (the BPE tokenizer trained here, GPT-2's) would read each word as
if it started a text, so each word is given the space it has in running text. A row longer than
`tokenize.max_length` tokens is cut at a word boundary: only whole words keep their tags; words cut
off are not seen by the model and count as tagged O when scored.

Span rules (entity precision, recall and F1, exact span and type match, as seqeval's default mode):
- `B-T` starts an entity of type T; `I-T` continues an entity of type T;
- `I-T` after `O`, or after a tag of another type, starts an entity of type T (it is not dropped);
- an entity ends before `O`, before any `B-`, and before an `I-` of another type;
- a tag that is neither `O` nor prefixed `B-`/`I-` (e.g. a POS tag) is a one-word entity of that type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from llmops.models import modeling
from llmops.objectives.base import Encoding, Objective, Request, RowError, ScoringContext, Served
from llmops.objectives.metrics import Metric, Scored, ratio, table
from llmops.records.tokens import TOKENS
from llmops.text.encoding import IGNORE_INDEX

if TYPE_CHECKING:
    from llmops.config.schema import PipelineConfig
    from llmops.objectives.base import Collator, Model, Tokenizer

OUTSIDE = "O"

Span = tuple[str, int, int]


def entity_ratio(numerator: Any, denominator: Any) -> Any:
    """A ratio of summed entity counts, whose parts are (true positives, predicted, actual) per example."""
    def reduce(sums: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(denominator(sums) > 0, numerator(sums) / denominator(sums), np.nan)
    return reduce


METRICS = table(
    Metric("entity_f1", entity_ratio(lambda s: 2 * s[:, 0], lambda s: s[:, 1] + s[:, 2]), True,
           "F1 of entity precision and recall, over all entities"),
    Metric("entity_precision", entity_ratio(lambda s: s[:, 0], lambda s: s[:, 1]), True,
           "share of predicted entities (exact span and type) that are in the reference"),
    Metric("entity_recall", entity_ratio(lambda s: s[:, 0], lambda s: s[:, 2]), True,
           "share of reference entities (exact span and type) that are predicted"),
    Metric("token_accuracy", ratio, True, "share of words given their tag"))


class TokenClassification(Objective):
    name = "token_classification"
    needs_offsets = True
    kinds = (TOKENS,)
    summary = "token classification (a tag per word; loss on the first sub-token of each word)"
    task = "token-classification"
    metrics = METRICS
    architectures = ("bert", "roberta")
    peft_task = "TOKEN_CLS"
    # peft leaves a token classifier's head out of all-linear only when told: the head is trained whole instead
    lora_exclude = ("classifier", "score")
    peft_auto = "AutoPeftModelForTokenClassification"
    # transformers' pipeline tags the sub-words of a raw string and MLflow's pyfunc keeps only the entity types: a
    # version is a pyfunc of this project's code, tagging whole words as evaluation scored them
    pipeline_served = False

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """The tokenize stage's encoding of validated rows (tags are names by then)."""
        index = {label: position for position, label in enumerate(encoding.labels)}
        tags = [[index[tag] for tag in row["tags"]] for row in rows]
        encoded = encode(tokenizer, [row["tokens"] for row in rows], tags, encoding.max_length)
        encoded.pop("word_index")
        return encoded

    def auto_class(self) -> type:
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification

    def label_settings(self, labels: list[str]) -> dict[str, Any]:
        return modeling.label_maps(labels)

    def collator(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> Collator:
        return collator(tokenizer)

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        return "entity_f1", "token classification: entities found with their exact span and type"

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        """Every tokens metric per held-out row, and the predicted tags of each row (space-separated)."""
        labels = list(context.encoding.labels)
        predicted, _ = predict_tags(model, tokenizer, [row["tokens"] for row in rows], labels,
                                    context.encoding.max_length, context.settings.batch_size) if rows else ([], [])
        return Scored(tag_parts(predicted, [row["tags"] for row in rows]), [" ".join(tags) for tags in predicted],
                      self.metrics)

    def request_example(self) -> dict[str, Any]:
        return {"text": "The bridge opened on 3 May 1990"}

    def limitations(self, config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
        return ["An entity counts as found only with its exact span and type; words cut off at "
                "tokenize.max_length are scored as tagged O."]

    def request(self, line: int, row: dict[str, Any], served: Served) -> Request:
        """The words of a prediction request: `tokens` (a list of words), else `text` split on whitespace."""
        if "tokens" in row:
            words = row["tokens"]
            if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() for w in words):
                raise RowError("tokens: expected a non-empty list of non-empty strings")
            return Request(line, "tag", {"words": words})
        text = row.get("text")
        if not isinstance(text, str) or not text.split():
            raise RowError("expected tokens (a list of words) or text (split on whitespace), with at least one word")
        return Request(line, "tag", {"words": text.split()})

    def answer(self, served: Served, requests: list[Request]) -> list[dict[str, Any]]:
        """Per row: each word's tag, the entities (type, words, start and end word index, end exclusive), and
        whether the row was cut at max_length (the words cut off are tagged O)."""
        words = [r.fields["words"] for r in requests]
        tags, cut = predict_tags(served.model, served.tokenizer, words, served.labels or [],
                                 served.encoding.max_length, max(len(words), 1))
        return [{"tags": row_tags,
                 "entities": [{"type": kind, "words": row[start:end], "start": start, "end": end}
                              for kind, start, end in entities(row_tags)],
                 "truncated": was_cut}
                for row, row_tags, was_cut in zip(words, tags, cut, strict=True)]


def collator(tokenizer: Tokenizer) -> Collator:
    """Pads input ids with the pad id and labels with IGNORE_INDEX."""
    from transformers import DataCollatorForTokenClassification

    return DataCollatorForTokenClassification(tokenizer, label_pad_token_id=IGNORE_INDEX)


def word_prefix(tokenizer: Tokenizer) -> str:
    """A space before each word for byte-level tokenizers that add none, so that a word is encoded as it is
    inside a text ("Ġword"), not as the start of one; nothing for the others (WordPiece, or add_prefix_space)."""
    # a fast tokenizer: check_tokenizer refuses the others (needs_offsets)
    pre_tokenizer = json.loads(tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    return " " if any(part.get("type") == "ByteLevel" and not part.get("add_prefix_space")
                      for part in pre_tokenizer_parts(pre_tokenizer)) else ""


def pre_tokenizer_parts(pre_tokenizer: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield pre_tokenizer
    for part in pre_tokenizer.get("pretokenizers") or []:
        yield from pre_tokenizer_parts(part)


def whole_words(ids: list[int], word_ids: list[int | None], limit: int) -> tuple[list[int], list[int | None]]:
    """Ids cut to `limit` at a word boundary: a word whose sub-tokens do not all fit is left out whole; closing
    special tokens (e.g. [SEP]) stay."""
    if len(ids) <= limit:
        return ids, word_ids
    tail = 0
    while tail < len(word_ids) and word_ids[len(word_ids) - 1 - tail] is None:
        tail += 1
    cut = max(limit - tail, 0)
    while cut > 0 and word_ids[cut] is not None and word_ids[cut] == word_ids[cut - 1]:
        cut -= 1
    end = len(ids) - tail
    return (ids[:cut] + ids[end:])[:limit], (word_ids[:cut] + word_ids[end:])[:limit]


def aligned_labels(word_ids: list[int | None], tag_ids: list[int]) -> tuple[list[int], list[int]]:
    """The tag id on the first sub-token of each word, IGNORE_INDEX elsewhere; and the word of each labelled
    position."""
    labels, words = [], []
    for position, word in enumerate(word_ids):
        first = word is not None and (position == 0 or word_ids[position - 1] != word)
        labels.append(tag_ids[word] if first else IGNORE_INDEX)
        if first:
            words.append(word)
    return labels, words


def encode(tokenizer: Tokenizer, words: list[list[str]], tag_ids: list[list[int]] | None,
           max_length: int) -> dict[str, list[Any]]:
    """Token ids and aligned labels per row, cut at whole words; `word_index` maps labelled positions to words.
    Without tags (prediction) the labels mark the first sub-token of each word with 0."""
    prefix = word_prefix(tokenizer)
    encoded = tokenizer([[prefix + word for word in row] for row in words], is_split_into_words=True,
                        add_special_tokens=True)
    batch: dict[str, list[Any]] = {"input_ids": [], "labels": [], "raw_length": [], "length": [], "has_target": [],
                                   "word_index": []}
    for index, ids in enumerate(encoded["input_ids"]):
        kept, word_ids = whole_words(list(ids), encoded.word_ids(index), max_length)
        labels, word_index = aligned_labels(word_ids, tag_ids[index] if tag_ids is not None else
                                            [0] * len(words[index]))
        for name, item in (("input_ids", kept), ("labels", labels), ("raw_length", len(ids)), ("length", len(kept)),
                           ("has_target", bool(word_index)), ("word_index", word_index)):
            batch[name].append(item)
    return batch


def predict_tags(model: Model, tokenizer: Tokenizer, words: list[list[str]], labels: list[str], max_length: int,
                 batch_size: int) -> tuple[list[list[str]], list[bool]]:
    """Each word's predicted tag (words cut off by max_length: O), and whether each row was cut."""
    import torch

    encoded = encode(tokenizer, words, None, max_length)
    collate = collator(tokenizer)
    outside = OUTSIDE if OUTSIDE in labels else labels[0]
    tags: list[list[str]] = []
    with torch.no_grad():
        for start in range(0, len(words), batch_size):
            stop = start + batch_size
            rows = [{"input_ids": ids, "labels": marks} for ids, marks in
                    zip(encoded["input_ids"][start:stop], encoded["labels"][start:stop], strict=True)]
            batch = {name: value.to(model.device) for name, value in collate(rows).items()}
            predicted = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
            for offset, (marks, guesses) in enumerate(zip(batch["labels"].tolist(), predicted.tolist(), strict=True)):
                row_tags = [outside] * len(words[start + offset])
                firsts = [guess for mark, guess in zip(marks, guesses, strict=True) if mark != IGNORE_INDEX]
                for word, guess in zip(encoded["word_index"][start + offset], firsts, strict=True):
                    row_tags[word] = labels[guess]
                tags.append(row_tags)
    cut = [raw > max_length for raw in encoded["raw_length"]]
    return tags, cut


def split_tag(tag: str) -> tuple[str, str]:
    """(prefix, type): ("O", "") for outside, ("B", T) / ("I", T) for BIO tags, ("S", tag) for any other tag."""
    if tag == OUTSIDE:
        return OUTSIDE, ""
    if tag[:2] in ("B-", "I-"):
        return tag[0], tag[2:]
    return "S", tag


def entities(tags: list[str]) -> list[Span]:
    """The entities of a tag sequence as (type, start, end) word spans, end exclusive; see the module docstring."""
    found: list[Span] = []
    kind: str | None = None
    start = 0
    for index, tag in enumerate(tags):
        prefix, name = split_tag(tag)
        if kind is not None and not (prefix == "I" and name == kind):
            found.append((kind, start, index))
            kind = None
        if prefix == "S":
            found.append((name, index, index + 1))
        elif prefix == "B" or (prefix == "I" and kind is None):
            kind, start = name, index
    if kind is not None:
        found.append((kind, start, len(tags)))
    return found


def entity_counts(predicted: list[str], truth: list[str]) -> tuple[int, int, int]:
    """(true positives, predicted entities, actual entities): exact span and type matches."""
    guessed, actual = set(entities(predicted)), set(entities(truth))
    return len(guessed & actual), len(guessed), len(actual)


def tag_parts(predicted: list[list[str]], truth: list[list[str]]) -> dict[str, np.ndarray]:
    """Per-example parts: entity counts for precision, recall and F1; (right words, words) for token accuracy."""
    counts = np.asarray([entity_counts(p, t) for p, t in zip(predicted, truth, strict=True)], dtype=float)
    counts = counts.reshape(-1, 3)
    words = np.asarray([[sum(a == b for a, b in zip(p, t, strict=True)), len(t)]
                        for p, t in zip(predicted, truth, strict=True)], dtype=float).reshape(-1, 2)
    return {"entity_precision": counts, "entity_recall": counts, "entity_f1": counts, "token_accuracy": words}
