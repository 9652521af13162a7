from pathlib import Path

import pytest
import yaml

from llmops.core.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(leaves(value, f"{prefix}{key}."))
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
        name = {"data.path": "data.sources"}.get(name, name)
        held = resolved[name]
        if name == "data.sources":
            assert held[0]["path"] == value, name
        else:
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
    expected = (r"data.kind: input should be 'text', 'instruction', 'chat', 'classification', 'seq2seq', 'tokens' or "
                r"'preference' \(got 'images'\)")
    with pytest.raises(ConfigError, match=expected):
        load_config(path)


def test_missing_file_and_broken_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  epochs: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)


def test_digest_changes_with_any_value() -> None:
    base = load_config(REPO / "configs/default.yaml")
    assert base.digest() != load_config(REPO / "configs/default.yaml", ["train.seed=1"]).digest()
