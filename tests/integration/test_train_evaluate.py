"""Training that learns, evaluation that tells it from the untrained model, and a resume from the last checkpoint
(moved from tests/unit: they train models)."""

import json
import logging

import pytest

from llmops.config.schema import PipelineConfig
from tests.helpers import data_stages, stage


@pytest.mark.slow
def test_sft_learns_and_beats_the_untrained_model(sft_config: PipelineConfig) -> None:
    deduped, tokenized = data_stages(sft_config)
    trained = stage("train", sft_config, tokenized)
    stats = trained.figures
    assert stats.last_logged_loss < 0.5 * stats.first_logged_loss
    assert stats.tokens > 0 and stats.tokens_per_s > 0
    assert (trained.dir / "model" / "model.safetensors").is_file()
    assert (trained.dir / "model" / "tokenizer.json").is_file()
    assert not (trained.dir / "checkpoints").exists()
    evaluated = stage("evaluate", sft_config, trained, tokenized, deduped)
    metrics = evaluated.figures.metrics
    assert metrics["trained"]["completion_perplexity"] < metrics["untrained"]["completion_perplexity"] / 10
    assert metrics["trained"]["exact_match"] > metrics["untrained"]["exact_match"]
    samples = [json.loads(line) for line in (evaluated.dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == sft_config.evaluate.max_examples
    assert {"prompt", "reference", "trained_output", "untrained_output"} <= set(samples[0])
    # unchanged inputs: nothing is retrained or re-evaluated
    assert stage("train", sft_config, tokenized).reused
    assert stage("evaluate", sft_config, trained, tokenized, deduped).reused


@pytest.mark.slow
def test_pretraining_from_scratch_learns(pretrain_config: PipelineConfig) -> None:
    deduped, tokenized = data_stages(pretrain_config)
    trained = stage("train", pretrain_config, tokenized)
    evaluated = stage("evaluate", pretrain_config, trained, tokenized, deduped)
    metrics = evaluated.figures.metrics
    assert evaluated.figures.primary_metric == "perplexity"
    assert metrics["trained"]["perplexity"] < metrics["untrained"]["perplexity"] / 10


@pytest.mark.slow
def test_training_resumes_from_its_last_checkpoint(sft_config: PipelineConfig, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    short = sft_config.model_copy(update={"train": sft_config.train.model_copy(
        update={"max_steps": 30, "save_steps": 10})})
    from llmops.training.callbacks import MetricsCallback

    _, tokenized = data_stages(short)

    def power_cut(self, args, state, control, **kwargs):
        if state.global_step == 25:
            raise RuntimeError("power cut")

    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="power cut"):
        patch.setattr(MetricsCallback, "on_step_end", power_cut, raising=False)
        stage("train", short, tokenized)
    partial = next((tokenized.dir.parents[1] / "train").glob("*.partial"))
    assert sorted(p.name for p in (partial / "checkpoints").glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]
    with caplog.at_level(logging.INFO, logger="llmops.train"):
        resumed = stage("train", short, tokenized)
    assert any("resuming training from" in r.message and "checkpoint-20" in r.message for r in caplog.records)
    assert resumed.figures.steps == 30 and not partial.exists()
