"""What the model was asked in training, kept with its run so that monitoring can tell when served requests drift.

The report stage writes `inputs_profile.json` from the deduplicated splits: a seeded sample of the
training inputs' lengths (characters of what a model is asked, answers left out), the most common
words with their counts, the share of rare words in the held-out split (the rate a served request is
held to), the dominant script per input, the training labels of a classifier, and a fingerprint of
every training record (feedback exported as new rows must not repeat one).
"""

from __future__ import annotations

import hashlib
import random
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmops.data.near_fields import normalize
from llmops.io.tables import INDEX, table_rows
from llmops.records.base import RecordKind

PROFILE = "inputs_profile.json"
# inputs whose length and script are kept: enough for a two-sample test to see a shift of a few percent
SAMPLE_ROWS = 5000
# words kept with their counts; a word outside them, or seen fewer than RARE_BELOW times, is rare
VOCABULARY = 50_000
RARE_BELOW = 2
WORD = re.compile(r"\w+", re.UNICODE)


def profile_inputs(kind: RecordKind, train: Path, held_out: Path) -> dict[str, Any]:
    """The profile of the training split `train` (a table folder), with the rare-word rate of `held_out`."""
    words: Counter[str] = Counter()
    labels: Counter[str] = Counter()
    sample: list[str] = []
    fingerprints: list[str] = []
    chooser = random.Random(0)
    for seen, row in enumerate(rows_of(train)):
        asked = kind.asked(row)
        words.update(words_of(asked))
        if kind.label_field is not None and row.get(kind.label_field) is not None:
            labels[str(row[kind.label_field])] += 1
        fingerprints.append(fingerprint(row, kind))
        if len(sample) < SAMPLE_ROWS:  # reservoir sampling: every input as likely to be kept
            sample.append(asked)
        elif (slot := chooser.randrange(seen + 1)) < SAMPLE_ROWS:
            sample[slot] = asked
    vocabulary = dict(words.most_common(VOCABULARY))
    rare, total = rare_words((kind.asked(row) for row in rows_of(held_out)), vocabulary)
    return {
        "kind": kind.name,
        "rows": len(fingerprints),
        "lengths": sorted(len(text) for text in sample),
        "scripts": dict(Counter(script_of(text) for text in sample)),
        "words": vocabulary,
        "held_out_words": {"rare": rare, "total": total},
        "labels": dict(labels),
        "fingerprints": sorted(set(fingerprints)),
    }


def rows_of(folder: Path) -> Iterable[dict[str, Any]]:
    return table_rows(folder) if (folder / INDEX).is_file() else ()


def words_of(text: str) -> list[str]:
    return WORD.findall(text.casefold())


def rare_words(texts: Iterable[str], vocabulary: dict[str, int]) -> tuple[int, int]:
    """How many of the texts' words are rare in training, of how many."""
    rare = total = 0
    for text in texts:
        for word in words_of(text):
            total += 1
            rare += vocabulary.get(word, 0) < RARE_BELOW
    return rare, total


def script_of(text: str) -> str:
    """The script most of a text's letters are written in (LATIN, CYRILLIC, CJK, ARABIC...); `none` without
    letters."""
    scripts = Counter(unicodedata.name(char, "UNKNOWN").split(" ")[0] for char in text if char.isalpha())
    return scripts.most_common(1)[0][0] if scripts else "none"


def fingerprint(row: dict[str, Any], kind: RecordKind) -> str:
    """What a record asks and answers, normalized: the same question and answer in another layout (an instruction
    with its input, or both as one user turn) is the same record."""
    asked, answered = (normalize(text, casefold=True) for text in (kind.asked(row), kind.answered(row)))
    return hashlib.sha256(f"{asked}\x00{answered}".encode()).hexdigest()[:24]
