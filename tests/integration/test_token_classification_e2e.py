"""Token classification end to end (slow): a tagger trained on entity records, registered as token-classification,
predicted with through `llmops predict` exactly as evaluated, and exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmops.data.synthetic import entity_records
from llmops.io.files import read_jsonl, write_jsonl
from llmops.objectives import load_config, metrics
from llmops.objectives.token_classification import METRICS, entities, tag_parts
from tests.helpers import run_all_stages

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tagger_learns_entities_registers_and_predicts_with_the_registered_version(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from llmops.cli.app import app

    data = tmp_path / "entities.jsonl"
    write_jsonl(data, entity_records(1000, seed=7))
    config = load_config(REPO / "configs" / "tiny_tokens_cpu.yaml", [f"data.path={data}"])
    records = run_all_stages(config, "tokens-test")

    evaluated = records["evaluate"].figures
    trained, untrained = evaluated.metrics["trained"], evaluated.metrics["untrained"]
    print(f"entity_f1 on {evaluated.examples} held-out rows: trained {trained['entity_f1']:.3f}, untrained "
          f"{untrained['entity_f1']:.3f}; token accuracy {trained['token_accuracy']:.3f} vs "
          f"{untrained['token_accuracy']:.3f}")
    assert evaluated.primary_metric == "entity_f1" and evaluated.examples >= 40
    assert trained["entity_f1"] > 0.85 and trained["entity_f1"] > untrained["entity_f1"] + 0.5
    assert evaluated.gain_over_baseline["entity_f1"]["low"] > 0.3  # the paired interval is far from zero
    assert trained["token_accuracy"] > untrained["token_accuracy"]
    registration = records["register"]
    assert (registration.model_name, registration.version, registration.alias) == ("llmops-tiny-tokens", "1",
                                                                                    "champion")

    # the registered version tags the held-out rows as the evaluation did; a text row is split on whitespace
    heldout = list(read_jsonl(records["evaluate"].dir / "heldout.jsonl"))
    samples = list(read_jsonl(records["evaluate"].dir / "samples.jsonl"))
    text = "  ".join(heldout[0]["tokens"])
    write_jsonl(tmp_path / "rows.jsonl", [{"tokens": r["tokens"]} for r in heldout] + [{"text": text}])
    result = CliRunner().invoke(app, ["predict", "llmops-tiny-tokens/1", "-i", str(tmp_path / "rows.jsonl")])
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [" ".join(a["tags"]) for a in answers[:-1]] == [s["trained_output"] for s in samples]
    recomputed = tag_parts([a["tags"] for a in answers[:-1]], [r["tags"] for r in heldout])["entity_f1"]
    assert metrics.value(METRICS["entity_f1"], recomputed) == pytest.approx(trained["entity_f1"])
    assert answers[-1]["tags"] == answers[0]["tags"] and answers[-1]["entities"] == answers[0]["entities"]
    # entities are the spans of the tags, with their words
    for answer, row in zip(answers, heldout, strict=False):
        assert [(e["type"], e["start"], e["end"]) for e in answer["entities"]] == entities(answer["tags"])
        assert all(row["tokens"][e["start"]:e["end"]] == e["words"] for e in answer["entities"])
    assert {"DATE", "NUM", "ROMAN"} <= {e["type"] for answer in answers for e in answer["entities"]}

    exported = tmp_path / "exported"
    result = CliRunner().invoke(app, ["models", "export", "llmops-tiny-tokens/1", str(exported)])
    assert result.exit_code == 0, result.output
    assert "pipeline_tag: token-classification" in (exported / "README.md").read_text()
