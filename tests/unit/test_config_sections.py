"""The objectives' own sections, `preference` and `grpo`: top-level, with their defaults; set only by a config whose
objective reads them; the old places under `train` refused with the new one; and covered by the train stage's key."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmops.config.grpo import GrpoConfig
from llmops.config.preference import PreferenceConfig
from llmops.config.schema import OBJECTIVE_SECTIONS, PipelineConfig
from llmops.io.errors import ConfigError
from llmops.objectives import load_config, registry, selected
from llmops.pipeline.keys import stage_key
from llmops.pipeline.stages import stage

REPO = Path(__file__).resolve().parents[2]
DEFAULT, DPO, GRPO = (str(REPO / "configs" / f"{name}.yaml") for name in ("default", "tiny_dpo_cpu", "tiny_grpo_cpu"))


def refusal(path: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(path, overrides)
    return str(raised.value)


def test_the_sections_load_with_their_defaults_beside_train() -> None:
    config = load_config(DEFAULT)
    assert config.preference == PreferenceConfig() and config.preference.beta == 0.1
    assert config.grpo == GrpoConfig() and config.grpo.num_generations == 4 and config.grpo.beta == 0.04
    assert [reward.name for reward in config.grpo.rewards] == ["exact_match"]
    tree = config.as_dict()
    assert tree["preference"] == {"beta": 0.1} and tree["grpo"]["max_completion_length"] == 16
    assert not {"preference_beta", "grpo"} & set(tree["train"])
    assert load_config(DPO).preference.beta == 0.5 and load_config(GRPO).grpo.num_generations == 8


def test_each_section_is_owned_by_the_objectives_that_declare_it() -> None:
    owners = {name: registry.section_readers(name) for name in OBJECTIVE_SECTIONS}
    assert owners == {"preference": ("dpo", "orpo", "kto"), "grpo": ("grpo",)}
    declared = {registry.objective_class(entry.target).section for entry in registry.ENTRIES}
    assert declared == {None, *OBJECTIVE_SECTIONS}
    # each is a section of the one config tree, and shapes the model: the train stage's key reads it whole
    assert set(OBJECTIVE_SECTIONS) <= set(PipelineConfig.model_fields) & set(stage("train").reads)


@pytest.mark.parametrize(("path", "overrides", "expected"), [
    (DEFAULT, ["grpo.num_generations=8"], f"{DEFAULT} (override grpo.num_generations=8): grpo: only objective grpo "
     "reads this section; this config trains sft"),
    (DEFAULT, ["preference.beta=0.3"], f"{DEFAULT} (override preference.beta=0.3): preference: only objectives dpo, "
     "orpo and kto read this section; this config trains sft"),
    (DPO, ["grpo.rewards=[{name: chrf}]"], f"{DPO} (override grpo.rewards=[{{name: chrf}}]): grpo: only objective grpo "
     "reads this section; this config trains dpo"),
    (GRPO, ["preference.beta=0.2"], f"{GRPO} (override preference.beta=0.2): preference: only objectives dpo, orpo "
     "and kto read this section; this config trains grpo"),
])
def test_a_section_the_objective_does_not_read_is_refused_in_one_line(path: str, overrides: list[str],
                                                                      expected: str) -> None:
    assert refusal(path, overrides) == expected


def test_a_file_setting_another_objectives_section_is_named_and_its_defaults_pass(tmp_path: Path) -> None:
    written = tmp_path / "sft.yaml"
    written.write_text("train:\n  max_steps: 3\ngrpo:\n  temperature: 0.7\n")
    assert refusal(str(written), []) == (f"{written}: grpo: only objective grpo reads this section; this config "
                                         "trains sft")
    # holding the defaults, as a resolved config written out does, the section is no setting
    written.write_text("train:\n  max_steps: 3\ngrpo:\n  temperature: 1.0\npreference:\n  beta: 0.1\n")
    assert load_config(written).train.max_steps == 3
    for name, overrides in (("orpo", ["data.objective=orpo"]), ("kto", ["data.kind=feedback"])):
        config = load_config(DPO, [*overrides, "preference.beta=0.25"])
        assert (config.data.objective, config.preference.beta) == (name, 0.25)


@pytest.mark.parametrize(("path", "override", "old", "new"), [
    (DPO, "train.preference_beta=0.5", "train.preference_beta", "preference.beta"),
    (GRPO, "train.grpo.num_generations=4", "train.grpo", "grpo (a section of its own)"),
    (GRPO, "train.grpo={beta: 0.1}", "train.grpo", "grpo (a section of its own)"),
])
def test_the_old_places_under_train_are_refused_naming_the_new_one(path: str, override: str, old: str,
                                                                     new: str) -> None:
    assert refusal(path, [override]) == f"{path} (override {override}): {old}: moved to {new}"


def test_an_old_place_in_a_file_is_refused_naming_the_new_one(tmp_path: Path) -> None:
    written = tmp_path / "old.yaml"
    written.write_text("data:\n  kind: preference\nmodel:\n  name_or_path: gpt2\ntrain:\n  preference_beta: 0.5\n")
    assert refusal(str(written), []) == f"{written}: train.preference_beta: moved to preference.beta"


def train_key(config: PipelineConfig) -> str:
    spec = stage("train")
    return stage_key("train", config, {"tokenize": "tokenized"}, {},
                     registry.code_modules(config.data, spec.objective_code))


def test_the_train_key_covers_the_objectives_section_and_not_an_unrelated_one() -> None:
    base = load_config(DPO)
    assert train_key(load_config(DPO, ["preference.beta=0.3"])) != train_key(base)
    assert train_key(load_config(GRPO, ["grpo.temperature=0.7"])) != train_key(load_config(GRPO))
    for unrelated in ("evaluate.max_examples=50", "register.model_name=other", "validate.max_bad_fraction=0.5"):
        assert train_key(load_config(DPO, [unrelated])) == train_key(base), unrelated
    # the beta held-out pairs are measured with is the section's (TRL trains with it too: objectives/dpo.py)
    assert selected(base.data).reference(None, base).beta == 0.5
