from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.config.files import parse_config, read_raw, read_yaml
from llmops.config.schema import PipelineConfig
from llmops.io.errors import ConfigError
from llmops.objectives import handing, load_config, registry
from llmops.objectives.config import complete
from tests.helpers import count_parses

REPO = Path(__file__).resolve().parents[2]


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(leaves(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            # a list of sections (sources, rewards): each item's settings, by position
            flat.update(leaves({str(index): item for index, item in enumerate(value)}, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_file_means_what_it_says(path: Path, tmp_path: Path) -> None:
    config = load_config(path)
    written = yaml.safe_load(path.read_text())
    resolved = leaves(config.as_dict())
    # every value the file sets is the value the model holds (a `path` shorthand becomes the one source)
    for name, value in leaves(written).items():
        name = {"data.path": "data.sources.0.path"}.get(name, name)
        held = resolved[name]
        assert held == value, f"{path.name}: {name} is {held!r} in the model, {value!r} in the file"
    # the resolved config, written out and read back, is the same config
    resolved_file = tmp_path / "resolved.yaml"
    resolved_file.write_text(yaml.safe_dump(config.as_dict()))
    assert load_config(resolved_file) == config


def test_overrides_set_nested_keys_with_yaml_types() -> None:
    config = load_config(REPO / "configs/default.yaml", ["train.epochs=1.5", "tokenize.max_length=32",
                                                         "validate.max_bad_fraction=0.5", "model.name_or_path=x/y"])
    assert config.train.epochs == 1.5
    assert config.tokenize.max_length == 32
    assert config.validation.max_bad_fraction == 0.5
    assert config.model.name_or_path == "x/y"


def test_unknown_key_names_the_key_the_file_and_the_choices(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  learning_rte: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and "train.learning_rte: unknown key" in message
    assert "learning_rate" in message and "\n" not in message


def test_unknown_section_and_bad_override_are_one_line_each() -> None:
    with pytest.raises(ConfigError, match=r"trian: unknown key; expected one of: data, validate"):
        load_config(REPO / "configs/default.yaml", ["trian.epochs=1"])
    with pytest.raises(ConfigError, match=r"override train.epochs=abc\): train.epochs: input should be a valid "):
        load_config(REPO / "configs/default.yaml", ["train.epochs=abc"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(REPO / "configs/default.yaml", ["train.epochs"])


def test_wrong_type_in_file_says_what_was_expected(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  kind: images\n")
    # the record kinds are the objective registry's: an unknown one is one line naming the file and the choices
    kinds = registry.record_kinds()
    assert {"text", "instruction", "chat", "classification", "tokens", "seq2seq", "preference"} <= set(kinds)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: data.kind: unknown record kind 'images'; expected one of: {', '.join(kinds)}"
    objectives = registry.names()
    assert {"causal_lm", "sft", "classification", "masked_lm", "token_classification", "seq2seq", "dpo"} <= set(
        objectives)
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/default.yaml", ["data.objective=images"])
    assert "(override data.objective=images): data.objective: unknown objective 'images'; expected one of: " \
           f"{', '.join(objectives)}, or module:Class of your own" in str(err.value)
    assert "\n" not in str(err.value)
    path.write_text("train:\n  epochs: many\n")
    with pytest.raises(ConfigError, match=r"train.epochs: input should be a valid number.* \(got 'many'\)"):
        load_config(path)


def test_missing_file_and_broken_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "configs.yaml").mkdir()
    with pytest.raises(ConfigError, match="configs.yaml: a folder, not a config file$"):
        load_config(tmp_path / "configs.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  epochs: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)


def test_a_key_given_twice_in_one_mapping_is_refused_naming_its_line(tmp_path: Path) -> None:
    """YAML parsers keep the last of two equal keys without a word: `kind: text` then `kind: chat` ran as chat. The
    same key in two different mappings, and an anchor merged in, are no repeat."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("data:\n  kind: text\n  path: a.jsonl\n  kind: chat\ntrain:\n  epochs: 1\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: line 4 not valid YAML \(the key 'kind' appears twice in one "
                                          r"mapping\)$"):
        load_config(twice)
    apart = tmp_path / "apart.yaml"
    apart.write_text("defaults: &common {seed: 3}\ntrain:\n  <<: *common\n  epochs: 1\ndedup:\n  seed: 4\n")
    assert read_yaml(apart) == {"defaults": {"seed": 3}, "train": {"seed": 3, "epochs": 1}, "dedup": {"seed": 4}}


def test_digest_changes_with_any_value() -> None:
    base = load_config(REPO / "configs/default.yaml")
    assert base.digest() != load_config(REPO / "configs/default.yaml", ["train.seed=1"]).digest()


def test_the_wait_for_a_worker_is_placement_in_minutes() -> None:
    """How long a worker of launch.work_pool has to take the stage: minutes by default, never zero, and no part of
    what the run makes."""
    base = load_config(REPO / "configs/default.yaml")
    assert base.launch.work_pool_wait == 600
    waited = load_config(REPO / "configs/default.yaml", ["launch.work_pool=gpu", "launch.work_pool_wait=20"])
    assert waited.launch.work_pool_wait == 20 and waited.digest() == base.digest()
    with pytest.raises(ConfigError, match=r"^configs/default.yaml \(override launch.work_pool_wait=0\): "
                                          r"launch.work_pool_wait: input should be greater than or equal to 1"):
        load_config("configs/default.yaml", ["launch.work_pool_wait=0"])


@pytest.mark.parametrize(("raw", "expected"), [
    ({"data": {"kind": "classification"}}, "data.labels: kind classification needs data.labels"),
    ({"data": {"kind": "tokens", "labels": ["O"]}, "model": {"architecture": "bert"}},
     "data.labels: kind tokens needs data.labels, the list of at least two tags"),
    ({"data": {"kind": "instruction", "objective": "masked_lm"}},
     "data.objective=masked_lm trains on kind text: set data.kind to it (got instruction)"),
    ({"data": {"kind": "text", "objective": "masked_lm"}},
     "model.architecture: masked_lm builds bert or roberta from scratch (got llama)"),
    ({"data": {"kind": "preference"}}, "model.name_or_path: dpo tunes a trained model: set model.name_or_path"),
    ({"evaluate": {"primary_metric": "accuracy"}},
     "evaluate.primary_metric: accuracy is not reported by sft; expected one of: completion_loss"),
    ({"evaluate": {"primary_metric": "generated_tokens"}},
     "evaluate.primary_metric: generated_tokens has no better direction; expected one of: completion_loss"),
    ({"register": {"guards": {"rouge_l": 0.1, "loss": 0.2}}},
     "register.guards.loss: loss is not reported by sft; expected one of: completion_loss"),
], ids=["labels", "tags", "masked_lm-kind", "masked_lm-architecture", "dpo-base", "primary", "undirected", "guard"])
def test_the_objective_checks_what_only_it_can_judge(raw: dict, expected: str, tmp_path: Path) -> None:
    """The schema alone accepts these; completing the config for its objective refuses each in one line that names
    the file and the field."""
    PipelineConfig.model_validate(raw)
    with pytest.raises(ConfigError) as err:
        complete(raw)
    assert str(err.value).startswith(f"config: {expected}") and "\n" not in str(err.value)
    path = tmp_path / "objective.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: {expected}")


def test_the_objective_fills_in_its_name() -> None:
    assert complete({"data": {"kind": "text"}}).data.objective == "causal_lm"
    assert complete({"data": {"kind": "chat"}}).data.objective == "sft"
    assert complete({"data": {"kind": "classification", "labels": ["a", "b"]}}).data.objective == "classification"
    assert PipelineConfig.model_validate({"data": {"kind": "text"}}).data.objective is None


def test_a_flag_where_a_number_goes_a_repeated_label_and_an_empty_path_are_refused(tmp_path: Path) -> None:
    """YAML reads `yes` as true, which pydantic took as 1: `max_bad_fraction: yes` let every row fail. A label given
    twice took two class ids; `path: ""` read the working folder."""
    path = tmp_path / "c.yaml"
    cases = {"validate:\n  max_bad_fraction: yes\n": "validate.max_bad_fraction: a number is needed here, not true",
             "data:\n  max_record_bytes: true\n": "data.max_record_bytes: a number is needed here, not true",
             "engine:\n  workers: on\n": "engine.workers: a number is needed here, not true",
             "train:\n  epochs: false\n": "train.epochs: a number is needed here, not false",
             "data:\n  kind: classification\n  labels: [pos, neg, pos]\n":
                 "data.labels: each label once: 'pos' appears more than once",
             "data:\n  kind: classification\n  labels: [pos, '']\n": "data.labels: a label is empty",
             "data:\n  path: ''\n": "data.sources.0.path: string should have at least 1 character",
             # a weight of 1e300 overflowed and one of 1e8 filled memory with copies; 200,000 permutations a row
             # took gigabytes and aborted without a line
             "data:\n  sources: [{path: d.jsonl, weight: 1.0e+8}]\n":
                 "data.sources.0.weight: input should be less than or equal to 1000",
             "dedup:\n  num_perm: 200000\n": "dedup.num_perm: input should be less than or equal to 1024",
             # a held-out source is read once: its weight changed nothing, without a word
             "data:\n  path: d.jsonl\n  eval_sources: [{path: e.jsonl}, {path: f.jsonl, weight: 2}]\n":
                 "data.eval_sources: source 1 has weight 2: a weight applies to training sources"}
    for text, expected in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert str(err.value).startswith(f"{path}: {expected}"), (text, str(err.value))
        assert "\n" not in str(err.value)
    # a field that takes a flag or a number still takes both
    path.write_text("validate:\n  max_bad_fraction: 0.5\n")
    assert load_config(path).validation.max_bad_fraction == 0.5


def test_settings_that_contradict_themselves_and_a_value_of_a_billion_aliases_are_one_quick_line(
        tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("validate: {min_chars: 10, max_chars: 2}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: validate: min_chars \(10\) is over max_chars \(2\): every row "):
        load_config(path)
    path.write_text('data: {path: d.csv, delimiter: "\\n"}\n')
    with pytest.raises(ConfigError, match=r"delimiter: '\\n' cannot separate fields"):
        load_config(path)
    # ten levels of ten aliases: 10^10 strings where the message shows a few (it spent minutes and gigabytes)
    levels = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]'] + [
        f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 10)}]" for n in range(1, 10)]
    path.write_text("x:\n" + "".join(f"  {level}\n" for level in levels) + "data: {path: d.jsonl, license: *l9}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "data.license: input should be a valid string (got [[[[...]" in str(err.value)
    assert len(str(err.value)) < 400


def test_a_config_of_one_source_takes_a_list_of_sources_once_its_path_is_set_to_null() -> None:
    listed = ["data.sources=[{path: a.jsonl}, {path: feedback.jsonl}]"]
    with pytest.raises(ConfigError, match="data.path .one source. and data.sources .a list. are both set"):
        load_config("configs/tiny_sft_cpu.yaml", listed)
    config = load_config("configs/tiny_sft_cpu.yaml", ["data.path=null", *listed])
    assert [source.path for source in config.data.sources] == ["a.jsonl", "feedback.jsonl"]


def test_plan_reads_and_parses_its_config_once(instruction_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = count_parses(monkeypatch)
    result = CliRunner().invoke(app, ["plan", str(REPO / "configs" / "tiny_sft_cpu.yaml"),
                                      f"data.path={instruction_file}"])
    assert result.exit_code == 0, result.output
    assert counts == {"read": 1, "parse": 1}


def test_a_handed_config_is_what_loading_its_file_gives_without_a_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `llmops run` does for the flow it starts: the flow loads its path and overrides, and gets the command's
    config; other overrides, or the same ones after the block, are read and parsed."""
    path = REPO / "configs" / "default.yaml"
    config = load_config(path, ["train.seed=3"])
    counts = count_parses(monkeypatch)
    with handing(config, path, ["train.seed=3"]):
        assert load_config(path.parent / ".." / "configs" / "default.yaml", ["train.seed=3"]) is config
        assert counts == {}
        assert load_config(path, ["train.seed=4"]).train.seed == 4
    again = load_config(path, ["train.seed=3"])
    assert again == config and again is not config
    assert counts == {"read": 2, "parse": 2}


def test_a_load_parses_the_config_once_and_gives_what_parsing_the_completed_mapping_gives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The data section parsed to select the objective is the one the config holds (DPO fills in a LoRA adapter,
    every objective its name): one parse, and the same config as parsing the completed mapping whole."""
    dpo = ["data.kind=preference", "model.name_or_path=gpt2", "model.architecture=gpt2"]
    for overrides, objective in (([], "sft"), (dpo, "dpo")):
        counts = count_parses(monkeypatch)
        config = load_config(REPO / "configs" / "default.yaml", overrides)
        assert counts == {"read": 1, "parse": 1} and config.data.objective == objective
        raw = read_raw(REPO / "configs" / "default.yaml", overrides)
        completed = registry.selected(config.data).defaults(raw)
        assert config == parse_config({**completed, "data": {**raw.get("data", {}), "objective": objective}})
    assert config.model.adapter == "lora"


@pytest.mark.parametrize("override", ["train.work_pool=gpu", "train.work_pool_wait=30", "train.rendezvous.timeout=60",
                                      "train.ray.max_failures=1", "train.retries=2"])
def test_a_key_that_moved_out_of_train_says_where_it_went(override: str) -> None:
    moved = override.split("=")[0].split(".")[1]
    with pytest.raises(ConfigError) as raised:
        load_config("configs/default.yaml", [override])
    assert str(raised.value) == f"configs/default.yaml (override {override}): train.{moved}: moved to launch.{moved}"
    with_new_key = load_config("configs/default.yaml", [override.replace("train.", "launch.", 1)])
    assert with_new_key.recipe()["train"] == load_config("configs/default.yaml").recipe()["train"]


def test_the_train_section_holds_no_placement_and_its_key_did_not_move(tmp_path: Path) -> None:
    """What moved to `launch` was unkeyed in `train`: the train stage's keyed fields are the train section whole."""
    from llmops.pipeline.keys import read_fields
    from llmops.pipeline.stages import stage

    spec = stage("train")
    config = load_config(REPO / "configs" / "default.yaml")
    fields = read_fields(config, spec.reads, spec.unkeyed)
    assert set(fields) == {"train", "preference", "grpo", "model", "data.kind", "data.objective", "data.labels"}
    assert set(fields["train"]) == set(config.train.model_dump(by_alias=True)) - {"checkpoint_dir"}
    path = tmp_path / "old.yaml"
    path.write_text("train:\n  max_steps: 3\n  work_pool: gpu\n")
    with pytest.raises(ConfigError, match=r"train.work_pool: moved to launch.work_pool$"):
        load_config(path)
