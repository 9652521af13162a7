"""No text from the data or the config ever names an MLflow metric, param or tag: names are the code's own.

The run that broke logged "ingest.reject_reasons.broken JSON (Expecting value, column 42)" as a metric name.
Here a file full of bad rows, with odd column names, labels and file names, goes through ingest and validate
into a real MLflow run; every name logged is checked against a strict pattern and against the user's text.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest

from llmops.config.schema import PipelineConfig
from llmops.io.figures import Figures
from llmops.io.files import project_root
from llmops.io.rejects import CodeName
from llmops.pipeline.runner import log_stage, record_type
from llmops.pipeline.stages import STAGES
from llmops.tracking import log as tracking
from llmops.tracking import runs
from tests.helpers import stage

pytestmark = pytest.mark.reliability
# what the code names things with: lower-case words, digits, underscores, dots between them (a metric's group before
# a slash)
CODE_NAME = re.compile(r"[a-z][a-z0-9_]*(/[a-z0-9_]+)?(\.[a-z0-9_]+)*")
# maps that are logged although their keys are plain strings: the keys are written in the code itself
CODE_KEYED = {("evaluate", "metrics"): "model names and metric names chosen by llmops/evaluation/evaluate.py",
              ("evaluate", "intervals"): "model names, metric names (llmops/objectives/metrics.py) and low/high",
              ("evaluate", "gain_over_baseline"): "metric names (llmops/objectives/metrics.py) and gain/low/high"}
ODD = ["broken JSON (Expecting value, column 42)", "52,428,852 bytes", "naïve/../../x", "a b", "%2e%2e", "\u202e"]


def figures_classes() -> dict[str, type[Figures]]:
    found = {}
    for spec in STAGES:
        if spec.artifact:
            found[spec.name] = record_type(spec.name).model_fields["figures"].annotation
    return found


def nested_figures(model: type[Figures]) -> list[type[Figures]]:
    found = [model]
    for field in model.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Figures):
            found += nested_figures(field.annotation)
    return found


@pytest.mark.parametrize("stage", list(figures_classes()))
def test_every_logged_map_is_keyed_by_the_code(stage: str) -> None:
    """A figure map logged as metrics has enum or literal keys, or reject codes (CodeName: a code's own name, held to
    the pattern of a metric name); a new one keyed by plain strings fails here."""
    for model in nested_figures(figures_classes()[stage]):
        for name in model.NAMED_MAPS:
            key_type = get_args(model.model_fields[name].annotation)[0]
            code_keyed = (isinstance(key_type, type) and issubclass(key_type, Enum)) or \
                get_origin(key_type) is Literal or key_type is CodeName
            assert code_keyed or (stage, name) in CODE_KEYED, f"{stage}.{name} is logged but keyed by {key_type}"


def test_config_params_are_named_by_the_config_model_only() -> None:
    """Flattening the config never reaches into a mapping the user fills: column names and labels stay values."""
    config = PipelineConfig.model_validate({
        "data": {"kind": "classification", "labels": ODD[:2],
                 "sources": [{"path": "d.jsonl", "columns": {"text": ODD[0], "label": ODD[2]}}]},
        "tracking": {"tracking_uri": "http://someone:hunter2@127.0.0.1:5000"}})
    params = tracking.config_params(config)
    assert all(CODE_NAME.fullmatch(name) for name in params), [n for n in params if not CODE_NAME.fullmatch(n)]
    assert not [name for name in params for odd in ODD if odd in name]
    assert json.loads(params["data.sources"])[0]["columns"] == {"text": ODD[0], "label": ODD[2]}
    assert params["tracking.tracking_uri"] == "http://someone:***@127.0.0.1:5000"  # who connects, not the password
    assert "hunter2" not in json.dumps(params) + json.dumps(tracking.public_config(config))


@pytest.mark.slow
def test_a_run_of_bad_rows_with_odd_names_logs_only_code_names(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")  # tmp_path is the project: sources are named relative to it
    monkeypatch.chdir(tmp_path)
    assert project_root() == tmp_path.resolve()
    data = tmp_path / "my data (1), final.jsonl"
    rows = [b'{"text": "ok", "my label (v2)": "neutral, sort of"}',   # 1 kept
            b'{"text": "x", ',                                         # 2 json_broken
            b"[1, 2]",                                                 # 3 not_object
            b"null",                                                   # 4 not_object
            b"\xff\xfe",                                               # 5 utf8_invalid
            b'{"text": "' + b"a" * 300 + b'"}',                        # 6 too_large
            b'{"text": "nul \\u0000", "my label (v2)": "pos"}',        # 7 nul_byte
            b'{"text": 7}',                                            # 8 wrong_type (and the label is missing)
            b'{"my label (v2)": "pos"}',                               # 9 missing_field
            b'{"text": "meh", "my label (v2)": "other (v3)"}',         # 10 label_unknown
            b'{"text": "fine", "my label (v2)": "pos"}']               # 11 kept
    data.write_bytes(b"\n".join(rows))
    config = PipelineConfig.model_validate({
        "data": {"kind": "classification", "labels": ["pos", "neutral, sort of"], "max_record_bytes": 200,
                 "sources": [{"path": str(data), "columns": {"label": "my label (v2)"}}]},
        "validate": {"max_bad_fraction": 1.0}, "register": {"model_name": "names-test"}})
    ingested = stage("ingest", config)
    validated = stage("validate", config, ingested)
    assert set(validated.figures.codes) == {"json_broken", "not_object", "utf8_invalid", "too_large", "nul_byte",
                                            "wrong_type", "missing_field", "label_unknown"}

    with runs.pipeline_run(config, "names", {"config_path": str(data)}) as run:
        for record in (ingested, validated):
            log_stage(next(s for s in STAGES if s.name == record.stage), run, record, 0.1)
    logged = tracking.client(config.tracking).get_run(run.run_id).data
    names = {"metric": set(logged.metrics), "param": set(logged.params),
             "tag": {tag for tag in logged.tags if not tag.startswith("mlflow.")}}
    for kind, found in names.items():
        assert all(CODE_NAME.fullmatch(name) for name in found), (kind, sorted(found))
    user_text = ["my data", "my label", "neutral", "Expecting", "52,", "column", *ODD]
    assert not [name for found in names.values() for name in found for text in user_text if text in name]
    assert logged.metrics["validate/codes.label_unknown"] == 1.0
    assert logged.metrics["ingest/reject_codes.json_broken"] == 1.0
    table = {row["line"]: row for row in messages_table(config, run.run_id)}
    assert {line: row["code"] for line, row in table.items()} == {
        2: "json_broken", 3: "not_object", 4: "not_object", 5: "utf8_invalid", 6: "too_large", 7: "nul_byte",
        8: "wrong_type", 9: "missing_field", 10: "label_unknown"}
    assert table[10]["message"] == "label: 'other (v3)' is not one of data.labels (pos, neutral, sort of)"
    assert table[8]["message"] == "text: a number where text is expected; label: missing"
    assert table[10]["source"] == data.name and table[10]["field"] == "label"


def messages_table(config: PipelineConfig, run_id: str) -> list[dict[str, Any]]:
    """The quarantine table logged with the run: its columns and rows."""
    import mlflow

    local = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="data/quarantine.json",
                                                tracking_uri=tracking.tracking_uri(config.tracking))
    table = json.loads(Path(local).read_text())
    return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
