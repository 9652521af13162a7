"""A reward model end to end (slow): trained from scratch on preference pairs through every stage, ranking held-out
pairs above the untrained model, registered through the gate with its card, scoring `llmops predict` rows, and
scoring the same through the folder a later stage loads it from."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llmops.data.synthetic import preference_records
from llmops.io.files import write_jsonl
from llmops.io.tables import table_rows
from llmops.objectives import load_config
from llmops.objectives.reward import score
from llmops.registry.bases import local_folder
from llmops.serving import predict
from llmops.tracking import log as tracking
from tests.helpers import run_all_stages

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_reward_model_ranks_held_out_pairs_and_scores_predict_rows(tmp_path: Path) -> None:
    # the pairs `llmops data init` writes: a model this small needs all of them to start ranking
    write_jsonl(tmp_path / "pairs.jsonl", preference_records(3000))
    config = load_config(REPO / "configs" / "tiny_reward_cpu.yaml", [
        f"data.path={tmp_path / 'pairs.jsonl'}", "register.model_name=tiny-reward"])
    started = time.perf_counter()
    records = run_all_stages(config, "reward")
    seconds = time.perf_counter() - started
    figures = records["evaluate"].figures
    trained, untrained = figures.metrics["trained"], figures.metrics["untrained"]
    print(f"\nheld-out pairs {figures.examples}: pairwise_accuracy untrained {untrained['pairwise_accuracy']:.3f} -> "
          f"trained {trained['pairwise_accuracy']:.3f} (gain CI {figures.gain_over_baseline['pairwise_accuracy']}); "
          f"score_margin {trained['score_margin']:.3f}, pair_loss {untrained['pair_loss']:.3f} -> "
          f"{trained['pair_loss']:.3f}; {records['train'].figures.steps} steps, pipeline {seconds:.0f} s")
    assert figures.primary_metric == "pairwise_accuracy" and figures.baseline == "untrained"
    assert figures.gain_over_baseline["pairwise_accuracy"]["low"] > 0
    assert trained["score_margin"] > 0 and trained["pair_loss"] < untrained["pair_loss"]

    registration = records["register"]
    assert registration.alias == "champion" and registration.model_name == "tiny-reward"
    version = tracking.client(config.tracking).get_model_version("tiny-reward", registration.version)
    assert "pairwise_accuracy" in version.description and json.loads(version.tags["packages"])["trl"]

    held_out = list(table_rows(records["dedup"].dir / "eval"))[:40]
    rows = [{"prompt": pair["prompt"], "response": pair[side]} for pair in held_out for side in ("chosen", "rejected")]
    loaded = predict.load("tiny-reward@champion", config.tracking)
    lines = [json.dumps(row).encode() for row in rows] + [b'{"prompt": "Spell 4."}']
    answers = list(predict.predict_lines(loaded, lines, batch_size=16))
    assert "error" in answers[-1] and answers[-1]["line"] == len(rows) + 1
    scores = [answer["score"] for answer in answers[:-1]]
    ranked = sum(scores[2 * i] > scores[2 * i + 1] for i in range(len(held_out))) / len(held_out)
    assert ranked > untrained["pairwise_accuracy"]

    # the folder a later stage (a GRPO reward) scores with: the registered version resolved through the registry
    folder = local_folder("models:/tiny-reward@champion", config.tracking)
    again = score(folder, rows, max_length=config.tokenize.max_length, batch_size=16)
    assert again == pytest.approx(scores, abs=1e-4)
