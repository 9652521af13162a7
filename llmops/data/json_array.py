"""A JSON array of objects, streamed element by element, whole or a span at a time.

A span of an array starts where one of its objects does (core.shards.array_ranges finds them), so a
span is read as the elements that follow each other from its first byte to its last: every element
keeps the line it starts on, and the rows come out as in one read of the file.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

from llmops.data.rows import (
    DECODER,
    EXCERPT_CHARS,
    READ_BLOCK,
    UNREAD,
    DuplicateKey,
    Row,
    Span,
    excerpt,
    has_surrogates,
    too_large,
)
from llmops.io.rejects import Reject, RejectCode, json_kind
from llmops.io.shards import open_range

# the longest token a block's end can cut short and leave a valid start (-Infinity; a number cut in its exponent)
TAIL = len("-Infinity")
# what moves an element's nesting outside its strings, and what ends or escapes within one
STRUCTURE = re.compile(r'["\[\]{}]')
IN_STRING = re.compile(r'["\\]')
# what may stand between two elements: JSON's whitespace, and one comma
SEPARATORS = frozenset(" \t\n\r,")


class Window:
    """The text read so far, the position of the next element in it, and whether the file (or span) has ended."""

    def __init__(self, handle: IO[str]) -> None:
        self.handle, self.buffer, self.position, self.at_end = handle, handle.read(READ_BLOCK), 0, False

    def read_on(self) -> bool:
        """The next block after what is left from the position on; whether there was one."""
        more = self.handle.read(READ_BLOCK)
        self.buffer, self.position, self.at_end = self.buffer[self.position:] + more, 0, not more
        return bool(more)

    def skip_separators(self) -> tuple[int, int]:
        """Past JSON whitespace and commas; the line ends and the commas passed."""
        buffer, position, lines, commas = self.buffer, self.position, 0, 0
        while position < len(buffer) and buffer[position] in SEPARATORS:
            lines += buffer[position] == "\n"
            commas += buffer[position] == ","
            position += 1
        self.position = position
        return lines, commas


def read_json_array(path: Path, max_bytes: int, span: Span | None = None, ends_file: bool = True) -> Iterator[Row]:
    """Elements are decoded one at a time from a sliding buffer; each keeps the line it starts on.

    An element over `max_bytes` characters is rejected and skipped without being held whole. A
    broken element cannot be skipped reliably (where the next one starts is unknown), so it ends
    the read; its reject says so and validation stops the run rather than train on part of the file.
    Each of these outcomes depends on the element's text alone, never on where a read block ends, so
    a span reads as the same part of one read of the file does. A span that is not the file's last
    ends quietly after its last element. An array that `ends_file` (not a field's, which its object goes on
    after) must be followed by whitespace only: text after it (a second array, a broken object) stops the file,
    where reading the array alone would drop that text without a word. So does a separator that is not JSON's
    (no comma between two elements, two, or one before the first element or the closing bracket): the elements
    around it are readable, but the file is not JSON, and no parser but this one would read it.
    """
    decoder = DECODER
    start, end, line = span or (0, None, 1)
    last = end is None or end >= path.stat().st_size
    with open_text(path, start, end) as handle:
        window = Window(handle)
        window.position = window.buffer.index("[") + 1 if start == 0 else 0
        line += window.buffer[:window.position].count("\n")
        # the commas since the last element (since the array's or the span's start, where there is none)
        commas, after_element = 0, False
        while True:
            lines, passed = window.skip_separators()
            line, commas = line + lines, commas + passed
            if window.position == len(window.buffer) or window.position > READ_BLOCK:
                if not window.read_on() and not window.buffer:
                    if last:
                        yield line, None, Reject(RejectCode.ARRAY_UNCLOSED, "the JSON array is not closed" + UNREAD,
                                                 stops_file=True)
                    elif after_element and commas != 1:  # the next span starts at an element
                        yield line, None, misplaced_commas(commas, after_element, "", max_bytes)
                    return
                continue
            head = window.buffer[window.position]
            if commas != (after_element and head != "]"):
                text = window.buffer[window.position:window.position + EXCERPT_CHARS]
                yield line, None, misplaced_commas(commas, after_element, text, max_bytes)
                return
            if head == "]":
                if ends_file:
                    yield from after_close(window, line)
                return
            found = next_element(decoder, window, max_bytes)
            if found is None:  # the element may go on in the text not yet read
                window.read_on()
                continue
            if isinstance(found, Reject):
                yield line, None, found
                return
            yield line, *array_element(found, max_bytes)
            line += found.lines
            commas, after_element = 0, True


def after_close(window: Window, line: int) -> Iterator[Row]:
    """A reject for any text after the array's closing bracket, at the window's position; none for whitespace."""
    window.position += 1
    while True:
        rest = window.buffer[window.position:]
        text = rest.lstrip()
        if text:
            line += rest[:len(rest) - len(text)].count("\n")
            yield line, None, Reject(RejectCode.JSON_BROKEN, "text after the closing bracket of the JSON array"
                                     + UNREAD, excerpt=excerpt(text[:EXCERPT_CHARS]), stops_file=True)
            return
        line += rest.count("\n")
        window.position = len(window.buffer)
        if not window.read_on():
            return


class Element(NamedTuple):
    value: Any
    # the element's text; its first characters where it was skipped
    text: str
    lines: int
    # its size in bytes where it was skipped (over the limit, or nested too deeply to parse), unmeasured otherwise
    skipped: int | None = None
    # nested deeper than the parser recurses: valid JSON, but no record
    deep: bool = False
    # a key an object of it names twice
    duplicate: str | None = None


def next_element(decoder: json.JSONDecoder, window: Window, max_bytes: int) -> Element | Reject | None:
    """The element at the window's position, moving the window past it; a reject that ends the read; None: read on
    first."""
    buffer, position = window.buffer, window.position
    try:
        value, stop = decoder.raw_decode(buffer, position)
    except json.JSONDecodeError as err:
        if not window.at_end and len(buffer) - position < max_bytes + TAIL:
            return None  # decided on at least the limit's worth of the element, wherever the block ends
        unended = err.msg.startswith("Unterminated string") and not window.at_end
        skipped = skip_element(window) if err.pos - position >= max_bytes or unended else None
        if skipped is not None:
            return skipped
        too_long = unended or err.pos - position >= max_bytes
        return broken_element(err.msg, max(len(buffer) - position, max_bytes + 1) if too_long else 0, max_bytes,
                              buffer[position:position + EXCERPT_CHARS])
    except DuplicateKey as err:  # parsed up to the object that names a key twice: followed past by its brackets
        element = skip_element(window)
        if element is None:
            return broken_element("the element does not end", 0, max_bytes, buffer[position:position + EXCERPT_CHARS])
        return element._replace(duplicate=err.key)
    except RecursionError:  # valid JSON nested too deeply to parse: followed past by its brackets, one reject
        deep = skip_element(window)
        if deep is None:
            return broken_element("nested too deeply", 0, max_bytes, buffer[position:position + EXCERPT_CHARS])
        return deep._replace(deep=True)
    except ValueError as err:  # an integer of 4300+ digits
        return broken_element(str(err).split(":")[0], 0, max_bytes, buffer[position:position + EXCERPT_CHARS])
    if stop > len(buffer) - TAIL and not window.at_end:  # a number or literal may go on in the text not yet read
        return None
    window.position = stop
    text = buffer[position:stop]
    return Element(value, text, text.count("\n"))


def skip_element(window: Window) -> Element | None:
    """Moves the window past the object, array or string at its position without holding more than a block of it,
    measuring it. None where it is none of those, or the text ends first."""
    head = window.buffer[window.position:window.position + EXCERPT_CHARS]
    if head[:1] not in ("{", "[", '"'):
        return None
    depth, in_string, lines, size, index = 0, False, 0, 0, window.position
    while True:
        buffer = window.buffer
        index, depth, in_string, done = follow(buffer, index, depth, in_string)
        lines += buffer.count("\n", window.position, index)
        size += byte_size(buffer[window.position:index])
        window.position = index
        if done:
            return Element(None, head, lines, size)
        if not window.read_on():
            return None
        index = 0


def follow(buffer: str, index: int, depth: int, in_string: bool) -> tuple[int, int, bool, bool]:
    """Follows strings and brackets from `index`: where it stopped (the element's end, or as far as the buffer lets
    it: before a backslash that ends it), the depth, whether inside a string, and whether the element ended."""
    while True:
        if in_string:
            found = IN_STRING.search(buffer, index)
            if found is None:
                return len(buffer), depth, True, False
            index = found.start()
            if buffer[index] == "\\":
                if index + 1 == len(buffer):  # what it escapes comes with the next block
                    return index, depth, True, False
                index += 2
                continue
            index, in_string = index + 1, False
            if depth == 0:
                return index, depth, False, True
            continue
        found = STRUCTURE.search(buffer, index)
        if found is None:
            return len(buffer), depth, False, False
        index, mark = found.end(), found.group()
        if mark == '"':
            in_string = True
        elif mark in "[{":
            depth += 1
        else:
            depth -= 1
            if depth <= 0:
                return index, depth, False, True


def byte_size(text: str) -> int:
    """The bytes the text was read from (an undecodable byte is kept as one surrogate)."""
    return len(text.encode("utf-8", "surrogateescape"))


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


def misplaced_commas(commas: int, after_element: bool, text: str, max_bytes: int) -> Reject:
    """The reject of the separators before `text` (an element, the closing bracket, or the next span's first
    element where it is empty) that are not the one comma JSON puts between two elements: the file is not JSON from
    there on."""
    if text.startswith("]"):
        problem = "a comma before the closing bracket" if after_element else "a comma in an empty array"
    elif not after_element:
        problem = "a comma before the array's first element"
    else:
        problem = "no comma between two elements" if commas == 0 else f"{commas} commas between two elements"
    return broken_element(problem, 0, max_bytes, text)


def array_element(element: Element, max_bytes: int) -> tuple[dict[str, Any] | None, Reject | None]:
    """The element as a row, or why it is none: over the limit (as a JSON line would be), bad UTF-8, no object."""
    value, text = element.value, element.text
    if element.deep:  # as a JSON line nested as deeply is
        return None, Reject(RejectCode.TOO_DEEP, "JSON nested too deeply to read", excerpt=excerpt(text))
    # a character is at most 4 bytes: only a long text is measured
    size = element.skipped if element.skipped is not None else byte_size(text) if 4 * len(text) > max_bytes else 0
    if size > max_bytes:
        return None, Reject(RejectCode.TOO_LARGE, too_large(size, max_bytes), excerpt=excerpt(text))
    if has_surrogates(text):
        return None, Reject(RejectCode.UTF8_INVALID, "invalid UTF-8",
                            excerpt=excerpt(text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")))
    if element.duplicate is not None:
        return None, DuplicateKey(element.duplicate).reject(text)
    if not isinstance(value, dict):
        return None, Reject(RejectCode.NOT_OBJECT, f"a JSON {json_kind(value)} where an object is expected",
                            excerpt=excerpt(text))
    return value, None
