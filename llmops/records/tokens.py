"""Tokens records: words and one tag per word, from `data.labels`; integer tags, as datasets store ClassLabel ids,
index into `data.labels` and are stored as names once validated.
"""

from __future__ import annotations

import re
from typing import Any

from llmops.config.schema import ValidateConfig
from llmops.io.rejects import CONTROL, RejectCode, blank, json_kind
from llmops.records.base import Expect, RecordKind

TOKEN_COLUMNS = ("tokens", "words")
TAG_COLUMNS = ("tags", "ner_tags", "labels", "pos_tags")


class TokensRecords(RecordKind):
    """Words and a tag per word, from data.labels (integer tags index them)."""

    name = "tokens"
    fields = ("tokens", "tags")
    asked_fields = ("tokens",)
    columns = {"tokens": TOKEN_COLUMNS, "tags": TAG_COLUMNS}
    labelled = True

    def expectations(self, expect: Expect, gxe: Any, settings: ValidateConfig, labels: list[str]) -> None:
        """The checks of a tokens record, most basic first, each with its reject code and field."""
        code = RejectCode
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_tokens_type"), code.MISSING_FIELD, "tokens")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_tokens_type", value_set=["array"]), code.WRONG_TYPE,
               "tokens")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_tokens_strings", value_set=[True]), code.WRONG_TYPE,
               "tokens")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_words", min_value=1), code.EMPTY, "tokens")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_blank_words", max_value=0), code.EMPTY, "tokens")
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column="_tokens_text", regex="\x00"), code.NUL_BYTE, "tokens")
        expect(gxe.ExpectColumnValuesToNotMatchRegex(column="_tokens_text", regex=CONTROL), code.CONTROL_CHAR,
               "tokens")
        expect(gxe.ExpectColumnValueLengthsToBeBetween(column="_tokens_text", max_value=settings.max_chars),
               code.TOO_LONG, "tokens")
        expect(gxe.ExpectColumnValuesToNotBeNull(column="_tags_type"), code.MISSING_FIELD, "tags")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_tags_type", value_set=["array"]), code.WRONG_TYPE, "tags")
        expect(gxe.ExpectColumnValuesToBeBetween(column="_tag_gap", min_value=0, max_value=0), code.TAGS_MISMATCH,
               "tags")
        expect(gxe.ExpectColumnValuesToBeInSet(column="_tags_known", value_set=[True]), code.LABEL_UNKNOWN, "tags")

    def frame(self, chunk: list[dict[str, Any]], labels: list[str]) -> dict[str, list[Any]]:
        summaries = [{**words_summary(row.get("tokens")), **tags_summary(row.get("tokens"), row.get("tags"), labels)}
                     for row in chunk]
        return {name: [summary[name] for summary in summaries] for name in summaries[0]} if summaries else {}

    def describe(self, code: RejectCode, field: str, row: dict[str, Any], settings: ValidateConfig,
                 labels: list[str]) -> str:
        """A person's reading of one failure of a tokens record."""
        value = row.get(field)
        if field == "tags":
            return f"tags: {describe_tags(code, value, row.get('tokens'), labels)}"
        if code == RejectCode.MISSING_FIELD:
            return "tokens: missing (expected a list of words; also read from a column named words)"
        if not isinstance(value, list):
            return f"tokens: a {json_kind(value)} where a list of words is expected"
        if code == RejectCode.WRONG_TYPE:
            index = next(i for i, word in enumerate(value) if not isinstance(word, str))
            return f"tokens: the word at index {index} is a {json_kind(value[index])}, not text"
        if code == RejectCode.EMPTY:
            index = next((i for i, word in enumerate(value) if blank(word)), None)
            return "tokens: an empty list of words" if index is None else \
                f"tokens: the word at index {index} is empty or only whitespace"
        if code == RejectCode.TOO_LONG:
            return f"tokens: {len(' '.join(value))} characters in all, over validate.max_chars ({settings.max_chars})"
        pattern = "\x00" if code == RejectCode.NUL_BYTE else CONTROL
        index = next(i for i, word in enumerate(value) if re.search(pattern, word))
        found = re.search(pattern, value[index])
        what = "a NUL character" if code == RejectCode.NUL_BYTE else \
            f"a control character (U+{ord(found.group()):04X})"
        return f"tokens: the word at index {index} holds {what}"

    def valid_row(self, row: dict[str, Any], labels: list[str]) -> dict[str, Any]:
        """A valid row with its tags as names (integer tags are indexes into data.labels)."""
        return {**row, "tags": [tag_name(tag, labels) for tag in row["tags"]]}

    def content(self, row: dict[str, Any]) -> list[str]:
        """The words with their tags, as word/tag pairs (so that shingles compare words, not runs of O tags, which
        nearly every sentence shares)."""
        return [" ".join(f"{word}/{tag}" for word, tag in zip(row["tokens"], row["tags"], strict=True))]

    def tokenizer_text(self, row: dict[str, Any]) -> str:
        """The words as a tokenizer trained here sees them: each after a space, as they are encoded."""
        return "".join(" " + word for word in row["tokens"])

    def sample(self, row: dict[str, Any]) -> dict[str, Any]:
        return {"text": " ".join(row["tokens"]), "reference": " ".join(row["tags"])}


TOKENS = TokensRecords()


def tag_name(tag: Any, labels: list[str]) -> str | None:
    """The tag as one of data.labels (an integer indexes them), or None when it is not one."""
    if isinstance(tag, bool):
        return None
    if isinstance(tag, int):
        return labels[tag] if 0 <= tag < len(labels) else None
    return tag if isinstance(tag, str) and tag in labels else None


def first_unknown(tags: list[Any], labels: list[str]) -> int | None:
    return next((index for index, tag in enumerate(tags) if tag_name(tag, labels) is None), None)


def words_summary(tokens: Any) -> dict[str, Any]:
    """Columns the expectations read about the words; None where a more basic check already fails."""
    is_list = isinstance(tokens, list)
    strings = is_list and all(isinstance(word, str) for word in tokens)
    text = " ".join(tokens) if strings else None
    return {"_tokens_type": None if tokens is None else json_kind(tokens), "_tokens_strings": strings if is_list
            else None, "_words": len(tokens) if strings else None,
            "_blank_words": sum(blank(word) for word in tokens) if strings else None, "_tokens_text": text}


def tags_summary(tokens: Any, tags: Any, labels: list[str]) -> dict[str, Any]:
    both = isinstance(tags, list) and isinstance(tokens, list)
    return {"_tags_type": None if tags is None else json_kind(tags),
            "_tag_gap": len(tags) - len(tokens) if both else None,
            "_tags_known": first_unknown(tags, labels) is None if isinstance(tags, list) else None}


def describe_tags(code: RejectCode, tags: Any, tokens: Any, labels: list[str]) -> str:
    if code == RejectCode.MISSING_FIELD:
        return f"missing (expected one tag per word; also read from columns {', '.join(TAG_COLUMNS[1:])})"
    if code == RejectCode.WRONG_TYPE:
        return f"a {json_kind(tags)} where a list of tags is expected"
    if code == RejectCode.TAGS_MISMATCH:
        return f"{len(tags)} tags for {len(tokens)} words; expected one tag per word"
    index = first_unknown(tags, labels)
    tag = tags[index]
    if isinstance(tag, int) and not isinstance(tag, bool):
        return (f"tag {tag} at index {index} is out of range: an integer tag indexes data.labels (0 to "
                f"{len(labels) - 1})")
    return f"tag {tag!r} at index {index} is not one of data.labels ({', '.join(labels)})"
