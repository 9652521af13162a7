"""Run stages of a config the way the flow does, for tests of later stages."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from llmops.config import files
from llmops.config.schema import PipelineConfig
from llmops.data.dedup import DedupRecord
from llmops.data.tokenize import TokenizeRecord
from llmops.io.files import project_root
from llmops.pipeline.runner import build_stage, run_chain
from llmops.tracking import runs


def stage(name: str, config: PipelineConfig, *upstream: Any) -> Any:
    """One stage's record (its artifact found or built under its key), without the run's logging or its gate."""
    return build_stage(name, config, *upstream)


def data_stages(config: PipelineConfig) -> tuple[DedupRecord, TokenizeRecord]:
    ingested = stage("ingest", config)
    deduped = stage("dedup", config, stage("validate", config, ingested))
    return deduped, stage("tokenize", config, deduped)


def run_all_stages(config: PipelineConfig, run_name: str) -> dict[str, Any]:
    """Every stage of the stage table in one MLflow run, as the flow runs them (without Prefect); records by stage."""
    with runs.pipeline_run(config, run_name, {}) as run:
        return run_chain(config, run)


def project_at(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make `folder` the project the stages run in (the root relative source paths, and source names, are read
    against), for the rest of the test."""
    (folder / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(folder)
    assert project_root() == folder.resolve()
    return folder


@contextmanager
def workspace_at(folder: Path) -> Iterator[None]:
    """LLMOPS_HOME for work that outlives one test (module fixtures); the test's own is put back after."""
    previous = os.environ.get("LLMOPS_HOME")
    os.environ["LLMOPS_HOME"] = str(folder)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LLMOPS_HOME", None)
        else:
            os.environ["LLMOPS_HOME"] = previous


def output_bytes(folder: Path, *names: str) -> dict[str, bytes]:
    """The bytes of each named output of a stage folder, a file or a table (each file in its folder)."""
    found: dict[str, bytes] = {}
    for name in names:
        path = folder / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        found.update({str(file.relative_to(folder)): file.read_bytes() for file in files})
    return found


def write_rows_table(rows: list[dict[str, Any]], folder: Path, rows_per_group: int | None = None) -> Path:
    """`rows` as a stage writes them, a table; with `rows_per_group`, in row groups that small, so that a small
    table is cut into many shards (only this table: what a stage writes keeps its own row groups)."""
    from llmops.io import tables
    from llmops.io.table_types import column_types

    with pytest.MonkeyPatch.context() as patch:
        if rows_per_group:
            patch.setattr(tables, "ROWS_PER_GROUP", rows_per_group)
        tables.write_table(rows, column_types(rows), folder)
    return folder


def register_random_language_model(name: str, config: Any, scratch: Path) -> str:
    """A tiny random causal LM with the scratch chat template (a BPE tokenizer trained on 50 rows), registered as a
    new version of `name` in the registry `config` (a TrackingConfig) names, @champion; its version number."""
    import mlflow
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmops.io.files import read_jsonl, write_jsonl
    from llmops.text.tokenizers import prepare_tokenizer, train_bpe
    from llmops.tracking import log as tracking

    corpus = scratch / "corpus.jsonl"
    write_jsonl(corpus, [{"text": f"row {i} says hello"} for i in range(50)])
    tokenizer = train_bpe((row["text"] for row in read_jsonl(corpus)), 300)
    prepare_tokenizer(tokenizer, None, trained_here=True)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
    mlflow_client = tracking.client(config)
    with mlflow.start_run(experiment_id=tracking.experiment_id(config)):
        info = mlflow.transformers.log_model({"model": model, "tokenizer": tokenizer}, name="model",
                                             task="text-generation", pip_requirements=["transformers"],
                                             model_card=ModelCard(f"# {name}\n"))
    version = str(mlflow.register_model(info.model_uri, name).version)
    mlflow_client.set_registered_model_alias(name, "champion", version)
    return version


def count_parses(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """From here on, how often this process reads a config file ("read") and parses a config ("parse"); each read
    and parse still happens."""
    counts: Counter[str] = Counter()
    read, parse = files.read_yaml, PipelineConfig.model_validate

    def reading(path: Path) -> dict[str, Any]:
        counts["read"] += 1
        return read(path)

    def parsing(*args: Any, **kwargs: Any) -> PipelineConfig:
        counts["parse"] += 1
        return parse(*args, **kwargs)

    monkeypatch.setattr(files, "read_yaml", reading)
    monkeypatch.setattr(PipelineConfig, "model_validate", staticmethod(parsing))
    return counts


def metric_total(metrics: str, prefix: str) -> float:
    """The sum of the Prometheus samples whose line starts with `prefix` (a name, or a name and its first labels)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix))
