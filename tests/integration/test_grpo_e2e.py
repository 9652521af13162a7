"""GRPO end to end (slow): the early-stopped tiny SFT model registered under its own name, GRPO with verifiable
rewards starting from it, held-out exact match compared with it (95% intervals) and the gate deciding on that
comparison, each reward's mean and spread, the completion length and the KL logged per step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from llmops.data.synthetic import instruction_records, prompt_records
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.tracking import log as tracking
from tests.helpers import run_all_stages

REPO = Path(__file__).resolve().parents[2]
PER_STEP = ("rewards/exact_match/mean", "rewards/exact_match/std", "rewards/chrf/mean", "rewards/chrf/std",
            "completions/mean_length", "kl")


@pytest.mark.slow
def test_grpo_from_a_registered_sft_version_is_judged_by_the_gate_on_heldout_exact_match(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "instructions.jsonl", instruction_records())
    write_jsonl(tmp_path / "prompts.jsonl", prompt_records(2000))
    started = time.perf_counter()
    sft = load_config(REPO / "configs" / "tiny_sft_early_cpu.yaml", [
        f"data.path={tmp_path / 'instructions.jsonl'}", "register.model_name=tiny-sft-early"])
    assert run_all_stages(sft, "sft")["register"].alias == "champion"
    sft_seconds = time.perf_counter() - started

    grpo = load_config(REPO / "configs" / "tiny_grpo_cpu.yaml", [
        f"data.path={tmp_path / 'prompts.jsonl'}", "model.name_or_path=models:/tiny-sft-early@champion",
        "register.model_name=tiny-grpo", "train.max_steps=20", "train.logging_steps=5",
        # a short run: 8 prompts of 4 completions a step, 100 held-out prompts
        "train.batch_size=32", "grpo.num_generations=4", "evaluate.max_examples=100"])
    records = run_all_stages(grpo, "grpo")
    figures = records["evaluate"].figures
    trained, start = figures.metrics["trained"], figures.metrics["base"]
    gained, interval = figures.gain_over_baseline["exact_match"], figures.intervals
    print(f"\nheld-out prompts {figures.examples}: exact_match SFT {start['exact_match']:.2f} "
          f"[{interval['base']['exact_match']['low']:.2f}, {interval['base']['exact_match']['high']:.2f}] -> GRPO "
          f"{trained['exact_match']:.2f} [{interval['trained']['exact_match']['low']:.2f}, "
          f"{interval['trained']['exact_match']['high']:.2f}], gain {gained['gain']:+.2f} [{gained['low']:+.2f}, "
          f"{gained['high']:+.2f}]; SFT {sft_seconds:.0f} s, GRPO {time.perf_counter() - started - sft_seconds:.0f} s")
    assert figures.primary_metric == "exact_match" and figures.baseline == "base" and figures.examples == 100
    assert gained["gain"] == pytest.approx(trained["exact_match"] - start["exact_match"])
    assert gained["low"] <= gained["gain"] <= gained["high"]
    # the same gate as every objective: the name's first version is champion only if it beats its starting point
    registration = records["register"]
    assert registration.model_name == "tiny-grpo"
    assert (registration.alias == "champion") == (gained["gain"] > 0), registration
    client = tracking.client(grpo.tracking)
    run_id = client.get_model_version("tiny-grpo", registration.version).run_id
    steps = grpo.train.max_steps // grpo.train.logging_steps
    for figure in PER_STEP:
        history = client.get_metric_history(run_id, tracking.metric_name("train", figure))
        assert len(history) >= steps, (figure, len(history))
    kl = [point.value for point in client.get_metric_history(run_id, "train/kl")]
    assert kl[0] >= 0 and max(kl) > 0
