"""A JSON array of objects, streamed element by element, whole or a span at a time.

A span of an array starts where one of its objects does (core.shards.array_ranges finds them), so a
span is read as the elements that follow each other from its first byte to its last: every element
keeps the line it starts on, and the rows come out as in one read of the file.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from llmops.core.rejects import Reject, RejectCode, json_kind
from llmops.core.shards import open_range
from llmops.data.rows import EXCERPT_CHARS, READ_BLOCK, UNREAD, Row, Span, excerpt, has_surrogates, too_large


def read_json_array(path: Path, max_bytes: int, span: Span | None = None) -> Iterator[Row]:
    """Elements are decoded one at a time from a sliding buffer; each keeps the line it starts on.

    A broken element cannot be skipped reliably (where the next one starts is unknown), so it ends
    the read; its reject says so and validation stops the run rather than train on part of the file.
    A span that is not the file's last ends quietly after its last element.
    """
    decoder = json.JSONDecoder(strict=False)
    start, end, line = span or (0, None, 1)
    last = end is None or end >= path.stat().st_size
    with open_text(path, start, end) as handle:
        buffer = handle.read(READ_BLOCK)
        position = buffer.index("[") + 1 if start == 0 else 0
        line += buffer[:position].count("\n")
        at_end = False
        while True:
            while position < len(buffer) and (buffer[position].isspace() or buffer[position] == ","):
                line += buffer[position] == "\n"
                position += 1
            if position == len(buffer) or position > READ_BLOCK:
                buffer, position = buffer[position:], 0
                more = handle.read(READ_BLOCK)
                at_end = not more
                if not buffer and at_end:
                    if last:
                        yield line, None, Reject(RejectCode.ARRAY_UNCLOSED, "the JSON array is not closed" + UNREAD,
                                                 stops_file=True)
                    return
                buffer += more
                continue
            if buffer[position] == "]":
                return
            try:
                value, stop = decoder.raw_decode(buffer, position)
            except json.JSONDecodeError as err:
                size = len(buffer) - position
                ran_out = short_of_text(err, buffer)
                if ran_out and not at_end and size <= max_bytes:
                    buffer, position, at_end = read_on(handle, buffer, position)
                    continue
                yield line, None, broken_element(err.msg, size if ran_out and size > max_bytes else 0, max_bytes,
                                                 buffer[position:position + EXCERPT_CHARS])
                return
            except (RecursionError, ValueError) as err:  # nested too deeply; an integer of 4300+ digits
                problem = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(":")[0]
                yield line, None, broken_element(problem, 0, max_bytes, buffer[position:position + EXCERPT_CHARS])
                return
            if stop == len(buffer) and not at_end:  # a number at the buffer's end may go on in the text not yet read
                buffer, position, at_end = read_on(handle, buffer, position)
                continue
            text = buffer[position:stop]
            yield line, *array_element(value, text)
            line += text.count("\n")
            position = stop


def read_on(handle: IO[str], buffer: str, position: int) -> tuple[str, int, bool]:
    """The buffer from `position` with the next block of text after it; whether the text has ended."""
    more = handle.read(READ_BLOCK)
    return buffer[position:] + more, 0, not more


def short_of_text(err: json.JSONDecodeError, buffer: str) -> bool:
    """Whether the decoder stopped for want of text rather than at a fault: inside a string the buffer ends in (the
    error then points at the string's start), or less than an escape's length (\\uXXXX) before the buffer's end."""
    return err.msg.startswith("Unterminated string") or err.pos >= len(buffer) - len("\\u0000")


def open_text(path: Path, start: int, end: int | None) -> IO[str]:
    """Bytes [start, end) as text: a byte-order mark dropped at the file's start, undecodable bytes kept as
    surrogates (an element holding one is rejected, not the file)."""
    return io.TextIOWrapper(open_range(path, start, end), encoding="utf-8-sig" if start == 0 else "utf-8",
                            errors="surrogateescape")


def broken_element(problem: str, size: int, max_bytes: int, head: str) -> Reject:
    if size:
        return Reject(RejectCode.TOO_LARGE, too_large(size, max_bytes) + UNREAD, excerpt=excerpt(head),
                      stops_file=True)
    return Reject(RejectCode.JSON_BROKEN, f"not valid JSON: {problem}" + UNREAD, excerpt=excerpt(head),
                  stops_file=True)


def array_element(value: Any, text: str) -> tuple[dict[str, Any] | None, Reject | None]:
    if has_surrogates(text):
        return None, Reject(RejectCode.UTF8_INVALID, "invalid UTF-8",
                            excerpt=excerpt(text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")))
    if not isinstance(value, dict):
        return None, Reject(RejectCode.NOT_OBJECT, f"a JSON {json_kind(value)} where an object is expected",
                            excerpt=excerpt(text))
    return value, None
