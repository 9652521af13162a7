"""The registry on PostgreSQL, which holds no more than MLflow's schema says (SQLite holds anything): many alias
moves, and every param, tag and description a pipeline run writes, measured against MLflow's own column limits.

One MLflow server on a pgserver database and one tiny pipeline run (its chat template longer than a param holds)
serve the module's tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.cli.environment import configure_environment
from llmops.config.schema import PipelineConfig
from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.registry import aliases
from llmops.text.templates import SCRATCH_TEMPLATE
from llmops.tracking import log as tracking
from tests.conftest import REPO
from tests.helpers import run_all_stages, workspace_at
from tests.integration.stack import Processes, postgres, postgres_backend, start_mlflow, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
runner = CliRunner()
MODEL, MOVED = "pg-model", "pg-moves"
# a chat template that renders as the scratch one, padded past the 6,000 characters a param holds
LONG_TEMPLATE = SCRATCH_TEMPLATE + "{# " + "a comment that only makes the template long. " * 160 + "#}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An MLflow server whose backend store is PostgreSQL; its URL."""
    root = tmp_path_factory.mktemp("pg-registry")
    processes = Processes(root)
    env = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
    with postgres(root) as database:
        url, process = start_mlflow(processes, env, postgres_backend(database), str(root / "artifacts"))
        try:
            wait_for(f"{url}/health", process)
            yield url
        finally:
            processes.stop_all()


