"""What a stage hands on: its typed figures in a record, and what building it took.

The stage contract's types: a stage returns Figures (the runner wraps them in a StageRecord). They
decide what a record's JSON holds, so they belong to the stages' keys.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class Figures(BaseModel):
    """A stage's typed figures; numbers (and nested figures) are logged as metrics `<stage>.<name>`."""

    # NaN (a metric with nothing to measure) is stored as NaN, not as null, so that it reads back as a float
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")
    # maps whose keys the code chooses (model and metric names), logged like nested figures; other maps are
    # keyed by data (file names, reasons) and never become metric names
    NAMED_MAPS: ClassVar[tuple[str, ...]] = ()

    def loggable(self) -> dict[str, float]:
        flat: dict[str, float] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, Figures):
                flat.update({f"{name}.{k}": v for k, v in value.loggable().items()})
            elif isinstance(value, dict) and name in self.NAMED_MAPS:
                flat.update({f"{name}.{k}": v for k, v in numbers(value).items()})
            elif is_number(value):
                flat[name] = float(value)
        return flat


def is_number(value: Any) -> bool:
    """A number to log, NaN and infinity included (MLflow stores them): a NaN figure says something went wrong."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def numbers(tree: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(numbers(value, f"{prefix}{key}."))
        elif is_number(value):
            flat[f"{prefix}{key}"] = float(value)
    return flat


FiguresT = TypeVar("FiguresT", bound=Figures)


class Compute(BaseModel):
    """What building an artifact took: its wall time, on how many devices of which kind (a GPU's name, or cpu)."""

    model_config = ConfigDict(frozen=True)

    device: str = "cpu"
    devices: int = Field(1, ge=1)
    seconds: float = Field(0.0, ge=0)

    @property
    def device_hours(self) -> float:
        return self.seconds * self.devices / 3600


# what a stage holds unless the stage table says otherwise: one device, the CPU
ONE_CPU = Compute()
