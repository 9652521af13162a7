"""What every source reader shares: a row as readers yield it, a shard's span, and how a reject quotes its row."""

from __future__ import annotations

from typing import Any

from llmops.core.rejects import Reject

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