@pytest.fixture(scope="module")
def pipeline(server: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[PipelineConfig, dict[str, Any], Path]:
    """A tiny SFT run of every stage against the server: its config, its records and its workspace."""
    root = tmp_path_factory.mktemp("pg-pipeline")
    write_jsonl(root / "instructions.jsonl", instruction_records(rows=800, seed=3))
    settings = yaml.safe_load((REPO / "configs" / "tiny_sft_cpu.yaml").read_text())
    settings["tokenize"]["chat_template"] = LONG_TEMPLATE
    (root / "config.yaml").write_text(yaml.safe_dump(settings))
    # 40 steps lower the loss on the answers long before they make exact matches: the gate judges by that loss
    config = load_config(root / "config.yaml", [
        f"data.path={root / 'instructions.jsonl'}", f"tracking.tracking_uri={server}", f"register.model_name={MODEL}",
        "train.max_steps=40", "evaluate.max_examples=20", "evaluate.max_new_tokens=12",
        "evaluate.primary_metric=completion_loss"])
    with workspace_at(root / "home"):
        configure_environment()
        records = run_all_stages(config, "pg-limits")
    return config, records, root / "home"


def copy_version(client: MlflowClient, name: str, of: Any) -> str:
    """Another version of a registered version's weights (no tags: the gate finds no version of them by hash)."""
    # the source is the logged model (models:/m-...), which the registry wants named by its id as well
    logged = of.model_id or of.source.removeprefix("models:/")
    return str(client.create_model_version(name, of.source, run_id=of.run_id, model_id=logged).version)


def test_fifty_alias_moves_then_register_promote_and_rollback_on_postgresql(
        server: str, pipeline: tuple[PipelineConfig, dict[str, Any], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    config, _, workspace = pipeline
    client = MlflowClient(tracking_uri=server, registry_uri=server)
    client.create_registered_model(MOVED)
    weights = client.get_model_version(MODEL, "1")
    assert [copy_version(client, MOVED, weights) for _ in range(2)] == ["1", "2"]
    # the database holds what the schema says: one history tag would have failed after about 30 moves
    with pytest.raises(MlflowException, match="value too long"):
        client.set_registered_model_tag(MOVED, "probe", "x" * 5001)

    settings = config.tracking
    mlflow_client = tracking.client(settings)
    aliases.move_alias(mlflow_client, MOVED, "champion", "1", "gate", "no champion yet", "pipeline run r0")
    cycle = (lambda i: aliases.promote(settings, MOVED, "2", f"move {i}: checked by hand"),
             lambda i: aliases.rollback(settings, MOVED, f"move {i}: bad answers"),
             # the gate's reason can be long: the move keeps its first 1,000 characters
             lambda i: aliases.move_alias(mlflow_client, MOVED, "challenger", "2", "gate",
                                          f"move {i}: does not beat version 1 " + "on the frozen set " * 400,
                                          f"pipeline run r{i}"))
    for i in range(1, 50):
        cycle[(i - 1) % 3](i)
    moves = aliases.history(mlflow_client, MOVED)
    assert len(moves) == 50
    assert [m["action"] for m in moves[:7]] == ["gate", "promote", "rollback", "gate", "promote", "rollback", "gate"]
    assert [m["version"] for m in moves if m["action"] == "rollback"] == ["1"] * 16
    assert all(len(m["reason"]) <= aliases.REASON_LIMIT for m in moves)
    assert moves[3]["reason"].startswith("move 3: does not beat version 1") and moves[3]["reason"].endswith("…")
    assert client.get_model_version_by_alias(MOVED, "champion").version == "2"  # move 49 promoted it

    # the pipeline registers these weights again under this name: the gate re-scores the champion and moves an alias
    monkeypatch.setenv("LLMOPS_HOME", str(workspace))  # the pipeline's workspace: every stage before register reused
    renamed = config.model_copy(update={"registry": config.registry.model_copy(update={"model_name": MOVED})})
    registered = run_all_stages(renamed, "pg-moves")["register"]
    assert registered.version == "3" and registered.alias in ("champion", "challenger"), registered
    champion = str(client.get_model_version_by_alias(MOVED, "champion").version)
    assert aliases.promote(settings, MOVED, "1", "after the register")["previous"] == champion
    assert aliases.rollback(settings, MOVED, "not that one")["version"] == champion
    moves = aliases.history(mlflow_client, MOVED)
    assert len(moves) == 53 and [m["action"] for m in moves[-3:]] == ["gate", "promote", "rollback"]
    assert sum(key.startswith(aliases.MOVE_PREFIX) for key in client.get_registered_model(MOVED).tags) == 53

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    shown = runner.invoke(app, ["models", "show", f"{MOVED}/1", "--json"])
    assert shown.exit_code == 0, shown.output
    listed = json.loads(shown.stdout)["alias_history"]
    # version 1's moves: the first, the promotions from it and the rollbacks to it, and the last two
    assert listed == [m for m in moves if "1" in (m["version"], m["previous"])] and len(listed) == 36
    shown = runner.invoke(app, ["models", "show", f"{MOVED}/1"])
    assert shown.exit_code == 0 and "alias moves" in shown.output and "Traceback" not in shown.output, shown.output


def column_limits() -> dict[str, int | None]:
    """The lengths of the columns MLflow stores params, tags and descriptions in, read from its SQLAlchemy models
    (None: a text column, unbounded)."""
    from mlflow.store.model_registry.dbmodels import models as registry
    from mlflow.store.tracking.dbmodels import models as runs

    columns = {"param key": (runs.SqlParam, "key"), "param value": (runs.SqlParam, "value"),
               "run tag key": (runs.SqlTag, "key"), "run tag value": (runs.SqlTag, "value"),
               "metric key": (runs.SqlMetric, "key"),
               "registered model tag key": (registry.SqlRegisteredModelTag, "key"),
               "registered model tag value": (registry.SqlRegisteredModelTag, "value"),
               "model version tag key": (registry.SqlModelVersionTag, "key"),
               "model version tag value": (registry.SqlModelVersionTag, "value"),
               "registered model description": (registry.SqlRegisteredModel, "description"),
               "model version description": (registry.SqlModelVersion, "description")}
    return {name: getattr(table.__table__.c[column].type, "length", None) for name, (table, column) in columns.items()}


def written(client: MlflowClient, experiment: str) -> list[tuple[str, str, str]]:
    """(column, name, text) for every param, run tag, metric name, registered model tag, version tag and
    description in the store."""
    found: list[tuple[str, str, str]] = []
    for run in client.search_runs([experiment]):
        for kind, values in (("param", run.data.params), ("run tag", run.data.tags)):
            found += [(f"{kind} {part}", key, text) for key, value in values.items()
                      for part, text in (("key", key), ("value", value))]
        found += [("metric key", key, key) for key in run.data.metrics]
    for model in client.search_registered_models():
        found += [(f"registered model tag {part}", key, text) for key, value in model.tags.items()
                  for part, text in (("key", key), ("value", value))]
        found.append(("registered model description", model.name, model.description or ""))
        for listed in client.search_model_versions(f"name = '{model.name}'"):
            version = client.get_model_version(model.name, listed.version)
            found += [(f"model version tag {part}", key, text) for key, value in version.tags.items()
                      for part, text in (("key", key), ("value", value))]
            found.append(("model version description", f"{model.name}/{version.version}", version.description or ""))
    return found


def test_every_param_tag_and_description_a_run_writes_fits_the_schema(
        server: str, pipeline: tuple[PipelineConfig, dict[str, Any], Path]) -> None:
    config, records, _ = pipeline
    limits = column_limits()
    # what MLflow's schema says today: registered model tags and descriptions are the narrow ones
    assert (limits["registered model tag value"], limits["model version description"], limits["param value"],
            limits["run tag value"], limits["param key"]) == (5000, 5000, 8000, 8000, 250)
    assert records["register"].alias == "champion"
    client = MlflowClient(tracking_uri=server, registry_uri=server)
    # a version promoted by hand with a reason far longer than a tag holds
    second = copy_version(client, MODEL, client.get_model_version(MODEL, "1"))
    aliases.promote(config.tracking, MODEL, second, "checked by hand: " + "sehr gründlich geprüft " * 1000)

    experiment = client.get_experiment_by_name(config.tracking.experiment).experiment_id
    values = written(client, experiment)
    kinds = {column for column, _, _ in values}
    assert kinds == set(limits), kinds ^ set(limits)
    over = [(column, name[:60], len(text), limits[column]) for column, name, text in values
            if limits[column] is not None and len(text) > limits[column]]
    assert not over, over
    # the long config value is clipped where it is written (the whole config is the run's config/resolved.yaml)
    run = client.search_runs([experiment], "attributes.run_name = 'pg-limits'")[0]
    template = run.data.params["tokenize.chat_template"]
    assert len(template) == tracking.PARAM_LIMIT and template.endswith("…") and LONG_TEMPLATE.startswith(template[:-1])
    promoted = aliases.history(client, MODEL)[-1]
    assert promoted["version"] == second and promoted["reason"].endswith("…")
    print("LIMITS", json.dumps(limits), "WRITTEN", len(values), "LONGEST",
          json.dumps({column: max(len(text) for c, _, text in values if c == column) for column in kinds}))
