"""Why a row was rejected: one fixed code per kind of problem, and a message for a person.

The code is what counts rows per reason and what names a metric (`validate.codes.json_broken`);
the message holds the detail (which field, which byte, which value) and goes only into the
quarantine file and the run's table of quarantined rows, never into a metric, param or tag name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import StringConstraints

# a reject code as figures and metrics name it: one of RejectCode, or a code a record kind adds for its own fields
# (objectives/: e.g. a question-answering kind's answer that is not in its context); always the code's own words
CodeName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,63}$")]


class RejectCode(StrEnum):
    """The reasons a row can be rejected that every kind shares, by ingest (unreadable) or by validation (unfit)."""

    JSON_BROKEN = "json_broken"            # not valid JSON
    UTF8_INVALID = "utf8_invalid"          # bytes that are not UTF-8, or an unpaired surrogate escape
    TOO_LARGE = "too_large"                # a record over data.max_record_bytes, not parsed
    TOO_DEEP = "too_deep"                  # JSON nested deeper than any record needs
    DUPLICATE_KEY = "duplicate_key"        # a JSON object that names a key twice
    NOT_OBJECT = "not_object"              # a JSON value that is not an object (a list, null, a number, ...)
    FIELDS_MISMATCH = "fields_mismatch"    # a CSV/TSV row with more or fewer fields than its header
    CSV_BROKEN = "csv_broken"              # a CSV/TSV row the CSV reader cannot split
    ARRAY_UNCLOSED = "array_unclosed"      # a JSON array file that ends before its closing bracket
    FILE_UNREADABLE = "file_unreadable"    # a Parquet row group, a compressed file or a dataset that will not decode
    MISSING_FIELD = "missing_field"        # a required field is absent or null
    WRONG_TYPE = "wrong_type"              # a field holds a value of the wrong type
    EMPTY = "empty"                        # a text field (or a chat turn) shows nothing: `blank`
    TOO_SHORT = "too_short"                # under validate.min_chars
    TOO_LONG = "too_long"                  # over validate.max_chars
    NUL_BYTE = "nul_byte"                  # a NUL character in a text field
    CONTROL_CHAR = "control_char"          # another control character (not tab, newline or carriage return)
    LABEL_UNKNOWN = "label_unknown"        # a label outside data.labels
    TAGS_MISMATCH = "tags_mismatch"        # a tokens record with more or fewer tags than words
    CHAT_TURNS = "chat_turns"              # messages is not a list of {role, content} turns of text
    CHAT_ORDER = "chat_order"              # roles out of order: optional system, then user/assistant, ending assistant
    SAME_ANSWERS = "same_answers"          # a preference pair whose rejected answer is the chosen one


# control characters other than tab, newline and carriage return (NUL has its own code): what `control_char` rejects
CONTROL = "[\x01-\x08\x0b\x0c\x0e-\x1f\x7f]"
# characters that show nothing beyond whitespace: zero-width spaces and joiners, direction marks, word joiners, the
# byte-order mark and the soft hyphen, which a copy from a web page or a word processor can leave in a field (the
# inside of a regex character class: ranges included)
INVISIBLE = "\u00ad\u180e\u200b-\u200f\u2060-\u2064\ufeff"
# one character that shows: a field without one is empty (`empty`)
VISIBLE = f"[^\\s{INVISIBLE}]"
SHOWS = re.compile(VISIBLE)


def blank(text: str) -> bool:
    """Whether the text shows nothing: only whitespace and invisible characters, or none at all."""
    return SHOWS.search(text) is None


def json_kind(value: Any) -> str:
    """A value's JSON type, as messages name it (a Python bool is a JSON boolean, not a number; NaN and
    Infinity are not numbers a check accepts)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return "non-finite number"  # NaN or Infinity, which Python's JSON reads and no JSON standard allows
    kinds = {dict: "object", list: "array", str: "string", int: "number", float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


# the columns of the quarantine file and of the logged table, in this order
QUARANTINE_COLUMNS = ("source", "line", "code", "field", "message", "excerpt")


@dataclass(frozen=True)
class Reject:
    """A rejected row: its code, a message with the detail, the field at fault (if one is), and an excerpt."""

    code: str
    message: str
    field: str | None = None
    excerpt: str = ""
    # after this row the rest of its file could not be read (a broken JSON array, a file that stops decompressing)
    stops_file: bool = False

    def entry(self, source: str, line: int) -> dict[str, Any]:
        """The row's line in the quarantine file."""
        return {"source": source, "line": line, "code": str(self.code), "field": self.field,
                "message": self.message, "excerpt": self.excerpt}


def sorted_counts(counts: dict[str, int]) -> dict[str, int]:
    """Rows per code, most frequent first (ties in the enum's order, then a kind's own codes by name), for figures
    and messages."""
    order = {code.value: index for index, code in enumerate(RejectCode)}
    return {str(code): count for code, count in
            sorted(counts.items(), key=lambda item: (-item[1], order.get(item[0], len(order)), str(item[0])))}
