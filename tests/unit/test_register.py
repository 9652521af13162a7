from pathlib import Path

import mlflow
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from tasks import tracking, workspace
from tasks.config import RegisterConfig, TrackingConfig
from tasks.evaluate import EvaluateFigures, EvaluateRecord
from tasks.lineage import Lineage
from tasks.register import list_versions, register_model
from tasks.tokenize import train_tokenizer
from tasks.tracking import RunHandle
from tasks.train import TrainFigures, TrainRecord
from tasks.versions import DataVersion
from tasks.workspace import artifact_dir, write_jsonl

LINEAGE = Lineage(git_commit="abc123", git_dirty=False, config_hash="cfg1", flow_run_id="flow-1", data_sha256="s1",
                  data=DataVersion(dvc_file="data.dvc", dvc_md5="d41d8cd9.dir", matches_dvc=True))


def saved_model(seed: int) -> TrainRecord:
    """A tiny random model and tokenizer, saved the way the train stage saves them."""
    folder = artifact_dir("train", f"k{seed}")
    corpus = folder / "corpus.jsonl"
    folder.mkdir(parents=True)
    write_jsonl(corpus, [{"text": f"row {i} says hello"} for i in range(50)])
    tokenizer: PreTrainedTokenizerFast = train_tokenizer(corpus, "text", 300)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return TrainRecord(stage="train", key=f"k{seed}", hash=workspace.hash_tree(folder / "model"),
                       figures=TrainFigures.model_construct())


def evaluated(exact: float) -> EvaluateRecord:
    return EvaluateRecord(stage="evaluate", key="e", hash="h", figures=EvaluateFigures(
        metrics={"trained": {"exact_match": exact, "perplexity": 2.0},
                 "untrained": {"exact_match": 0.0, "perplexity": 300.0}},
        intervals={}, gain_over_baseline={}, primary_metric="exact_match", higher_is_better=True,
        primary_reason="short answers", baseline="untrained", examples=10, eval_rows=10, heldout_md5="m"))


def new_run(config: TrackingConfig) -> RunHandle:
    run_id = tracking.client(config).create_run(tracking.experiment_id(config)).info.run_id
    return RunHandle(tracking=config, run_id=run_id)


def test_champion_challenger_and_no_duplicates(tmp_path: Path) -> None:
    tracking_config = TrackingConfig()
    registry = RegisterConfig(model_name="demo")
    first_model = saved_model(1)
    first = register_model(registry, new_run(tracking_config), first_model, evaluated(0.5), LINEAGE, "instruction")
    assert (first.version, first.alias, first.reused) == ("1", "champion", False)

    again = register_model(registry, new_run(tracking_config), first_model, evaluated(0.5), LINEAGE, "instruction")
    assert (again.version, again.alias, again.reused) == ("1", "champion", True)

    worse = register_model(registry, new_run(tracking_config), saved_model(2), evaluated(0.4), LINEAGE,
                     "instruction")
    assert (worse.version, worse.alias, worse.previous_champion) == ("2", "challenger", "1")

    better = register_model(registry, new_run(tracking_config), saved_model(3), evaluated(0.9), LINEAGE,
                      "instruction")
    assert (better.version, better.alias, better.previous_champion) == ("3", "champion", "1")

    mlflow_client = tracking.client(tracking_config)
    assert mlflow_client.get_model_version_by_alias("demo", "champion").version in (3, "3")
    assert mlflow_client.get_model_version_by_alias("demo", "challenger").version in (2, "2")
    tags = mlflow_client.get_model_version("demo", "3").tags
    assert tags["git_commit"] == "abc123" and tags["dvc_data_md5"] == "d41d8cd9.dir"
    assert tags["config_hash"] == "cfg1" and tags["prefect_flow_run_id"] == "flow-1"
    assert tags["metric.trained.exact_match"] == "0.9" and tags["primary_metric"] == "exact_match"
    rows = {row["version"]: row for row in list_versions(tracking_config)}
    assert set(rows) == {"1", "2", "3"}
    assert rows["3"]["aliases"] == ["champion"] and rows["2"]["aliases"] == ["challenger"]
    assert rows["3"]["trained"] == "0.9" and rows["3"]["baseline"] == "0"


def test_registered_weights_load_back_identically(tmp_path: Path) -> None:
    tracking_config = TrackingConfig()
    trained = saved_model(4)
    register_model(RegisterConfig(model_name="roundtrip"), new_run(tracking_config), trained, evaluated(0.1), LINEAGE,
             "instruction")
    loaded = mlflow.transformers.load_model("models:/roundtrip@champion", return_type="components")
    original = AutoModelForCausalLM.from_pretrained(trained.dir / "model")
    ids = loaded["tokenizer"]("row 7 says hello", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded["model"](ids).logits, original(ids).logits)
