"""The stage table is the single source: keys cover exactly what each stage reads, and nothing else drifts from it."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import torch
from pydantic import BaseModel, ValidationError
from transformers import AutoModelForCausalLM, LlamaConfig

from llmops.config.schema import PLACEMENT, PipelineConfig, is_placement
from llmops.data.synthetic import instruction_records
from llmops.data.versions import DVC_PIPELINE_CONFIG
from llmops.io.errors import ConfigError
from llmops.io.files import write_jsonl
from llmops.objectives import load_config, registry
from llmops.objectives.config import complete
from llmops.pipeline import stages
from llmops.pipeline.dvcfile import render_dvc_yaml
from llmops.pipeline.keys import code_files, project_root_of_code
from llmops.pipeline.runner import plan, resolve
from llmops.pipeline.stages import NAMES, STAGES, WHOLE_CONFIG, downstream
from llmops.text.tokenizers import prepare_tokenizer, train_bpe
from llmops.training.launch import LaunchError
from tests.sources import python_files

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two data files and a tiny pretrained model folder with its tokenizer: what a config's paths can name."""
    root = tmp_path_factory.mktemp("inputs")
    write_jsonl(root / "a.jsonl", instruction_records(rows=40, seed=1))
    write_jsonl(root / "b.jsonl", instruction_records(rows=40, seed=2))
    (root / "dataset").mkdir()
    write_jsonl(root / "dataset" / "train.jsonl", instruction_records(rows=20, seed=3))
    tokenizer = train_bpe((" ".join(row.values()) for row in instruction_records(rows=40, seed=1)), 300)
    prepare_tokenizer(tokenizer, None, trained_here=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=32))
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    (root / "template.jinja").write_text("{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")
    return {"a": root / "a.jsonl", "b": root / "b.jsonl", "dataset": root / "dataset", "base": root / "base",
            "template": root / "template.jinja"}


def base_configs(inputs: dict[str, Path]) -> list[dict[str, Any]]:
    """From scratch, fine-tuning a pretrained base with evaluation during training, plain text, a training of two
    machines, and DPO and GRPO on the base (fields that need them: the objectives' own sections)."""
    scratch = complete({"data": {"path": str(inputs["a"])}}).as_dict()
    text = complete({"data": {"path": str(inputs["a"]), "kind": "text"}}).as_dict()
    tuned = complete({"data": {"path": str(inputs["a"])}, "model": {"name_or_path": str(inputs["base"])},
                      "train": {"eval_steps": 5}}).as_dict()
    machines = complete({"data": {"path": str(inputs["a"])}, "train": {"nodes": 2, "distributed": "ddp"}}).as_dict()
    dpo, grpo = (complete({"data": {"path": str(inputs["a"]), "kind": kind},
                           "model": {"name_or_path": str(inputs["base"])}}).as_dict()
                 for kind in ("preference", "prompts"))
    return [scratch, tuned, text, machines, dpo, grpo]


