"""What every section of the config model shares: unknown keys, NaN and infinity refused, and no true/false where
a number goes."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    # NaN and infinity are never a sensible setting: `.nan` would pass every bound
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def no_flag_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML reads `yes`, `on` and `true` as True, which pydantic would take as the number 1: a flag where a
        number goes is a slip (`max_bad_fraction: yes` would allow every row to fail), so it is refused."""
        if isinstance(value, bool) and info.field_name is not None \
                and takes_number_not_flag(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"a number is needed here, not {str(value).lower()}")
        return value


def takes_number_not_flag(annotation: Any) -> bool:
    """Whether a field's type holds an int or a float and no bool (a Literal of True or False counts as one)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
    else:
        options = (annotation,)
    flags = any(option is bool or (typing.get_origin(option) is typing.Literal
                                   and any(isinstance(arg, bool) for arg in typing.get_args(option)))
                for option in options)
    return not flags and any(option in (int, float) for option in options)
