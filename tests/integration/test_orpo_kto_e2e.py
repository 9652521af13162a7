"""ORPO and KTO end to end (slow): the shipped tiny configs, from a registered SFT champion, through every stage:
the gate makes each trained version champion over its starting point, the version's lineage and card are
registered, and `llmops predict` answers chat rows with it. The SFT champion is the `sft_champion` fixture's
(tests/integration/conftest.py), trained once per test process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llmops.data.synthetic import feedback_records, preference_records
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.serving import predict
from llmops.tracking import log as tracking
from tests.helpers import run_all_stages

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ROWS = [b'{"messages": [{"role": "user", "content": "Write this date in words.\\n\\n2031-05-17"}]}',
        b'{"instruction": "Write this number in words.", "input": "42", "output": "forty-two"}']


# each method: its shipped config, its data, the metric it must raise, and by how much at least
METHODS = {
    "orpo": ("tiny_orpo_cpu.yaml", lambda: preference_records(600, seed=12), "preference_accuracy", 0.02),
    "kto": ("tiny_kto_cpu.yaml", lambda: feedback_records(600, seed=13), "reward_auc", 0.03),
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_method_from_the_registered_sft_champion_is_gated_registered_and_answers(
        method: str, sft_champion: str, tmp_path: Path) -> None:
    config_file, records, metric, least_gain = METHODS[method]
    write_jsonl(tmp_path / "data.jsonl", records())
    config = load_config(REPO / "configs" / config_file, [
        f"data.path={tmp_path / 'data.jsonl'}", f"model.name_or_path={sft_champion}", "data.eval_fraction=0.15",
        "evaluate.max_examples=80", f"register.model_name=tiny-{method}"])
    started = time.perf_counter()
    records_by_stage = run_all_stages(config, method)
    figures = records_by_stage["evaluate"].figures
    trained, start = figures.metrics["trained"], figures.metrics["base"]
    print(f"\n{method}: held-out {figures.examples}, {metric} SFT {start[metric]:.3f} -> {trained[metric]:.3f}, "
          f"gain 95% CI [{figures.gain_over_baseline[metric]['low']:.3f}, "
          f"{figures.gain_over_baseline[metric]['high']:.3f}]; all {json.dumps(trained)}; "
          f"{time.perf_counter() - started:.0f} s")
    assert figures.primary_metric == metric and figures.baseline == "base"
    assert trained[metric] > start[metric] + least_gain
    # the implied reward of the preferred answers rose over the others', beyond the noise of the held-out rows
    assert start["reward_margin"] == 0.0 and figures.gain_over_baseline["reward_margin"]["low"] > 0
    registration = records_by_stage["register"]
    assert registration.alias == "champion" and registration.model_name == f"tiny-{method}"
    version = tracking.client(config.tracking).get_model_version(f"tiny-{method}", registration.version)
    assert version.tags["objective"] == method and json.loads(version.tags["packages"])["trl"]
    assert version.tags["config_hash"] and "git_commit" in version.tags and f"{metric}" in version.description
    answers = list(predict.predict_lines(predict.load(f"tiny-{method}@champion", config.tracking), ROWS, 4))
    assert all(isinstance(answer["output"], str) for answer in answers) and answers[1]["reference"] == "forty-two"

