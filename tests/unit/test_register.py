import json
import re
from pathlib import Path

import mlflow
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.config.schema import DataConfig, TrackingConfig
from llmops.evaluation.evaluate import HELDOUT, EvaluateFigures, EvaluateRecord, md5_of
from llmops.io.files import hash_tree, write_jsonl
from llmops.objectives import selected
from llmops.registry import aliases, gate
from llmops.registry.references import RegistryError
from llmops.registry.register import create_version, log_model
from llmops.store.workspace import artifact_dir
from llmops.text.tokenizers import train_bpe
from llmops.tracking import log as tracking
from llmops.tracking.log import RunHandle
from llmops.training.session import TrainFigures, TrainRecord

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> TrackingConfig:
    """One tracking store for this module's tests (a new SQLite store costs seconds of migrations); each test
    registers its own model names."""
    folder = tmp_path_factory.mktemp("store")
    settings = TrackingConfig(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    tracking.client(settings).create_experiment(settings.experiment, artifact_location=(folder / "art").as_uri())
    return settings


@pytest.fixture
def config_file(store: TrackingConfig, tmp_path: Path) -> str:
    """A config naming the store, for the CLI."""
    path = tmp_path / "config.yaml"
    path.write_text(f"tracking:\n  tracking_uri: {store.tracking_uri}\n")
    return str(path)


def saved_model(seed: int) -> TrainRecord:
    """A tiny random model and tokenizer, saved the way the train stage saves them."""
    folder = artifact_dir("train", f"k{seed}")
    folder.mkdir(parents=True)
    tokenizer: PreTrainedTokenizerFast = train_bpe([f"row {i} says hello" for i in range(50)], 300)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return TrainRecord(stage="train", key=f"k{seed}", hash=hash_tree(folder / "model"),
                       figures=TrainFigures.model_construct())


def new_run(config: TrackingConfig) -> RunHandle:
    run_id = tracking.client(config).create_run(tracking.experiment_id(config)).info.run_id
    return RunHandle(tracking=config, run_id=run_id)


def registered(store: TrackingConfig, name: str, count: int) -> list[str]:
    """Versions registered from runs' artifact folders, without the gate: what alias moves act on (they never
    read the weights)."""
    mlflow_client = tracking.client(store)
    if not aliases.exists(mlflow_client, name):
        mlflow_client.create_registered_model(name)
    versions = []
    for _ in range(count):
        run = mlflow_client.get_run(new_run(store).run_id)
        versions.append(str(mlflow_client.create_model_version(name, run.info.artifact_uri, run.info.run_id).version))
    return versions


def champion_of(store: TrackingConfig, name: str) -> str:
    return str(tracking.client(store).get_model_version_by_alias(name, "champion").version)


def test_promote_and_rollback_move_the_alias_and_record_history(store: TrackingConfig, config_file: str) -> None:
    settings = store
    assert registered(store, "moves", 3) == ["1", "2", "3"]
    mlflow_client = tracking.client(settings)
    aliases.move_alias(mlflow_client, "moves", "champion", "1", "gate", "first version", "pipeline run r1")
    aliases.move_alias(mlflow_client, "moves", "challenger", "2", "gate", "does not beat version 1", "pipeline run r2")

    result = runner.invoke(app, ["models", "promote", "moves", "2", "--reason", "checked by hand", "-c",
                                 config_file])
    assert result.exit_code == 0, result.output
    assert "champion → version 2 (was version 1)" in result.output
    assert champion_of(store, "moves") == "2"
    assert "challenger" not in mlflow_client.get_registered_model("moves").aliases  # it is champion now
    aliases.promote(settings, "moves", "3")
    assert champion_of(store, "moves") == "3"

    result = runner.invoke(app, ["models", "rollback", "moves", "--reason", "bad answers in production", "-c",
                                 config_file])
    assert result.exit_code == 0, result.output
    assert champion_of(store, "moves") == "2"
    assert aliases.rollback(settings, "moves")["version"] == "1"
    assert champion_of(store, "moves") == "1"
    with pytest.raises(RegistryError, match="no earlier champion recorded before version 1"):
        aliases.rollback(settings, "moves")

    moves = aliases.history(mlflow_client, "moves")
    assert [(m["alias"], m["version"], m["previous"], m["action"]) for m in moves] == [
        ("champion", "1", None, "gate"), ("challenger", "2", None, "gate"), ("champion", "2", "1", "promote"),
        ("champion", "3", "2", "promote"), ("champion", "2", "3", "rollback"), ("champion", "1", "2", "rollback")]
    assert moves[2]["reason"] == "checked by hand" and moves[2]["by"].endswith("llmops models promote")
    assert moves[4]["reason"] == "rolled back from version 3: bad answers in production"
    assert all(m["at"].endswith("+00:00") for m in moves)


def test_registry_commands_say_what_is_wrong_in_one_line(store: TrackingConfig, config_file: str) -> None:
    registered(store, "known", 1)
    # each line says what exists instead (the store is shared by this module's tests: other names may be listed)
    for args, expected in ((["models", "show", "unknown"], r"no registered model 'unknown' in sqlite:///\S+ "
                            r"\(registered models: (.+, )?known(, .+)?\)"),
                           (["models", "show", "known/7"], r"known has no version 7 \(versions: 1\)"),
                           (["models", "show", "known@champion"], r"known has no alias 'champion' \(aliases: none\)"),
                           (["models", "promote", "known", "9"], "known has no version 9"),
                           (["models", "rollback", "known"], "known has no champion to roll back")):
        result = runner.invoke(app, [*args, "-c", config_file])
        assert result.exit_code == 2, (args, result.output)
        assert re.fullmatch(f"error: {expected}", result.output.strip()), (args, result.output)


def evaluated_on(rows: list[dict], key: str) -> EvaluateRecord:
    """An evaluate record whose held-out file holds these rows."""
    folder = artifact_dir("evaluate", key)
    folder.mkdir(parents=True)
    write_jsonl(folder / HELDOUT, rows)
    figures = EvaluateFigures.model_construct(heldout_md5=md5_of(folder / HELDOUT), examples=len(rows))
    return EvaluateRecord(stage="evaluate", key=key, hash="h", figures=figures)


def test_the_frozen_set_is_pinned_once_and_checked_on_the_way_back(store: TrackingConfig) -> None:
    from llmops.config.schema import PipelineConfig

    config = PipelineConfig.model_validate({"register": {"model_name": "frozen"}, "tracking": store.model_dump()})
    registered(store, "frozen", 1)
    mlflow_client = tracking.client(config.tracking)
    first = evaluated_on([{"instruction": "a", "output": "b"}], "e1")
    found = gate.frozen_set(config, mlflow_client, first)
    assert not found.pinned and found.path == first.dir / HELDOUT
    run = new_run(config.tracking)
    gate.pin(mlflow_client, "frozen", found, run.run_id)
    tags = mlflow_client.get_registered_model("frozen").tags
    assert tags["frozen_eval.md5"] == first.figures.heldout_md5 and tags["frozen_eval.examples"] == "1"

    # a later run held out other rows: it is compared on the pinned ones, fetched from the tracking store
    later = gate.frozen_set(config, mlflow_client, evaluated_on([{"instruction": "c", "output": "d"}], "e2"))
    assert later.pinned and later.md5 == first.figures.heldout_md5
    assert [json.loads(line) for line in later.path.read_text().splitlines()] == [{"instruction": "a", "output": "b"}]
    later.path.write_text('{"instruction": "x", "output": "y"}\n')
    with pytest.raises(RegistryError, match="does not match its pinned md5"):
        gate.frozen_set(config, mlflow_client, evaluated_on([], "e3"))


def test_registered_weights_load_back_identically(store: TrackingConfig) -> None:
    trained = saved_model(6)
    run = new_run(store)
    create_version("roundtrip", log_model(run, trained.dir / "model", selected(DataConfig(kind="instruction")), ""), {})
    loaded = mlflow.transformers.load_model("models:/roundtrip/1", return_type="components")
    original = AutoModelForCausalLM.from_pretrained(trained.dir / "model")
    ids = loaded["tokenizer"]("row 7 says hello", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded["model"](ids).logits, original(ids).logits)


def test_each_move_is_a_tag_of_its_own_read_after_the_moves_of_the_old_single_tag(store: TrackingConfig) -> None:
    """A registry written by an earlier release: its `alias_history` list is read first and never rewritten; new
    moves follow, each in its own tag, and rollback replays both."""
    registered(store, "upgraded", 3)
    mlflow_client = tracking.client(store)
    old = [{"at": "2024-01-01T00:00:00+00:00", "alias": "champion", "version": "1", "previous": None,
            "action": "gate", "reason": "first", "by": "pipeline run r1"},
           {"at": "2024-01-02T00:00:00+00:00", "alias": "champion", "version": "2", "previous": "1",
            "action": "promote", "reason": "better", "by": "ann: llmops models promote"}]
    mlflow_client.set_registered_model_tag("upgraded", aliases.HISTORY_TAG, json.dumps(old))
    mlflow_client.set_registered_model_alias("upgraded", "champion", "2")

    aliases.promote(store, "upgraded", "3", "newer")
    tags = mlflow_client.get_registered_model("upgraded").tags
    assert json.loads(tags[aliases.HISTORY_TAG]) == old
    moved = [key for key in tags if key.startswith(aliases.MOVE_PREFIX)]
    assert len(moved) == 1 and re.fullmatch(r"alias_move\.000000003\.[0-9a-f]{8}", moved[0]), moved
    assert [(m["version"], m["previous"]) for m in aliases.history(mlflow_client, "upgraded")] == [
        ("1", None), ("2", "1"), ("3", "2")]
    assert aliases.rollback(store, "upgraded")["version"] == "2"
    assert aliases.rollback(store, "upgraded")["version"] == "1"
    assert [m["action"] for m in aliases.history(mlflow_client, "upgraded")] == [
        "gate", "promote", "promote", "rollback", "rollback"]


def test_a_long_reason_is_clipped_to_what_a_registry_tag_holds(store: TrackingConfig) -> None:
    registered(store, "wordy", 2)
    mlflow_client = tracking.client(store)
    # plain words; wide characters and control characters, whose JSON is longer than the text
    reasons = ("why " * 3000, "é\x01😀" * 3000)
    moves = [aliases.move_alias(mlflow_client, "wordy", "challenger", "2", "gate", reason, "pipeline run r" * 50)
             for reason in reasons]
    stored = [value for key, value in mlflow_client.get_registered_model("wordy").tags.items()
              if key.startswith(aliases.MOVE_PREFIX)]
    assert len(stored) == 2 and all(len(value.encode()) <= aliases.MOVE_BYTES < 5000 for value in stored)
    for move, reason in zip(moves, reasons, strict=True):
        assert move["reason"].endswith("…") and reason.startswith(move["reason"][:-1])
        assert len(move["by"]) == aliases.BY_LIMIT
    assert len(moves[0]["reason"]) == aliases.REASON_LIMIT
    assert aliases.history(mlflow_client, "wordy") == moves


def test_the_oldest_moves_give_way_past_the_limit(store: TrackingConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aliases, "HISTORY_LIMIT", 3)
    versions = registered(store, "busy", 5)
    mlflow_client = tracking.client(store)
    for version in versions:
        aliases.move_alias(mlflow_client, "busy", "challenger", version, "gate", f"run {version}", "pipeline")
    keys = sorted(key for key in mlflow_client.get_registered_model("busy").tags if key.startswith("alias_move."))
    assert [key.split(".")[1] for key in keys] == ["000000003", "000000004", "000000005"]
    assert [m["version"] for m in aliases.history(mlflow_client, "busy")] == ["3", "4", "5"]


def test_moves_made_at_once_are_all_recorded(store: TrackingConfig) -> None:
    """Writers that read the history at the same time write tags of their own: none overwrites another."""
    from concurrent.futures import ThreadPoolExecutor

    versions = registered(store, "crowded", 6)

    def move(version: str) -> dict:
        return aliases.move_alias(tracking.client(store), "crowded", "challenger", version, "gate", "at once", "run")

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(move, versions))
    recorded = aliases.history(tracking.client(store), "crowded")
    assert sorted(m["version"] for m in recorded) == versions


def test_a_registry_that_fails_ends_each_command_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             store: TrackingConfig) -> None:
    """A server that does not answer is a failing registry, not one without the model: each command says what it
    was doing and what failed, in one line."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    config = tmp_path / "down.yaml"
    config.write_text(f"tracking:\n  tracking_uri: http://127.0.0.1:{port}\n")
    for args, doing in ((["models", "show", "gone@champion"], "reading gone@champion"),
                        (["models", "promote", "gone", "2"], "promoting gone version 2"),
                        (["models", "rollback", "gone"], "rolling back the champion of gone"),
                        (["models", "list"], "listing the registered versions")):
        result = runner.invoke(app, [*args, "-c", str(config)])
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert re.fullmatch(rf"error: {doing} failed: .*127\.0\.0\.1.*{port}.*", result.output.strip()), result.output
    registered(store, "strict", 1)
    with pytest.raises(RegistryError, match=r"^moving champion of strict to version 9 failed: \S"):
        aliases.move_alias(tracking.client(store), "strict", "champion", "9", "gate", "no such version", "run")
