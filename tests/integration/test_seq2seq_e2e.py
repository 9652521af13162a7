"""Sequence-to-sequence end to end (slow): a T5 trained on pairs, registered as text2text-generation, re-scored by the
gate exactly as evaluation scored it, and asked through `llmops predict`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.config.schema import DataConfig
from llmops.data.synthetic import pair_records, words_task
from llmops.io.files import read_jsonl, write_jsonl
from llmops.objectives import selected
from tests.conftest import tiny_config
from tests.helpers import run_all_stages

CONFIG = "tiny_seq2seq_cpu.yaml"
OBJECTIVE = selected(DataConfig(kind="seq2seq"))


def write_pairs(path: Path, rows: int) -> Path:
    write_jsonl(path, pair_records(words_task, rows, seed=7))
    return path


@pytest.mark.slow
def test_t5_learns_to_write_numbers_registers_and_predicts_as_evaluated(tmp_path: Path) -> None:
    from llmops.registry.gate import score_version

    config = tiny_config(CONFIG, write_pairs(tmp_path / "pairs.jsonl", 1500))
    records = run_all_stages(config, "seq2seq-test")
    figures = records["evaluate"].figures
    trained, untrained = figures.metrics["trained"], figures.metrics["untrained"]
    print(f"held-out exact match {trained['exact_match']:.3f} (untrained {untrained['exact_match']:.3f}), ROUGE-L "
          f"{trained['rouge_l']:.3f} ({untrained['rouge_l']:.3f}), {records['train'].figures.steps} steps in "
          f"{records['train'].figures.seconds:.1f} s")
    assert figures.primary_metric == "exact_match"
    assert trained["exact_match"] > untrained["exact_match"] + 0.4
    assert trained["rouge_l"] > untrained["rouge_l"] + 0.5
    assert trained["completion_perplexity"] < untrained["completion_perplexity"] / 10
    registered = records["register"]
    assert registered.alias == "champion"

    # the registry holds a pyfunc of the project's seq2seq answers (transformers builds no text2text pipeline by name)
    # that the gate re-scores exactly as evaluation scored it
    uri = f"models:/{registered.model_name}/{registered.version}"
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "dl")))
    assert yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]["config"]["task"] == \
        OBJECTIVE.task
    heldout = list(read_jsonl(records["evaluate"].dir / "heldout.jsonl"))
    rescored = score_version(config, uri, heldout)
    assert rescored.values()["exact_match"] == pytest.approx(trained["exact_match"])

    samples = list(read_jsonl(records["evaluate"].dir / "samples.jsonl"))
    write_jsonl(tmp_path / "rows.jsonl", [{"input": row["source"], "target": row["target"]} for row in heldout])
    result = CliRunner().invoke(app, ["predict", f"{registered.model_name}/{registered.version}", "--input",
                                      str(tmp_path / "rows.jsonl"), "--batch-size", str(len(heldout))])
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [a["output"] for a in answers] == [s["trained_output"] for s in samples]
    assert [a["reference"] for a in answers] == [row["target"] for row in heldout]
    right = sum(a["output"] == a["reference"] for a in answers) / len(answers)
    assert right == pytest.approx(trained["exact_match"])
