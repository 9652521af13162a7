"""The objectives, by name: one line each. A config selects one with `data.objective`, or by its record kind.

Entries name their class as "module:Class" (imported when selected, so that a stage's code, and so
its key, holds the selected objective alone); `data.objective` may also name any importable
"module:Class" of your own. `default_for` lists the record kinds an objective trains when
`data.objective` is not set.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmops.config.schema import DataConfig
from llmops.io.errors import ConfigError

if TYPE_CHECKING:  # the data stages select a record kind through here: no model code in their keys
    from llmops.objectives.base import Objective
    from llmops.records.base import RecordKind


@dataclass(frozen=True)
class Entry:
    name: str
    target: str
    default_for: tuple[str, ...] = ()


ENTRIES: tuple[Entry, ...] = (
    Entry("causal_lm", "llmops.objectives.causal_lm:CausalLM", default_for=("text",)),
    Entry("sft", "llmops.objectives.sft:SFT", default_for=("instruction", "chat")),
    Entry("classification", "llmops.objectives.classification:SequenceClassification",
          default_for=("classification",)),
    Entry("masked_lm", "llmops.objectives.masked_lm:MaskedLM"),
    Entry("token_classification", "llmops.objectives.token_classification:TokenClassification",
          default_for=("tokens",)),
    Entry("seq2seq", "llmops.objectives.seq2seq:Seq2Seq", default_for=("seq2seq",)),
    Entry("dpo", "llmops.objectives.dpo:DPO", default_for=("preference",)),
    Entry("reward", "llmops.objectives.reward:RewardModel"),
    Entry("orpo", "llmops.objectives.orpo:ORPO"),
    Entry("kto", "llmops.objectives.kto:KTO", default_for=("feedback",)),
    Entry("qa", "llmops.objectives.qa:QuestionAnswering", default_for=("qa",)),
    Entry("grpo", "llmops.objectives.grpo:GRPO", default_for=("prompts",)),
)


def names() -> tuple[str, ...]:
    return tuple(entry.name for entry in ENTRIES)


def record_kinds() -> tuple[str, ...]:
    return tuple(kind for entry in ENTRIES for kind in entry.default_for)


def target_of(data: DataConfig) -> str:
    """The "module:Class" of the objective the data section selects."""
    if data.objective is None:
        found = next((entry for entry in ENTRIES if data.kind in entry.default_for), None)
        if found is None:
            raise ConfigError(f"data.kind: unknown record kind {data.kind!r}; expected one of: "
                              f"{', '.join(record_kinds())}")
        return found.target
    return target_of_name(data.objective)


def target_of_name(name: str) -> str:
    """The "module:Class" of an objective named as data.objective names it."""
    found = next((entry for entry in ENTRIES if entry.name == name), None)
    if found is not None:
        return found.target
    if ":" not in name:
        raise ConfigError(f"data.objective: unknown objective {name!r}; expected one of: {', '.join(names())}, or "
                          "module:Class of your own")
    return name


def section_readers(section: str) -> tuple[str, ...]:
    """The built-in objectives that read a config section of their own (Objective.section), by name."""
    return tuple(entry.name for entry in ENTRIES if objective_class(entry.target).section == section)


def module_of(data: DataConfig) -> str:
    return target_of(data).partition(":")[0]


@functools.cache
def objective_class(target: str) -> type[Objective]:
    module, _, name = target.partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError, TypeError) as err:  # not a module path (empty, relative)
        raise ConfigError(f"data.objective: cannot import {target} ({type(err).__name__}: {err})") from None
    if not (isinstance(found, type) and hasattr(found, "kinds") and hasattr(found, "encode")):
        raise ConfigError(f"data.objective: {target} is not an Objective (llmops.objectives.base)")
    return found


@functools.cache
def objective_for(target: str, kind: str) -> Objective:
    cls = objective_class(target)
    record_kind = next((candidate for candidate in cls.kinds if candidate.name == kind), None)
    if record_kind is None:
        raise ConfigError(f"data.objective={cls.name} trains on kind {' or '.join(k.name for k in cls.kinds)}: "
                          f"set data.kind to it (got {kind})")
    return cls(record_kind)


def selected(data: DataConfig) -> Objective:
    """The objective the data section selects, bound to its record kind."""
    return objective_for(target_of(data), data.kind)


def record_kind(data: DataConfig) -> RecordKind:
    return selected(data).kind


def code_modules(data: DataConfig, reads: str | None) -> tuple[str, ...]:
    """The modules of the selected objective whose code shapes a stage's artifact: the record kind's module for the
    data stages (`reads="kind"`), the objective's own for the later ones (`reads="objective"`), none otherwise."""
    if reads is None:
        return ()
    objective = selected(data)
    return (type(objective.kind if reads == "kind" else objective).__module__,)


def by_task(task: str) -> Objective | None:
    """The built-in objective registered as an MLflow task, for a version whose run left no config to read."""
    for entry in ENTRIES:
        cls = objective_class(entry.target)
        if cls.task == task:
            return cls(cls.kinds[0])
    return None
