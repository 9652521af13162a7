"""Every stage reads only config fields its key covers: a field read but not keyed would be a stale artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from llmops.config.schema import is_placement
from llmops.data.synthetic import classification_records, instruction_records
from llmops.io.files import write_jsonl
from llmops.objectives.config import complete
from llmops.pipeline.runner import build_stage, resolve
from llmops.pipeline.stages import STAGES, WHOLE_CONFIG, StageContext
from llmops.tracking.log import RunHandle, client, experiment_id

pytestmark = pytest.mark.slow


class Recorder:
    """A read-only view of a config section that records the dotted path of every field read through it."""

    def __init__(self, model: BaseModel, path: str, reads: set[str]) -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_reads", reads)

    def __getattr__(self, name: str) -> Any:
        model: BaseModel = self._model
        fields = type(model).model_fields
        attribute = next((n for n, f in fields.items() if name in (n, f.alias)), None)
        if attribute is None:  # a method (model_dump, digest...): it reads the whole section
            self._reads.add(self._path)
            return getattr(model, name)
        path = f"{self._path}.{fields[attribute].alias or attribute}".lstrip(".")
        value = getattr(model, attribute)
        if isinstance(value, BaseModel):
            return Recorder(value, path, self._reads)
        self._reads.add(path)
        return value

    def __hash__(self) -> int:
        return hash(self._model)


def covered(read: str, declared: tuple[str, ...]) -> bool:
    """Declared, or placement (the engine a stage works on): where work happens shapes nothing."""
    return is_placement(read) or any(d == WHOLE_CONFIG or read == d or read.startswith(d + ".") for d in declared)


@pytest.mark.parametrize("kind", ["instruction", "classification"])
def test_every_stage_reads_only_the_fields_its_key_covers(kind: str, tmp_path: Path) -> None:
    rows = instruction_records(300, seed=1) if kind == "instruction" else classification_records(300, seed=1)
    write_jsonl(tmp_path / "d.jsonl", rows)
    config = complete({
        "data": {"path": str(tmp_path / "d.jsonl"), "kind": kind,
                 "labels": ["date", "words", "roman"] if kind == "classification" else []},
        "tokenize": {"vocab_size": 300, "max_length": 48},
        "model": {"hidden_size": 16, "num_layers": 1, "num_heads": 2},
        "train": {"max_steps": 2, "batch_size": 8}, "evaluate": {"max_examples": 4, "max_new_tokens": 4}})
    run = RunHandle(tracking=config.tracking,
                    run_id=client(config.tracking).create_run(experiment_id(config.tracking)).info.run_id)
    records: dict[str, Any] = {}
    for spec in STAGES:
        reads: set[str] = set()
        function = resolve(spec.function)
        upstream = [records[up] for up in spec.upstream]
        watched = Recorder(config, "", reads)
        if spec.artifact:
            folder = tmp_path / "reads" / spec.name
            folder.mkdir(parents=True)
            function(watched, *upstream, StageContext(folder=folder, key=f"reads-{spec.name}", run=run))
            records[spec.name] = build_stage(spec.name, config, *upstream, run=run)
        else:
            records[spec.name] = function(watched, *upstream, StageContext(run=run))
        stray = sorted(read for read in reads if not covered(read, spec.reads))
        assert not stray, f"stage {spec.name} reads {stray}, which its key does not cover"