def leaves(model: type[BaseModel], value: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, annotation, current value) of every leaf field, walking the config model itself."""
    found = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        path, current = f"{prefix}{key}", value[key]
        nested = submodel(field.annotation)
        if nested is not None and isinstance(current, dict):
            found += leaves(nested, current, f"{path}.")
        elif nested is not None and isinstance(current, list) and current:
            found += leaves(nested, current[0], f"{path}.0.")
        else:
            found.append((path, field.annotation, current))
    return found


def submodel(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def alternatives(path: str, annotation: Any, current: Any, inputs: dict[str, Path]) -> list[Any]:
    """Values to change a leaf to, by its type; some will be refused by the model's own validation. The fields the
    objective checks get values it may accept: another record kind, the same objective named by module:Class, a
    metric it reports."""
    chosen = {"data.kind": [kind for kind in registry.record_kinds() if kind != current],
              # the same objective, named by module:Class: the code is the same, the setting (and so the key) is not
              "data.objective": [entry.target for entry in registry.ENTRIES if entry.name == current],
              "evaluate.primary_metric": ["rouge_l", "perplexity"],
              "register.guards": [{"rouge_l": 0.5}, {"perplexity": 0.5}],
              "cost.device_hour": [{"H100": 2.5, "cpu": 0.05}],
              # unset by default (the engine chooses); a size of its own must be at least 1 KiB
              "engine.shard_bytes": [2**20]}
    if path in chosen:
        return chosen[path]
    options: list[Any] = []
    for kind in (annotation, *get_args(annotation)):
        if get_origin(kind) is Literal:
            options += [choice for choice in get_args(kind) if choice != current]
        elif kind is bool:
            options.append(not current)
        elif kind is int and isinstance(current, int):
            options += [current + 1, current - 1, current * 2]
        elif kind is int:
            options.append(5)
        elif kind is float:
            options += [current * 1.5, current / 2] if current else [0.5]
        elif kind is str:
            named = {"path": inputs["b"], "name": inputs["dataset"], "name_or_path": inputs["base"],
                     "tokenizer": inputs["base"], "chat_template": inputs["template"]}
            options.append(str(named.get(path.rsplit(".", 1)[-1], f"{current or ''}x")))
        elif get_origin(kind) is list and submodel(kind) is not None:
            options.append([{"path": str(inputs["b"])}])
        elif get_origin(kind) is list:
            options += [[*(current or []), "x", "y"], ["x", "y"]]
        elif get_origin(kind) is dict:
            options.append({"text": "body"})
    return [option for option in options if option != current]


def set_leaf(raw: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    import copy

    changed = copy.deepcopy(raw)
    *parents, last = path.split(".")
    node: Any = changed
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[last] = value
    return changed


def readers_of(path: str) -> set[str]:
    if is_placement(path):  # where a stage runs and where artifacts are kept shape nothing
        return set()
    direct = {spec.name for spec in STAGES
              if any(read == WHOLE_CONFIG or path == read or path.startswith(read + ".") for read in spec.reads)
              and not any(path == skip or path.startswith(skip + ".") for skip in spec.unkeyed)}
    return direct | {later for name in direct for later in downstream(name)}


def changed_config(raw: dict[str, Any], path: str, value: Any) -> PipelineConfig | None:
    """The config with the leaf changed (the objective completing and checking it, as loading does), or with a
    sibling cleared too where the model asks for one of the two."""
    attempts = [set_leaf(raw, path, value)]
    parent = path.rpartition(".")[0]
    siblings = [f"{parent}.{k}" for k, v in (get_node(raw, parent) or {}).items() if v is not None]
    attempts += [set_leaf(attempts[0], sibling, None) for sibling in siblings if sibling != path]
    for attempt in attempts:
        try:
            return complete(attempt)
        except (ValidationError, ConfigError):
            continue
    return None


def get_node(raw: dict[str, Any], path: str) -> Any:
    node: Any = raw
    for part in filter(None, path.split(".")):
        node = node[int(part)] if part.isdigit() else node.get(part)
    return node if isinstance(node, dict) else None


def test_a_changed_field_changes_the_keys_of_its_readers_and_their_downstream_only(inputs: dict[str, Path]) -> None:
    exercised: set[str] = set()
    all_leaves: set[str] = set()
    for raw in base_configs(inputs):
        base_keys = plan(PipelineConfig.model_validate(raw), inputs["a"].parent)
        assert len(set(base_keys.values())) == len(NAMES)
        for path, annotation, current in leaves(PipelineConfig, raw):
            all_leaves.add(path)
            for value in alternatives(path, annotation, current, inputs):
                config = changed_config(raw, path, value)
                if config is None:
                    continue
                try:
                    keys = plan(config, inputs["a"].parent)
                except LaunchError:  # a training this machine cannot run (FSDP without a GPU): another value
                    continue
                moved = {name for name in NAMES if keys[name] != base_keys[name]}
                assert moved == readers_of(path), f"{path} -> {value!r}"
                exercised.add(path)
                break
    assert exercised == all_leaves, f"no valid change found for {sorted(all_leaves - exercised)}"
    assert len(all_leaves) > 60


def test_placement_fields_change_no_key_and_no_config_hash(inputs: dict[str, Path]) -> None:
    """A model trained on a GPU worker, with artifacts shared through a remote, is the model trained in-process."""
    config = load_config(REPO / "configs" / "tiny_sft_cpu.yaml", [f"data.path={inputs['a']}"])
    placed = load_config(REPO / "configs" / "tiny_sft_cpu.yaml", [f"data.path={inputs['a']}", "launch.work_pool=gpu",
                                                                  "launch.work_pool_wait=30",
                                                                  "workspace.remote=s3://artifacts/llmops",
                                                                  "cost.device_hour={H100: 2.5, cpu: 0.05}",
                                                                  "monitor.drift_p_value=0.05"])
    assert plan(placed, inputs["a"].parent) == plan(config, inputs["a"].parent)
    assert placed.digest() == config.digest() and placed.as_dict() != config.as_dict()
    assert PLACEMENT == ("workspace", "launch.work_pool", "launch.work_pool_wait", "cost", "engine", "monitor")
    assert not any(is_placement(read) for spec in STAGES for read in spec.reads)
    assert {spec.pool_field for spec in STAGES if spec.pool_field} == {"launch.work_pool"}
    # a stage sent to a pool says how long a worker has to take it (flows/remote.py waits no longer)
    assert all(is_placement(spec.pool_wait_field) for spec in STAGES if spec.pool_field)


def test_keys_in_a_run_are_the_planned_keys(sft_config: PipelineConfig) -> None:
    from tests.helpers import data_stages

    deduped, tokenized = data_stages(sft_config)
    planned = plan(sft_config, REPO)
    assert (deduped.key, tokenized.key) == (planned["dedup"], planned["tokenize"])


def test_max_length_reaches_the_train_key(sft_config: PipelineConfig) -> None:
    """Regression: a longer max_length whose tokens come out the same still retrains (packing uses it)."""
    longer = sft_config.model_copy(update={"tokenize": sft_config.tokenize.model_copy(update={"max_length": 128})})
    assert plan(longer, REPO)["train"] != plan(sft_config, REPO)["train"]


def test_dvc_yaml_is_what_the_stage_table_gives() -> None:
    rendered = render_dvc_yaml(load_config(REPO / DVC_PIPELINE_CONFIG), DVC_PIPELINE_CONFIG, REPO)
    assert (REPO / "dvc.yaml").read_text() == rendered, "run `llmops dvc-yaml` and commit dvc.yaml"


def test_no_file_dvc_yaml_depends_on_is_empty() -> None:
    """DVC warns "'<file>' is empty." for each empty dependency whenever it hashes them (each run's lock commit): an
    empty package __init__.py holds a docstring instead."""
    import yaml

    deps = {dep for stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].values()
            for dep in stage.get("deps", [])}
    files = [REPO / dep for dep in deps if (REPO / dep).is_file()]
    assert len(files) > 20 and any(path.name == "__init__.py" for path in files)
    assert [str(path.relative_to(REPO)) for path in files if path.stat().st_size == 0] == []


def test_every_import_path_the_stage_table_names_is_there() -> None:
    """The table names its functions, and what the runner calls in the layers above it, by import path: a path that
    moved would fail only when a run reached it."""
    named = [stages.RESOLVE_BASE, stages.OBJECTIVE_CODE, stages.SOURCE_TAGS, stages.SPLIT_DATASETS]
    for spec in STAGES:
        named += [spec.function, spec.returns, *filter(None, (spec.inputs, spec.content, spec.gate, spec.holds,
                                                              spec.follower, spec.cost))]
    assert all(callable(resolve(path)) for path in named)
    assert [spec.name for spec in STAGES if spec.cost] == ["register"]


def test_stage_modules_import_neither_prefect_nor_the_flows_package() -> None:
    for path in python_files("llmops"):
        if "flows" in path.parts or "cli" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] != "prefect" and not name.startswith("llmops.flows"), f"{path} imports {name}"


def closure(*modules: str) -> set[str]:
    return {path.relative_to(project_root_of_code()).as_posix() for path in code_files(*modules)}


def test_the_code_of_a_data_stage_is_its_module_the_layers_below_and_the_record_kind() -> None:
    """Ingest of instruction data runs its readers, io, the objectives' registry and the instruction kind: no
    config, workspace, engine or tracking code, no model, training, evaluation, registry, serving or flow code, and
    no other objective."""
    assert closure("llmops.data.ingest", *registry.code_modules(load_config(
        REPO / "configs" / "default.yaml").data, "kind")) == {
        "llmops/data/ingest.py", "llmops/data/ingest_cuts.py", "llmops/data/json_array.py",
        "llmops/data/parquet_rows.py", "llmops/data/readers.py", "llmops/data/rows.py", "llmops/io/compressed.py",
        "llmops/io/errors.py", "llmops/io/figures.py", "llmops/io/files.py", "llmops/io/rejects.py",
        "llmops/io/shards.py", "llmops/objectives/__init__.py", "llmops/objectives/config.py",
        "llmops/objectives/registry.py", "llmops/records/__init__.py", "llmops/records/base.py",
        "llmops/records/conversations.py", "llmops/records/tool_calls.py", "llmops/records/turns.py"}


def test_the_code_of_tokenize_and_train_holds_the_selected_objective_and_no_other() -> None:
    config = load_config(REPO / "configs" / "default.yaml")
    objective = registry.code_modules(config.data, "objective")
    assert objective == ("llmops.objectives.sft",)
    tokenize, train = closure("llmops.data.tokenize", *objective), closure("llmops.training.train", *objective)
    assert closure("llmops.data.tokenize") < tokenize
    assert {"llmops/objectives/sft.py", "llmops/objectives/language.py", "llmops/objectives/base.py",
            "llmops/text/packing.py", "llmops/models/modeling.py"} <= tokenize < train
    for files in (tokenize, train):
        assert not {path for path in files if path.split("/")[1] in ("evaluation", "registry", "serving", "flows")}
        others = {path for path in files if path.startswith(("llmops/objectives/", "llmops/records/"))} - {
            "llmops/objectives/__init__.py", "llmops/objectives/config.py", "llmops/objectives/registry.py",
            "llmops/objectives/base.py", "llmops/records/__init__.py", "llmops/records/base.py",
            "llmops/records/conversations.py", "llmops/records/turns.py",
            "llmops/objectives/language.py", "llmops/objectives/sft.py", "llmops/objectives/metrics.py",
            "llmops/records/tool_calls.py", "llmops/objectives/tool_answers.py",  # the chat kind's tool calls
            "llmops/objectives/sft_trainer.py"}  # SFT's own trainer
        assert not others, f"code of another objective in the key: {others}"
    assert "llmops/objectives/dpo.py" not in train and "llmops/training/trainer.py" in train


def test_a_preference_config_keys_the_dpo_module_and_its_record_kind() -> None:
    config = complete({"data": {"path": "d.jsonl", "kind": "preference"}, "model": {"name_or_path": "m"}})
    assert registry.code_modules(config.data, "kind") == ("llmops.records.preference",)
    assert registry.code_modules(config.data, "objective") == ("llmops.objectives.dpo",)
    assert "llmops/objectives/sft.py" not in closure("llmops.data.ingest", "llmops.records.preference")


@pytest.mark.parametrize(("kind", "labels", "objective"), [
    ("classification", ["a", "b"], "classification"), ("tokens", ["O", "B-X"], "token_classification"),
    ("seq2seq", [], "seq2seq"), ("qa", [], "qa")])
def test_the_data_stages_key_a_record_kind_without_its_objective(kind: str, labels: list[str],
                                                                 objective: str) -> None:
    """A record kind is a module of records/: editing how a model is trained on it leaves ingest's key alone."""
    config = complete({"data": {"path": "d.jsonl", "kind": kind, "labels": labels}, "model": {"name_or_path": "m"}})
    modules = registry.code_modules(config.data, "kind")
    assert [module.split(".")[1] for module in modules] == ["records"]
    assert f"llmops/objectives/{objective}.py" not in closure("llmops.data.ingest", *modules)


def test_a_failed_stage_is_tried_again_only_when_that_can_help() -> None:
    """A config or data mistake fails the same way on every try; a server, a store or a disk can come back; a run
    the user stopped stays stopped."""
    from llmops.data.readers import DataSourceError
    from llmops.data.validate import DataQualityError
    from llmops.data.versions import RemoteSyncError
    from llmops.flows.remote import NoWorkerError, RemoteStageFailed, RemoteStageRefused
    from llmops.io.errors import ConfigError, Interrupted, StorageFullError, worth_retrying
    from llmops.tracking.log import TrackingUnavailableError
    from llmops.training.checkpoints import CheckpointStoreError
    from llmops.training.launch import TrainingFailedError, TrainingInterrupted

    again = [TrackingUnavailableError("down"), RemoteSyncError("down"), CheckpointStoreError("down"),
             StorageFullError("full"), TrainingFailedError("rank 1 was killed"),
             RemoteStageFailed("flow run x ended Crashed"), OSError("a read failed"), RuntimeError("a bug")]
    never = [ConfigError("bad key"), DataSourceError("no file"), DataQualityError("bad rows"),
             LaunchError("train.processes=4 but this machine has 1 GPU(s)"), NoWorkerError("no worker polled gpu"),
             RemoteStageRefused("flow run x failed on its worker: bad key"),
             Interrupted("stopped"), TrainingInterrupted("stopped at step 3")]
    assert [worth_retrying(error) for error in again] == [True] * len(again)
    assert [worth_retrying(error) for error in never] == [False] * len(never)
