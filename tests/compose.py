"""docker/compose.yaml as Compose reads it, without any Docker binary.

The env file (--env-file), the variable interpolation of the Compose specification (`$VAR`, `${VAR}`,
`${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}`, `${VAR:+alt}`, `${VAR+alt}`, nested
`${A:-${B}}`, `$$` for a literal `$`), profiles, and validation against Compose's own JSON schema (the
compose-spec schema vendored by check-jsonschema). `resolve` gives what `docker compose config` would, before
Compose's own normalisation (short port syntax, string commands stay as written).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
NAME = re.compile(r"[_A-Za-z][_A-Za-z0-9]*")
# inside braces: a name, then optionally an operator and its word (which may hold nested ${...})
BRACED = re.compile(r"(?P<name>[_A-Za-z][_A-Za-z0-9]*)(?:(?P<op>:?[-?+])(?P<word>.*))?", re.S)


# the team's repository in the env files these tests write: a checkout need not have an `origin` remote
TEAM_REPO = "https://git.example.com/team/llmops.git"


def make_env(target: Path, repo: str = TEAM_REPO) -> None:
    """docker/.env as docker/make-env.sh writes it, with the repository the workers clone given."""
    subprocess.run([str(COMPOSE_FILE.parent / "make-env.sh"), str(target)], check=True, capture_output=True,
                   env={**os.environ, "LLMOPS_GIT_REPO": repo})


class ComposeError(ValueError):
    """What Compose refuses a file with (a missing required variable, a bad template, a schema violation)."""


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """`text` with its variables replaced as Compose does; an unset variable without a default is blank."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$":
            out.append(text[i])
            i += 1
        elif text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            end = closing_brace(text, i + 2)
            out.append(expand(text[i + 2:end], variables, text))
            i = end + 1
        elif name := NAME.match(text, i + 1):
            out.append(variables.get(name.group(), ""))
            i = name.end()
        else:
            raise ComposeError(f"invalid interpolation format for {text!r}: a lone '$' (write '$$' for a literal one)")
    return "".join(out)


def closing_brace(text: str, start: int) -> int:
    """The index of the `}` that closes the `${` opened just before `start`, nested `${...}` included."""
    depth, i = 1, start
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
            continue
        if text.startswith("${", i):
            depth, i = depth + 1, i + 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ComposeError(f"invalid interpolation format for {text!r}: an unclosed '${{'")


def expand(body: str, variables: Mapping[str, str], text: str) -> str:
    """One `${...}`: `:` makes an empty value count as unset; the word is interpolated only when it is used."""
    match = BRACED.fullmatch(body)
    if not match:
        raise ComposeError(f"invalid interpolation format for {text!r}: '${{{body}}}'")
    name, op, word = match["name"], match["op"], match["word"]
    value = variables.get(name)
    present = value is not None and (value != "" or not op or not op.startswith(":"))
    if op is None:
        return value or ""
    if op.endswith("-"):
        return value if present else interpolate(word, variables)
    if op.endswith("+"):
        return interpolate(word, variables) if present else ""
    if not present:
        message = interpolate(word, variables)
        raise ComposeError(f"required variable {name} is missing a value" + (f": {message}" if message else ""))
    return value


def read_env_file(path: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of an env file as Compose reads one: `KEY=VALUE` lines (an `export ` prefix allowed), blank
    lines and `#` comments skipped; single quotes keep a value literal, double quotes and bare values are
    interpolated with the environment and the lines before; a bare value ends at ` #`."""
    found: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, raw = line.removeprefix("export ").partition("=")
        key = key.strip()
        if not sep or not NAME.fullmatch(key):
            raise ComposeError(f"{path}:{number}: not a KEY=VALUE line: {line!r}")
        found[key] = env_value(raw.strip(), {**found, **(environ or {})})
    return found


def env_value(raw: str, known: Mapping[str, str]) -> str:
    if len(raw) >= 2 and raw[0] == raw[-1] == "'":
        return raw[1:-1]
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        unescaped = raw[1:-1].replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")
        return interpolate(unescaped, known)
    return interpolate(re.split(r"\s+#", raw, maxsplit=1)[0].rstrip(), known)


def compose_variables(env_file: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """What the file is interpolated with: the env file's values, overridden by the shell's environment."""
    return {**read_env_file(env_file, environ), **environ}


def interpolate_tree(value: Any, variables: Mapping[str, str], path: str = "") -> Any:
    """Every string value of the loaded file interpolated (keys are not); an error names where it happened."""
    if isinstance(value, dict):
        return {key: interpolate_tree(item, variables, f"{path}.{key}".lstrip(".")) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate_tree(item, variables, f"{path}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, str):
        try:
            return interpolate(value, variables)
        except ComposeError as err:
            raise ComposeError(f"error while interpolating {path}: {err}") from None
    return value


@cache
def schema() -> dict:
    """The Compose specification's JSON schema, as check-jsonschema vendors it."""
    vendored = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(vendored.read_text())


def validate(document: dict) -> None:
    """Every violation of the Compose schema, in one error; none: the file is a valid Compose file."""
    from jsonschema import Draft202012Validator

    errors = sorted(Draft202012Validator(schema()).iter_errors(document), key=lambda e: list(e.absolute_path))
    if errors:
        raise ComposeError("the compose file does not follow the Compose schema:\n" + "\n".join(
            f"  {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors))


def resolve(variables: Mapping[str, str], profiles: Iterable[str] = (), path: Path = COMPOSE_FILE) -> dict:
    """The compose file interpolated with `variables`, validated against the schema, with the services that are
    enabled: those without profiles and those with one of `profiles`."""
    document = interpolate_tree(yaml.safe_load(path.read_text()), variables)
    validate(document)
    active = set(profiles)
    services = {name: service for name, service in document.get("services", {}).items()
                if not service.get("profiles") or active & set(service["profiles"])}
    return {**document, "services": services}
