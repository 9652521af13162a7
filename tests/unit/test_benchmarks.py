"""Benchmarks through lm-eval: task folders and their keys, a real harness run on a tiny model, the guard's
arithmetic, and the config that names them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmops.config.evaluation import EvaluateConfig
from llmops.config.schema import PipelineConfig
from llmops.evaluation import benchmarks
from llmops.io.errors import ConfigError
from llmops.objectives import load_config
from llmops.registry.gate import benchmark_failures
from tests.conftest import REPO

pytest.importorskip("lm_eval")

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def task_folder(root: Path, name: str = "colours", rows: int = 12) -> Path:
    folder = root / "tasks"
    (folder / "data").mkdir(parents=True)
    (folder / f"{name}.yaml").write_text(TASK.format(name=name, data="data/colours.jsonl"))
    lines = [json.dumps({"question": f"Sky {i} is", "choices": ["blue", "green", "red"], "answer": i % 3})
             for i in range(rows)]
    (folder / "data" / "colours.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def config_with(root: Path, *names: str, **evaluate: object) -> PipelineConfig:
    return PipelineConfig.model_validate({"evaluate": {"benchmarks": list(names), "benchmark_paths": [str(root)],
                                                       **evaluate}})


def test_a_local_tasks_data_is_read_beside_its_yaml_wherever_llmops_runs(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    folder = task_folder(tmp_path)
    monkeypatch.chdir(REPO)  # not the task's folder
    (spec,) = benchmarks.task_specs(config_with(folder, "colours").evaluate)
    assert isinstance(spec, dict) and spec["task"] == "colours"
    assert spec["dataset_kwargs"]["data_files"] == {"test": str(folder / "data" / "colours.jsonl")}
    shipped, harness = benchmarks.task_specs(EvaluateConfig(benchmarks=["llmops_number_words", "hellaswag"]), REPO)
    assert isinstance(shipped, dict) and Path(shipped["dataset_kwargs"]["data_files"]["test"]).is_file()
    assert harness == "hellaswag"  # the harness's own: its name, its data from the hub


def test_the_key_covers_the_tasks_files_and_the_harness_version(tmp_path: Path) -> None:
    folder = task_folder(tmp_path)
    config = config_with(folder, "colours", "hellaswag")
    first = benchmarks.input_fingerprints(config, tmp_path)
    assert set(first) == {"lm-eval", "tasks"} and first["tasks"]["hellaswag"] == "lm-eval's own"
    assert benchmarks.input_fingerprints(config, tmp_path) == first
    with (folder / "data" / "colours.jsonl").open("a") as rows:
        rows.write(json.dumps({"question": "Grass is", "choices": ["blue", "green"], "answer": 1}) + "\n")
    changed = benchmarks.input_fingerprints(config, tmp_path)
    assert changed["tasks"]["colours"] != first["tasks"]["colours"]
    assert changed["tasks"]["hellaswag"] == first["tasks"]["hellaswag"]
    assert benchmarks.input_fingerprints(PipelineConfig(), tmp_path) == {}  # no benchmarks: nothing to cover


def test_missing_task_folders_and_data_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(benchmarks.BenchmarkError, match="evaluate.benchmark_paths: .*nowhere is not a folder"):
        benchmarks.input_fingerprints(config_with(tmp_path / "nowhere", "colours"), tmp_path)
    folder = task_folder(tmp_path)
    (folder / "data" / "colours.jsonl").unlink()
    with pytest.raises(benchmarks.BenchmarkError, match=r"benchmark colours: its data file .*colours.jsonl does not"):
        benchmarks.input_fingerprints(config_with(folder, "colours"), tmp_path)


def test_the_harness_scores_a_model_on_a_local_task_with_its_standard_error(tmp_path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = ["[UNK]", "Sky", "is", "blue", "green", "red", *map(str, range(12))]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[UNK]")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(words), n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                       bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():  # a model that always says "blue": right on every third question
        model.lm_head.weight.zero_()
        model.lm_head.weight[words.index("blue")] = 50.0 * model.transformer.ln_f.weight.sign()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.weight.abs_()
    settings = config_with(task_folder(tmp_path), "colours", batch_size=4).evaluate
    scored = benchmarks.run(model, tokenizer, benchmarks.task_specs(settings), settings, "causal")["colours"]
    assert scored["metric"] == "acc" and scored["higher_is_better"] and scored["samples"] == 12
    assert scored["score"] == pytest.approx(4 / 12)
    assert scored["stderr"] == pytest.approx(math.sqrt((4 / 12) * (8 / 12) / 11))  # the harness's sample stderr
    assert (scored["low"], scored["high"]) == pytest.approx((scored["score"] - 1.96 * scored["stderr"],
                                                             scored["score"] + 1.96 * scored["stderr"]))
    limited = settings.model_copy(update={"benchmark_limit": 5})
    assert benchmarks.run(model, tokenizer, benchmarks.task_specs(limited), limited, "causal")["colours"][
        "samples"] == 5


def score(value: float, higher_is_better: bool = True, stderr: float = 0.01) -> dict[str, object]:
    return {"metric": "acc" if higher_is_better else "perplexity", "higher_is_better": higher_is_better,
            "score": value, "stderr": stderr, "low": value - 1.96 * stderr, "high": value + 1.96 * stderr,
            "samples": 100}


def test_a_guard_fails_past_its_drop_in_the_metrics_own_direction() -> None:
    guards = {"arc": 0.02, "wiki": 1.0}
    candidate = {"arc": score(0.50), "wiki": score(12.5, higher_is_better=False)}
    assert benchmark_failures(candidate, {"arc": score(0.515), "wiki": score(12.0, False)}, guards, "x") == []
    failed = benchmark_failures(candidate, {"arc": score(0.60), "wiki": score(11.0, False)}, guards,
                                "champion version 3")
    assert failed == ["benchmark arc: acc 0.5 (95% CI [0.4804, 0.5196]) against champion version 3's acc 0.6 "
                      "(95% CI [0.5804, 0.6196]), a drop of 0.1 > max_drop 0.02",
                      "benchmark wiki: perplexity 12.5 (95% CI [12.48, 12.52]) against champion version 3's "
                      "perplexity 11 (95% CI [10.98, 11.02]), a drop of 1.5 > max_drop 1"]
    assert benchmark_failures({"arc": score(math.nan)}, {"arc": score(0.5)}, {"arc": 0.5}, "x")  # NaN fails


def test_guards_name_a_metric_or_a_benchmark_that_runs() -> None:
    shorthand = PipelineConfig.model_validate({"register": {"guards": {"chrf": 2}}}).registry
    assert shorthand.metric_guards() == {"chrf": 2} and shorthand.benchmark_guards() == {}
    both = PipelineConfig.model_validate({"evaluate": {"benchmarks": ["arc_easy"]}, "register": {"guards": [
        {"benchmark": "arc_easy", "max_drop": 0.02}, {"metric": "chrf", "max_drop": 2}]}}).registry
    assert both.benchmark_guards() == {"arc_easy": 0.02} and both.metric_guards() == {"chrf": 2}
    for guards, message in (([{"benchmark": "arc_easy", "max_drop": 0.02}], "arc_easy is not in evaluate.benchmarks"),
                            ([{"metric": "chrf", "benchmark": "x", "max_drop": 1}], "either a metric or a benchmark"),
                            ([{"metric": "chrf", "max_drop": 1}, {"metric": "chrf", "max_drop": 2}], "guarded twice"),
                            ([{"benchmark": "x"}], "max_drop")):
        with pytest.raises(ValidationError, match=message):
            PipelineConfig.model_validate({"register": {"guards": guards}})
    with pytest.raises(ValidationError, match="not a task name"):
        EvaluateConfig(benchmarks=["../tasks/x.yaml"])
    with pytest.raises(ValidationError, match="named twice"):
        EvaluateConfig(benchmarks=["paws-x.en", "PAWS_X_en"])


def test_a_tasks_scores_are_logged_under_a_metric_name_the_code_shapes() -> None:
    from llmops.evaluation.evaluate import EvaluateFigures

    figures = EvaluateFigures(metrics={}, intervals={}, gain_over_baseline={}, primary_metric="acc",
                              higher_is_better=True, primary_reason="", baseline="base", examples=1, eval_rows=1,
                              heldout_md5="", benchmarks={
        "trained": {"belebele_eng_Latn": score(0.5)}, "base": {"belebele_eng_Latn": score(0.4)}})
    logged = figures.loggable()
    assert logged["benchmarks.trained.belebele_eng_latn.score"] == 0.5
    assert logged["benchmarks.base.belebele_eng_latn.high"] == pytest.approx(0.4 + 1.96 * 0.01)
    assert not any("Latn" in name or "metric" in name for name in logged)


def test_benchmarks_are_refused_for_a_model_that_is_no_language_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="evaluate.benchmarks: classification trains no language model"):
        load_config(REPO / "configs" / "tiny_classify_cpu.yaml", ["evaluate.benchmarks=[llmops_number_words]"])
