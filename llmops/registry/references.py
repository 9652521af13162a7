"""Naming a registered version: `NAME@alias`, `NAME/VERSION`, or `NAME`, which is always its champion.

One grammar for every command and setting that names a version (predict, serve, models show and
export, a registered starting model `models:/NAME@alias`), and one-line errors that say what exists
instead when the name, the alias or the version does not.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from llmops.io.errors import UserError

CHAMPION, CHALLENGER = "champion", "challenger"
URI_PREFIX = "models:/"


class RegistryError(UserError, ValueError):
    """A registry request that cannot be met (unknown model, version or alias; nothing to roll back to; a registry
    that refuses a read or a write)."""


# what MLflow answers for a registered model, version or alias that does not exist (an alias: invalid parameter)
NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


@contextmanager
def registry_errors(doing: str) -> Iterator[None]:
    """MLflow's errors while `doing` something with the registry (a database that refuses a value, a server that
    fails) as one line saying what failed; the registry's own message can run to many lines (the SQL it ran)."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as err:
        first = next((line.strip() for line in str(err.message).splitlines() if line.strip()), err.error_code)
        raise RegistryError(f"{doing} failed: {first[:500]}") from err


@dataclass(frozen=True)
class Reference:
    """A registered model's version: by alias, or by number."""

    name: str
    alias: str | None = None
    version: str | None = None

    @property
    def uri(self) -> str:
        return f"{URI_PREFIX}{self.name}@{self.alias}" if self.alias else f"{URI_PREFIX}{self.name}/{self.version}"

    def __str__(self) -> str:
        return f"{self.name}@{self.alias}" if self.alias else f"{self.name}/{self.version}"


def parse_reference(text: str) -> Reference:
    """`NAME@alias`, `NAME/VERSION` or `NAME` (its champion); a `models:/` prefix is allowed."""
    body = text.strip().removeprefix(URI_PREFIX)
    name, at, alias = body.partition("@")
    if at:
        if not name or not alias or "/" in alias or "@" in alias:
            raise RegistryError(f"{text!r}: expected NAME, NAME@alias or NAME/VERSION")
        return Reference(name=name, alias=alias)
    numbered = re.fullmatch(r"(.+)/(\d+)", body)
    if numbered:
        return Reference(name=numbered.group(1), version=numbered.group(2))
    if not body or "/" in body:
        raise RegistryError(f"{text!r}: expected NAME, NAME@alias or NAME/VERSION")
    return Reference(name=body, alias=CHAMPION)


def is_registered(name: str | None) -> bool:
    """Whether a model setting names a registered version (`models:/...`) rather than a folder or a hub id."""
    return bool(name) and str(name).startswith(URI_PREFIX)


def resolve_version(mlflow_client: Any, reference: Reference, where: str) -> Any:
    """The registered version the reference names, or a one-line error saying what exists instead."""
    from mlflow.exceptions import MlflowException

    try:
        if reference.alias:
            return mlflow_client.get_model_version_by_alias(reference.name, reference.alias)
        return mlflow_client.get_model_version(reference.name, reference.version)
    except MlflowException:
        pass
    known = [model.name for model in mlflow_client.search_registered_models()]
    if reference.name not in known:
        listed = ", ".join(sorted(known)) or "none"
        raise RegistryError(f"no registered model {reference.name!r} in {where} (registered models: {listed})")
    if reference.alias:
        aliases = mlflow_client.get_registered_model(reference.name).aliases or {}
        listed = ", ".join(f"@{alias} (version {number})" for alias, number in sorted(aliases.items())) or "none"
        raise RegistryError(f"{reference.name} has no alias {reference.alias!r} (aliases: {listed})")
    versions = sorted(int(v.version) for v in mlflow_client.search_model_versions(f"name = '{reference.name}'"))
    raise RegistryError(f"{reference.name} has no version {reference.version} (versions: "
                        f"{', '.join(map(str, versions))})")


def holder(mlflow_client: Any, name: str, alias: str) -> Any | None:
    """The version holding an alias, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.get_model_version_by_alias(name, alias)
    except MlflowException as err:
        if err.error_code not in NOT_FOUND:  # a registry that fails is not one without the alias
            raise
        return None


def current_champion(mlflow_client: Any, name: str) -> Any | None:
    return holder(mlflow_client, name, CHAMPION)


def model_tags(mlflow_client: Any, name: str) -> dict[str, str]:
    """The registered model's tags; none when it is not registered yet."""
    from mlflow.exceptions import MlflowException

    try:
        return dict(mlflow_client.get_registered_model(name).tags or {})
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":  # a registry that fails is not a model without tags
            raise
        return {}


def aliases_of(version: Any) -> list[str]:
    return list(getattr(version, "aliases", []) or [])
