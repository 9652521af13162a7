"""tests/compose.py reads a compose file as Compose does: interpolation, env files, profiles and the schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.compose import ComposeError, compose_variables, interpolate, make_env, read_env_file, resolve

VARIABLES = {"SET": "value", "EMPTY": "", "OTHER": "other"}


@pytest.mark.parametrize(("template", "expected"), [
    ("plain text", "plain text"),
    ("${SET}", "value"),
    ("$SET/$OTHER-x", "value/other-x"),
    ("${UNSET}", ""),
    ("${SET:-default}", "value"),
    ("${EMPTY:-default}", "default"),
    ("${UNSET:-default}", "default"),
    ("${EMPTY-default}", ""),
    ("${UNSET-default}", "default"),
    ("${SET:?required}", "value"),
    ("${EMPTY?set but empty is enough}", ""),
    ("${SET:+alternative}", "alternative"),
    ("${EMPTY:+alternative}", ""),
    ("${EMPTY+alternative}", "alternative"),
    ("${UNSET+alternative}", ""),
    ("${UNSET:-${OTHER}}", "other"),
    ("${UNSET:-${ALSO_UNSET:-deep}}/${SET}", "deep/value"),
    ("$${SET} and $$SET and a$$b", "${SET} and $SET and a$b"),
    ("${UNSET:-$${literal}}", "${literal}"),
])
def test_interpolation_follows_the_compose_specification(template: str, expected: str) -> None:
    assert interpolate(template, VARIABLES) == expected


@pytest.mark.parametrize(("template", "message"), [
    ("${EMPTY:?set EMPTY in .env}", "required variable EMPTY is missing a value: set EMPTY in .env"),
    ("${UNSET:?set UNSET in .env}", "required variable UNSET is missing a value: set UNSET in .env"),
    ("${UNSET?needed}", "required variable UNSET is missing a value: needed"),
    ("${UNSET:?}", "required variable UNSET is missing a value"),
    ("${UNSET:?${OTHER} is not enough}", "required variable UNSET is missing a value: other is not enough"),
])
def test_a_required_variable_stops_with_its_message(template: str, message: str) -> None:
    with pytest.raises(ComposeError) as raised:
        interpolate(f"prefix {template} suffix", VARIABLES)
    assert str(raised.value) == message


@pytest.mark.parametrize("template", ["cost: $5", "${SET", "${1ST}", "${SET:default}", "${}"])
def test_a_malformed_template_is_refused(template: str) -> None:
    with pytest.raises(ComposeError, match="invalid interpolation format"):
        interpolate(template, VARIABLES)


def test_an_env_file_is_read_as_compose_reads_one(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("# a comment\n\nexport FIRST=one\nSECOND=${FIRST}-two  # trailing comment\n"
                        "SINGLE='${FIRST} stays'\nDOUBLE=\"${SECOND} # kept\"\nEMPTY=\nFROM_SHELL=file\n")
    values = read_env_file(env_file, {"FROM_SHELL": "shell"})
    assert values == {"FIRST": "one", "SECOND": "one-two", "SINGLE": "${FIRST} stays", "DOUBLE": "one-two # kept",
                      "EMPTY": "", "FROM_SHELL": "file"}
    # the shell's environment wins over the env file
    assert compose_variables(env_file, {"FROM_SHELL": "shell"})["FROM_SHELL"] == "shell"
    env_file.write_text("NOT A SETTING\n")
    with pytest.raises(ComposeError, match=r"\.env:1: not a KEY=VALUE line"):
        read_env_file(env_file)


@pytest.mark.parametrize("name", ["LLMOPS_DB_PASSWORD", "LLMOPS_S3_SECRET_KEY", "LLMOPS_PREFECT_AUTH",
                                  "LLMOPS_S3_ROOT_USER", "LLMOPS_GIT_REPO"])
def test_each_emptied_setting_stops_compose_and_names_itself(tmp_path: Path, name: str) -> None:
    env_file = tmp_path / ".env"
    make_env(env_file)
    assert resolve(compose_variables(env_file, {}))["services"]
    env_file.write_text(re.sub(rf"^{name}=.*$", f"{name}=", env_file.read_text(), flags=re.M))
    with pytest.raises(ComposeError, match=rf"error while interpolating \S+: required variable {name} is missing a "
                                           rf"value: set {name} in docker/\.env \(see \.env\.example\)"):
        resolve(compose_variables(env_file, {}))


def test_the_schema_refuses_what_compose_refuses_and_profiles_select_services(tmp_path: Path) -> None:
    compose_file = tmp_path / "compose.yaml"
    compose_file.write_text("services:\n  web:\n    image: nginx:1.27\n    ports: ['${BIND:-127.0.0.1}:80:80']\n"
                            "  gpu:\n    image: cuda:12\n    profiles: [gpu]\n")
    assert list(resolve({}, path=compose_file)["services"]) == ["web"]
    both = resolve({"BIND": "10.0.0.1"}, ["gpu"], path=compose_file)
    assert list(both["services"]) == ["web", "gpu"] and both["services"]["web"]["ports"] == ["10.0.0.1:80:80"]
    compose_file.write_text("services:\n  web:\n    image: nginx:1.27\n    restrat: always\n    shm_size: [1]\n")
    with pytest.raises(ComposeError) as raised:
        resolve({}, path=compose_file)
    assert "'restrat'" in str(raised.value) and "services.web.shm_size: [1] is not of type" in str(raised.value)
    compose_file.write_text("services:\n  web:\n    image: nginx:1.27\nvolumes: [data]\n")
    with pytest.raises(ComposeError, match=r"volumes: \['data'\] is not of type 'object'"):
        resolve({}, path=compose_file)
