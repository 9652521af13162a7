"""Predict: a registered version's answers for JSONL rows, the way its evaluation scored it.

A version is named `NAME` (its champion), `NAME@alias` or `NAME/VERSION` and loaded through the
MLflow registry (registry/loading.py). Each input row is one of the shapes the pipeline ingests;
the version's objective reads it as a request and answers it (objectives/): a language model's
reply or perplexity, a classifier's label and scores, a tagger's tags and entities, a masked LM's
fills, a seq2seq model's target. Lengths follow the version's own run: texts are cut at its
`tokenize.max_length`, replies at its `evaluate.max_new_tokens`. A row that cannot be read or has no
usable shape becomes an error row with its line number: nothing is dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

from llmops.config.schema import TrackingConfig
from llmops.data.readers import parse_object
from llmops.objectives.base import Request, RowError
from llmops.registry.loading import LoadedVersion, load_version
from llmops.registry.references import parse_reference

EXCERPT_CHARS = 80


def load(model: str, tracking_config: TrackingConfig) -> LoadedVersion:
    """The version `model` names (NAME, NAME@alias or NAME/VERSION), loaded and placed."""
    return load_version(parse_reference(model), tracking_config)


def limits(loaded: LoadedVersion) -> str:
    """What the version reads and writes at most, for the line predict starts with."""
    return loaded.objective.limits(loaded.served)


def read_request(loaded: LoadedVersion, line: int, raw: bytes) -> Request:
    """Parse one JSONL line into the version's request; RowError says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RowError(f"invalid UTF-8 at byte {err.start}") from None
    row, problem = parse_object(text)
    if row is None:
        raise RowError(f"{problem.code}: {problem.message}" if problem else "not a JSON object")
    return loaded.objective.request(line, row, loaded.served)


def predict_lines(loaded: LoadedVersion, lines: Iterable[bytes], batch_size: int) -> Iterator[dict[str, Any]]:
    """One result per non-blank input line, in input order: a prediction, or the line's error."""
    pending: list[tuple[int, bytes]] = []
    for number, raw in enumerate(lines, 1):
        raw = raw.rstrip(b"\r\n")
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if not raw.strip():
            continue
        pending.append((number, raw))
        if len(pending) == batch_size:
            yield from predict_batch(loaded, pending)
            pending = []
    if pending:
        yield from predict_batch(loaded, pending)


def predict_batch(loaded: LoadedVersion, lines: list[tuple[int, bytes]]) -> list[dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    requests: list[Request] = []
    for number, raw in lines:
        try:
            requests.append(read_request(loaded, number, raw))
        except RowError as err:
            results[number] = {"line": number, "error": str(err), "excerpt": excerpt(raw)}
    if requests:
        for request, answer in zip(requests, loaded.objective.answer(loaded.served, requests), strict=True):
            results[request.line] = {"line": request.line, **answer}
    return [results[number] for number, _ in lines]


def excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "…"


def dump(result: dict[str, Any]) -> str:
    """One JSON line; a perplexity that overflowed is written as null rather than invalid JSON."""
    return json.dumps({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in result.items()},
                      ensure_ascii=False)
