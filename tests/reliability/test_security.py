"""Security: only safetensors are loaded, a model's own code never runs unless asked, YAML is loaded safely, no
name from a config or the data can reach outside the workspace, and the local UIs listen on loopback only."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
import typer
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.cli.io import one_line_errors
from llmops.config.schema import DataConfig, ModelConfig, PipelineConfig
from llmops.data.ingest import read_records
from llmops.io.errors import ConfigError, UserError
from llmops.models import modeling
from llmops.models.modeling import UnsafeCheckpointError
from llmops.objectives import load_config, selected
from llmops.objectives.config import complete
from llmops.store import workspace
from llmops.store.workspace import write_record
from tests.helpers import stage
from tests.sources import python_files

pytestmark = pytest.mark.reliability
REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
# plain text, trained as a causal LM: the objective whose models these tests load
TEXT = selected(DataConfig(kind="text"))


def tiny_model(folder: Path, safe: bool) -> LlamaForCausalLM:
    """A tiny model saved as safetensors, or as an old-style pickle checkpoint (transformers 5 writes none)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32))
    if safe:
        model.save_pretrained(folder)
    else:
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return model


def test_a_pickle_only_model_folder_is_refused_everywhere_a_model_is_loaded(tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    tiny_model(pickled, safe=False)
    assert (pickled / "pytorch_model.bin").is_file() and not list(pickled.glob("*.safetensors"))
    with pytest.raises(UnsafeCheckpointError, match=r"pickles only \(pytorch_model.bin\).*only safetensors"):
        TEXT.build_model(ModelConfig(name_or_path=str(pickled)), None, 0, [])
    with pytest.raises(UnsafeCheckpointError, match="pytorch_model.bin"):
        TEXT.load_trained(pickled)
    torch.save({}, tmp_path / "model.pt")
    with pytest.raises(UnsafeCheckpointError, match="model.pt"):
        modeling.require_safetensors(tmp_path / "model.pt")
    # a user error: every command reports it in one line with exit code 2, not a traceback
    assert issubclass(UnsafeCheckpointError, UserError)
    command = typer.Typer()
    command.command()(one_line_errors(lambda: TEXT.load_trained(pickled)))
    result = runner.invoke(command, [])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: model {pickled}: its weights are pickles only (pytorch_model.bin)")


def test_safetensors_are_loaded_even_beside_a_pickle(tmp_path: Path) -> None:
    """With both, the safetensors weights are the ones read; the pickle is never opened."""
    both = tmp_path / "both"
    saved = tiny_model(both, safe=True)
    (both / "pytorch_model.bin").write_bytes(b"not a pickle at all: unpickling it would fail")
    loaded = TEXT.load_trained(both)
    assert torch.equal(loaded.model.embed_tokens.weight, saved.model.embed_tokens.weight)


def remote_code_folder(folder: Path) -> Path:
    """A model folder whose config asks to run its own Python: the code leaves a marker file when imported."""
    folder.mkdir()
    (folder / "custom_model.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('CODE_RAN').write_text('yes')\n"
        "from transformers import LlamaConfig\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom-llama'\n")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "custom-llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
        "auto_map": {"AutoConfig": "custom_model.CustomConfig", "AutoModelForCausalLM": "custom_model.CustomModel"}}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CustomTokenizer", "auto_map": {"AutoTokenizer": ["custom_model.CustomTokenizer", None]}}))
    save_file({"lm_head.weight": torch.zeros(64, 16)}, folder / "model.safetensors")
    return folder


def test_a_models_own_code_never_runs_unless_trust_remote_code_is_set(tmp_path: Path) -> None:
    folder = remote_code_folder(tmp_path / "custom")
    assert PipelineConfig().model.trust_remote_code is False
    with pytest.raises(UnsafeCheckpointError, match="model.trust_remote_code: true only for code"):
        TEXT.build_model(ModelConfig(name_or_path=str(folder)), None, 0, [])
    from llmops.data.tokenize import load_pretrained_tokenizer

    with pytest.raises(UnsafeCheckpointError, match="auto_map"):
        load_pretrained_tokenizer(PipelineConfig(model=ModelConfig(name_or_path=str(folder))))
    assert not (folder / "CODE_RAN").exists()


