"""Near duplicates field by field: a record of several fields is a near copy of another only when each of its fields
is near its counterpart, not just the record as a whole.

A long field that distinct records share (a chat's system prompt, a QA record's context, an
instruction's input passage) dominates the record's shingles: on the whole record such records
look alike whatever their questions and answers. Where a confirmed pair of rows holds records of
more than one field, their rows are read back from the table (only the row groups that hold them)
and compared field by field, in order: the same number of fields,
and for each the exact Jaccard similarity of the two fields' word shingles at least the threshold.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from llmops.io.tables import rows_at
from llmops.records.base import RecordKind

# what str.split splits ASCII text at, but the space
OTHER_ASCII_SPACE = bytes(code for code in range(128) if chr(code).isspace() and code != ord(" "))
# a field's word shingles: runs of `size` words, or one run of all of them when it has no more
Shingles = frozenset[tuple[str, ...]]
# scripts written without spaces between words (Chinese, Japanese, Thai, Lao, Khmer, Myanmar), and CJK punctuation:
# each of their characters counts as a word, or a whole paragraph would be one word and never near anything
UNSPACED = ((0x0E00, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x3000, 0x30FF), (0x3400, 0x4DBF),
            (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFF66, 0xFF9F), (0x20000, 0x2FA1F))
UNSPACED_PYTHON = re.compile("[" + "".join(f"{chr(low)}-{chr(high)}" for low, high in UNSPACED) + "]")
UNSPACED_RE2 = "[" + "".join(f"\\x{{{low:X}}}-\\x{{{high:X}}}" for low, high in UNSPACED) + "]"


def unspaced_apart(text: str) -> str:
    """The text with a space either side of each character of a script written without spaces."""
    return text if text.isascii() else UNSPACED_PYTHON.sub(r" \g<0> ", text)


def unspaced_apart_arrow(texts: Any) -> Any:
    """unspaced_apart over an Arrow string array, in C; only the texts with a character beyond ASCII are
    searched."""
    import pyarrow.compute as pc

    wide = pc.not_equal(pc.utf8_length(texts), pc.binary_length(texts))
    if not pc.any(wide).as_py():
        return texts
    spaced = pc.replace_substring_regex(texts.filter(wide), pattern=UNSPACED_RE2, replacement=" \\0 ")
    return pc.replace_with_mask(texts, wide, spaced)


def normalize(text: str, casefold: bool) -> str:
    """NFKC, whitespace runs folded to one space, optionally case-folded."""
    if not text.isascii():  # NFKC leaves ASCII as it is
        text = " ".join(unicodedata.normalize("NFKC", text).split())
    elif not spaced_once(text):
        text = " ".join(text.split())
    return text.casefold() if casefold else text


def spaced_once(text: str) -> bool:
    """Whether ASCII text is already its words with one space between them, found in C without making a string per
    word: most text is, and splitting and joining it was most of the normalizing."""
    data = text.encode("ascii")
    return len(data.translate(None, OTHER_ASCII_SPACE)) == len(data) and b"  " not in data and \
        not data.startswith(b" ") and not data.endswith(b" ")


def field_shingles(field: str, size: int) -> Shingles:
    """The shingles near-duplicate detection compares, of one field: its normalized, case-folded words in runs of
    `size` (one run of all its words when it has no more than `size`; none when it is empty)."""
    words = unspaced_apart(normalize(field, casefold=True)).split()
    if len(words) <= size:
        return frozenset([tuple(words)] if words else [])
    return frozenset(zip(*(words[start:len(words) - size + 1 + start] for start in range(size)), strict=True))


def jaccard(first: Shingles, second: Shingles) -> float:
    """The exact Jaccard similarity of two shingle sets; two empty fields are the same."""
    if not first and not second:
        return 1.0
    return len(first & second) / len(first | second)


def all_fields_near(first: list[Shingles], second: list[Shingles], threshold: float) -> bool:
    """Whether two records have as many fields, and each field of one is near the same field of the other."""
    return len(first) == len(second) and all(
        jaccard(mine, theirs) >= threshold for mine, theirs in zip(first, second, strict=True))


def read_shingles(source: Path, kind: RecordKind, positions: np.ndarray, size: int) -> dict[int, list[Shingles]]:
    """Each field's shingles of the rows at these positions of the table `source`."""
    rows = rows_at(source, positions.tolist())
    return {position: [field_shingles(field, size) for field in kind.content(row)] for position, row in rows.items()}


def fields_near(source: Path, kind: RecordKind, pairs: np.ndarray, size: int, threshold: float) -> np.ndarray:
    """For each pair of rows, given by their positions in the table `source`, whether their records are near field
    by field; only the rows of those pairs are read, and held while the pairs are judged."""
    if not len(pairs):
        return np.zeros(0, dtype=bool)
    shingles = read_shingles(source, kind, np.unique(pairs), size)
    return np.array([all_fields_near(shingles[first], shingles[second], threshold)
                     for first, second in pairs.tolist()], dtype=bool)
