"""Masked language modelling end to end (slow): an encoder trained from scratch, registered as fill-mask, asked to
fill masks through `llmops predict`, re-scored as a champion and exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.io.tables import table_rows
from llmops.objectives import masked_lm
from tests.conftest import tiny_config
from tests.helpers import run_all_stages

runner = CliRunner()
MLM = "tiny_mlm_cpu.yaml"


@pytest.mark.slow
def test_an_encoder_learns_to_fill_masks_and_its_registered_version_fills_them(text_file: Path,
                                                                               tmp_path: Path) -> None:
    import mlflow
    import yaml

    records = run_all_stages(tiny_config(MLM, text_file), "masked-lm-test")
    figures = records["evaluate"].figures
    trained, untrained = figures.metrics["trained"], figures.metrics["untrained"]
    assert figures.primary_metric == "masked_accuracy" and not records["train"].figures.packed
    print(f"masked LM, {figures.examples} held-out rows: trained {trained}, untrained {untrained}")
    assert trained["masked_accuracy"] > untrained["masked_accuracy"] + 0.2
    assert trained["masked_perplexity"] < untrained["masked_perplexity"] / 10
    registration = records["register"]
    assert registration.alias == "champion"
    local = Path(mlflow.artifacts.download_artifacts(f"models:/llmops-tiny-mlm/{registration.version}",
                                                     dst_path=str(tmp_path / "registered")))
    assert yaml.safe_load((local / "MLmodel").read_text())["flavors"]["transformers"]["task"] == "fill-mask"

    # held-out sentences with " written" hidden, as the placeholder and as the model's own mask token
    held_out = [row["text"] for row in table_rows(records["dedup"].dir / "eval")][:11]
    rows = [{"text": text.replace(" written", " [MASK]", 1)} for text in held_out[:10]]
    rows += [{"text": held_out[10].replace(" written", "<|mask|>", 1)}, {"text": held_out[10]}]
    result = runner.invoke(app, ["predict", f"llmops-tiny-mlm/{registration.version}", "--input", "-"],
                           input="".join(json.dumps(row) + "\n" for row in rows))
    assert result.exit_code == 1, result.output  # the row without a mask is an error row
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    for answer in answers[:11]:
        fills = answer["masks"][0]["fills"]
        assert len(answer["masks"]) == 1 and len(fills) == masked_lm.TOP_K
        probabilities = [fill["probability"] for fill in fills]
        assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 1 + 1e-6
    right = [answer["filled"] == text for answer, text in zip(answers[:11], held_out, strict=True)]
    assert sum(right) >= 9, answers
    tops = [answer["masks"][0]["fills"][0]["token"] for answer in answers[:11]]
    assert all(top == " written" for top, ok in zip(tops, right, strict=True) if ok)
    assert answers[11]["line"] == 12 and "no masked position to fill" in answers[11]["error"]

    # a second training is judged against the champion re-scored from the registry: the same held-out mask gives
    # the champion exactly the figures its own evaluation recorded
    retrained = tiny_config(MLM, text_file, "train.seed=1", "train.max_steps=30")
    second = run_all_stages(retrained, "masked-lm-test")["register"]
    assert second.comparison is not None and second.comparison.champion_version == registration.version
    assert second.comparison.champion == pytest.approx(trained, rel=1e-6)

    exported = runner.invoke(app, ["models", "export", f"llmops-tiny-mlm/{registration.version}",
                                   str(tmp_path / "exported")])
    assert exported.exit_code == 0, exported.output
    assert "pipeline_tag: fill-mask" in (tmp_path / "exported" / "README.md").read_text()
