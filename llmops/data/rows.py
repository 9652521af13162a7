"""What every source reader shares: a row as readers yield it, a shard's span, and how a reject quotes its row."""

from __future__ import annotations

import json
from typing import Any

from llmops.io.rejects import Reject, RejectCode

EXCERPT_CHARS = 200
READ_BLOCK = 1 << 20

# (line, the row, or why it was rejected)
Row = tuple[int, dict[str, Any] | None, Reject | None]
# a shard of a file: bytes [start, end) on line boundaries, and the number of the first line in it
Span = tuple[int, int, int]


def too_large(size: int, limit: int) -> str:
    return f"record is {size:,} bytes, over data.max_record_bytes ({limit:,})"


# ends the message of a reject after which the rest of its file could not be read
UNREAD = "; the rest of the file was not read"


def excerpt(text: str) -> str:
    """The start of a row, always writable as UTF-8 (bad bytes and lone surrogates become U+FFFD)."""
    head = text[:EXCERPT_CHARS]
    return head.encode("utf-8", "replace").decode("utf-8") if has_surrogates(head) else head


def has_surrogates(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class DuplicateKey(ValueError):
    """A JSON object that names a key twice: a dict keeps one of its values and would lose the other without a word."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def reject(self, text: str) -> Reject:
        return Reject(RejectCode.DUPLICATE_KEY, f"key {self.key!r} appears twice in one object: which value is meant "
                      "is not known", excerpt=excerpt(text))


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members as a dict, each key once."""
    members = dict(pairs)
    if len(members) != len(pairs):
        seen: set[str] = set()
        raise DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return members


# JSON as records are read: control characters inside strings kept (validation names the field that holds them),
# a key named twice in an object refused
DECODER = json.JSONDecoder(strict=False, object_pairs_hook=unique_keys)
