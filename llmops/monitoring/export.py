"""Rated requests as rows of the pipeline's own kinds: the next dataset version.

- a correction of a chat request: an instruction row (one user turn) or a chat row ending with the corrected turn;
  of a seq2seq request: a source/target pair;
- a preferred answer: a preference row (the preferred answer chosen over the one the service gave);
- a label on a request of one text: a classification row.
A score alone is not a row (it is counted). Rows go to the output file when they are of the serving version's own
kind, and to `<stem>.<kind>.jsonl` beside it otherwise, so that each file is one data source. Rows the file
already holds stay and are not added twice. Guards, each counted: a row its version was trained on (its run's
inputs profile holds every training record's fingerprint) is dropped, and so is a row whose question the model
name's frozen evaluation set asks (contamination).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmops.data.near_fields import normalize
from llmops.data.profile import fingerprint
from llmops.monitoring.drift import kind_of
from llmops.monitoring.traces import MonitorError, ServedRequest
from llmops.records.base import RecordKind

# the kinds an export makes rows of
ROW_KINDS = ("instruction", "chat", "seq2seq", "preference", "classification")


@dataclass
class Exported:
    files: dict[str, Path] = field(default_factory=dict)
    added: Counter[str] = field(default_factory=Counter)
    kept: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        return {
            "files": {kind: str(path) for kind, path in self.files.items()},
            "added": dict(self.added),
            "kept": dict(self.kept),
            "dropped": dict(self.dropped),
        }


def rows_of(request: ServedRequest, own_kind: str) -> tuple[list[tuple[str, dict[str, Any]]], str | None]:
    """The rows a rated request makes, each with its kind; or none, with the reason."""
    if request.redacted:
        return [], "redacted (the trace keeps no text)"
    made: list[tuple[str, dict[str, Any]]] = []
    messages = request.inputs.get("messages")
    answer = request.outputs.get("output")
    rows = request.inputs.get("rows")
    single = rows[0] if isinstance(rows, list) and len(rows) == 1 and isinstance(rows[0], dict) else None
    correction, preferred, label = (request.rated(name) for name in ("correction", "preferred", "label"))
    if isinstance(correction, str) and isinstance(messages, list):
        made.append(kind_of({"kind": own_kind}).corrected(messages, correction))
    elif isinstance(correction, str) and single is not None and isinstance(single.get("source"), str):
        made.append(("seq2seq", {"source": single["source"], "target": correction}))
    if isinstance(preferred, str) and isinstance(messages, list) and isinstance(answer, str) and preferred != answer:
        made.append(("preference", {"prompt": messages, "chosen": preferred, "rejected": answer}))
    if label is not None and single is not None and isinstance(single.get("text"), str):
        made.append(("classification", {"text": single["text"], "label": label}))
    if made:
        return made, None
    rated = [name for name in ("score", "correction", "preferred", "label") if request.rated(name) is not None]
    if rated == ["score"]:
        return [], "score only"
    return [], f"{'/'.join(rated) or 'no feedback'} on a request of no row shape"


def export_rows(
    requests: list[ServedRequest],
    profiles: dict[str, dict[str, Any] | None],
    frozen_rows: list[dict[str, Any]],
    output: Path,
) -> Exported:
    """Write the rows the rated requests make (see the module's docstring); what was written, kept and dropped."""
    own = own_kind(profiles)
    frozen_kind = kind_of({"kind": own})
    asked_in_eval = {question(frozen_kind, row) for row in frozen_rows}
    result = Exported()
    files = existing_files(output, own)
    # each version's training records, as a set once (not once a request)
    fingerprints = {version: set(profile["fingerprints"]) for version, profile in profiles.items() if profile}
    for request in requests:
        made, reason = rows_of(request, own)
        if reason is not None:
            result.dropped[reason] += 1
            continue
        trained = fingerprints.get(request.version, set())
        for kind_name, row in made:
            kind = kind_of({"kind": kind_name})
            key = fingerprint(row, kind)
            if key in trained:
                result.dropped["already trained on"] += 1
            elif question(kind, row) in asked_in_eval:
                result.dropped["asked by the frozen evaluation set (contamination)"] += 1
            elif key in files.setdefault(kind_name, ({}, path_for(output, kind_name, own)))[0]:
                result.dropped["already exported"] += 1
            else:
                files[kind_name][0][key] = row
                result.added[kind_name] += 1
    for kind_name, (rows, path) in files.items():
        if rows:
            write_jsonl(path, rows.values())
            result.files[kind_name] = path
            result.kept[kind_name] = len(rows) - result.added[kind_name]
    return result


def own_kind(profiles: dict[str, dict[str, Any] | None]) -> str:
    kinds = {profile["kind"] for profile in profiles.values() if profile}
    if not kinds:
        raise MonitorError(
            "no served version's run kept an inputs profile: the rows it was trained on are unknown, "
            "so an export could repeat them; register a version with this llmops and serve it"
        )
    return sorted(kinds)[0]


def question(kind: RecordKind, row: dict[str, Any]) -> str:
    return normalize(kind.asked(row), casefold=True)


def path_for(output: Path, kind: str, own: str) -> Path:
    return output if kind == own else output.with_name(f"{output.stem}.{kind}{output.suffix or '.jsonl'}")


def existing_files(output: Path, own: str) -> dict[str, tuple[dict[str, dict[str, Any]], Path]]:
    """The rows earlier exports wrote, by kind and fingerprint: they stay, and are not added again."""
    held: dict[str, tuple[dict[str, dict[str, Any]], Path]] = {}
    siblings = [
        (path.name.split(".")[-2], path) for path in output.parent.glob(f"{output.stem}.*{output.suffix or '.jsonl'}")
    ]
    candidates = [(own, output), *((kind, path) for kind, path in siblings if kind in ROW_KINDS and kind != own)]
    for kind_name, path in candidates:
        if not path.is_file():
            continue
        kind = kind_of({"kind": kind_name})
        rows = {}
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise MonitorError(
                        f"{path}:{number}: not JSON ({err.msg}); the export adds to this file: "
                        "mend it or choose another --output"
                    ) from None
                rows[fingerprint(row, kind)] = row
        held[kind_name] = (rows, path)
    return held


def write_jsonl(path: Path, rows: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    partial.replace(path)