def test_every_from_pretrained_call_takes_trust_remote_code_from_the_config_or_refuses() -> None:
    """No call in the project turns a model's own code on by itself."""
    for path in python_files("llmops"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_pretrained":
                given_value = next((k.value for k in node.keywords if k.arg == "trust_remote_code"), None)
                if given_value is not None:
                    text = ast.unparse(given_value)
                    assert re.fullmatch(r"False|(config\.model|model_config)\.trust_remote_code", text), path.name


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    config = tmp_path / "evil.yaml"
    config.write_text(f"train: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(config)
    result = runner.invoke(app, ["config", str(REPO / "configs" / "default.yaml"),
                                 f"train.epochs=!!python/object/apply:os.system ['touch {marker}']"])
    assert result.exit_code == 2 and not marker.exists()
    for path in python_files("llmops", "bench"):
        source = path.read_text()
        assert not re.search(r"yaml\.(load|unsafe_load|full_load|load_all)\(|Loader=", source), path.name


@given(name=st.one_of(st.text(max_size=20), st.sampled_from(["..", "../x", "a/../../b", "/etc", "~root", ".hidden",
                                                              "a\\b", "a/b", "", "ok-name_1.2"])))
def test_no_name_reaches_outside_the_workspace(name: str) -> None:
    """Stage names, keys and record names are one path component inside the workspace, or refused."""
    home = workspace.home()
    for make in (lambda: workspace.artifact_dir(name, "key"), lambda: workspace.artifact_dir("ingest", name),
                 lambda: write_record(name, "{}")):
        try:
            made = make()
        except ValueError:
            continue
        assert made.resolve().is_relative_to(home) and ".." not in made.parts and "/" not in name


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", "/abs", "x" * 200, "name with space"])
def test_registered_model_names_are_plain_names(name: str) -> None:
    with pytest.raises(ConfigError, match="register.model_name"):
        load_config(REPO / "configs" / "default.yaml", [f"register.model_name={name}"])
    result = runner.invoke(app, ["run", str(REPO / "configs" / "default.yaml"), f"register.model_name={name}"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1


def test_column_names_are_data_never_paths(tmp_path: Path) -> None:
    """A column named like a path is read as a column; ingest writes only inside its own artifact folder."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"../../etc/passwd": "text from an odd column", "/abs": "x"}) + "\n")
    # the record kind's fields are the only names a column maps to (the objective checks them, in one line)
    with pytest.raises(ConfigError, match=r"data.sources.0.columns: '../../escape' is not a field of kind instruction"):
        complete({"data": {"sources": [{"path": str(data), "columns": {"../../escape": "x"}}]}})
    before = {p for p in tmp_path.rglob("*")}
    config = PipelineConfig(data=DataConfig(kind="text", sources=[{"path": str(data),
                                                                   "columns": {"text": "../../etc/passwd"}}]))
    record = stage("ingest", config)
    assert [row["text"] for row in read_records(record.dir)] == ["text from an odd column"]
    created = {p for p in tmp_path.rglob("*")} - before
    assert all(p.is_relative_to(workspace.home()) for p in created)
    assert not (tmp_path.parent.parent / "etc").exists()


def test_local_uis_listen_on_loopback_only() -> None:
    recipes = makefile_recipes(REPO / "Makefile")
    for target, program in (("mlflow-ui", "mlflow ui"), ("prefect-ui", "prefect server start")):
        command = " ".join(recipes[target])
        assert program in command and "--host 127.0.0.1" in command, command
        assert "0.0.0.0" not in command
    cli = "".join(path.read_text() for path in python_files("llmops/cli"))
    assert "mlflow ui --host 127.0.0.1" in cli and "prefect server start --host 127.0.0.1" in cli


def makefile_recipes(path: Path) -> dict[str, list[str]]:
    """Each target's recipe lines."""
    recipes: dict[str, list[str]] = {}
    target = None
    for line in path.read_text().splitlines():
        if line.startswith("\t") and target:
            recipes[target].append(line.strip())
        elif re.match(r"^[\w-]+:", line):
            target = line.split(":")[0]
            recipes[target] = []
    return recipes
