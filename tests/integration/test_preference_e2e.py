"""DPO end to end (slow): a registered SFT champion (the `sft_champion` fixture's, trained once per test process) as
the starting model, DPO raising the held-out preference accuracy over it, the registered DPO version answering
`llmops predict` rows."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llmops.config.schema import PipelineConfig
from llmops.data.synthetic import preference_records
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.serving import predict
from llmops.tracking import log as tracking
from tests.helpers import run_all_stages

REPO = Path(__file__).resolve().parents[2]


def preference_config(path: Path, *overrides: str) -> PipelineConfig:
    return load_config(REPO / "configs" / "tiny_dpo_cpu.yaml", [f"data.path={path}", *overrides])


@pytest.mark.slow
def test_dpo_from_the_registered_sft_champion_raises_preference_accuracy(sft_champion: str, tmp_path: Path) -> None:
    write_jsonl(tmp_path / "pairs.jsonl", preference_records(900, seed=12))
    started = time.perf_counter()
    dpo = preference_config(tmp_path / "pairs.jsonl", f"model.name_or_path={sft_champion}",
                            "data.eval_fraction=0.15", "register.model_name=tiny-dpo")
    records = run_all_stages(dpo, "dpo")
    figures = records["evaluate"].figures
    trained, start = figures.metrics["trained"], figures.metrics["base"]
    dpo_seconds = time.perf_counter() - started
    print(f"\nheld-out pairs {figures.examples}: preference_accuracy SFT {start['preference_accuracy']:.3f} -> DPO "
          f"{trained['preference_accuracy']:.3f}; reward_margin {start['reward_margin']:.3f} -> "
          f"{trained['reward_margin']:.3f}; DPO {dpo_seconds:.0f} s")
    assert figures.primary_metric == "preference_accuracy" and figures.baseline == "base"
    assert start["reward_margin"] == 0.0
    assert trained["preference_accuracy"] > start["preference_accuracy"] + 0.04
    assert trained["reward_margin"] > 0.3 and figures.gain_over_baseline["reward_margin"]["low"] > 0
    registration = records["register"]
    assert registration.alias == "champion" and registration.model_name == "tiny-dpo"
    version = tracking.client(dpo.tracking).get_model_version("tiny-dpo", registration.version)
    assert json.loads(version.tags["packages"])["trl"]
    predictor = predict.load("tiny-dpo@champion", dpo.tracking)
    rows = [b'{"messages": [{"role": "user", "content": "Write this date in words.\\n\\n2031-05-17"}]}',
            b'{"instruction": "Write this number in words.", "input": "42", "output": "forty-two"}']
    answers = list(predict.predict_lines(predictor, rows, batch_size=4))
    assert all(isinstance(answer["output"], str) for answer in answers) and answers[1]["reference"] == "forty-two"
