"""The pipeline's one config model: YAML files in configs/, `section.key=value` overrides."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

RecordKind = Literal["text", "instruction"]


class ConfigError(ValueError):
    """A config problem, phrased as one line a person can act on."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class DataConfig(Section):
    path: str = "data/instructions.jsonl"
    format: Literal["auto", "jsonl", "csv", "parquet"] = "auto"
    kind: RecordKind = "instruction"
    # canonical field -> column name in the source, e.g. {output: response}
    columns: dict[str, str] = Field(default_factory=dict)
    eval_fraction: float = Field(0.05, gt=0, lt=1)
    # salt of the hash split: the same row always lands in the same split, whatever else changes
    split_salt: str = "llmops"
    license: str = "unknown"


class ValidateConfig(Section):
    max_bad_fraction: float = Field(0.05, ge=0, le=1)
    min_chars: int = Field(1, ge=1)
    max_chars: int = Field(20_000, ge=1)
    chunk_rows: int = Field(50_000, ge=1)


class DedupConfig(Section):
    casefold: bool = False


class TokenizeConfig(Section):
    # path or hub id; None: the pretrained model's own, or a BPE tokenizer trained on the data
    tokenizer: str | None = None
    vocab_size: int = Field(1024, ge=300)
    max_length: int = Field(256, ge=8)
    # a Jinja template, or the path of a .jinja file; None: the tokenizer's own or a built-in default
    chat_template: str | None = None


class ModelConfig(Section):
    # path or hub id for from_pretrained; None: build `architecture` from this config with random init
    name_or_path: str | None = None
    architecture: Literal["llama", "gpt2"] = "llama"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int | None = None
    trust_remote_code: bool = False


class TrainConfig(Section):
    epochs: float = Field(3.0, gt=0)
    max_steps: int = -1
    batch_size: int = Field(32, ge=1)
    grad_accum: int = Field(1, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "cosine"
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    gradient_checkpointing: bool = False
    seed: int = 0
    logging_steps: int = Field(25, ge=1)
    save_steps: int = Field(200, ge=1)
    save_total_limit: int = Field(2, ge=1)


class EvaluateConfig(Section):
    max_examples: int = Field(200, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    batch_size: int = Field(64, ge=1)


class RegisterConfig(Section):
    model_name: str = "llmops-default"


class TrackingConfig(Section):
    # None: a SQLite store and artifact folder inside the workspace
    tracking_uri: str | None = None
    experiment: str = "llmops"


class OrchestrationConfig(Section):
    # after a run of the config dvc.yaml tracks, write dvc.lock so `dvc status` reflects the run
    commit_dvc_lock: bool = True


class PipelineConfig(Section):
    data: DataConfig = Field(default_factory=DataConfig)
    validation: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate")
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    registry: RegisterConfig = Field(default_factory=RegisterConfig, alias="register")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """Read a YAML config, apply `section.key=value` overrides and validate the result."""
    raw = read_yaml(Path(path))
    for override in overrides:
        apply_override(raw, override, path)
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, path, overrides)) from None


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML ({getattr(err, 'problem', err)})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    return raw


def apply_override(raw: dict[str, Any], override: str, path: str | Path) -> None:
    """Set `a.b.c=value` in the nested mapping; the value is read as a YAML scalar."""
    dotted, sep, value = override.partition("=")
    if not sep or not dotted.strip():
        raise ConfigError(f"override {override!r}: expected section.key=value")
    keys = dotted.strip().split(".")
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            where = ".".join(keys[: depth + 1])
            raise ConfigError(f"{path}: override {override!r}: {where} is a value, not a section")
        node = child
    node[keys[-1]] = yaml.safe_load(value) if value.strip() else None


def describe_validation_error(err: ValidationError, path: str | Path, overrides: tuple[str, ...] | list[str]) -> str:
    first = err.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    origin = next((o for o in overrides if o.partition("=")[0].strip() == loc), None)
    source = f"{path} (override {origin})" if origin else str(path)
    if first["type"] == "extra_forbidden":
        allowed = allowed_keys(first["loc"][:-1])
        hint = f"; expected one of: {', '.join(allowed)}" if allowed else ""
        message = f"{source}: {loc}: unknown key{hint}"
    else:
        message = f"{source}: {loc}: {first['msg'].lower()} (got {first.get('input')!r})"
    more = len(err.errors()) - 1
    return message + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys a section accepts, for the 'unknown key' message."""
    model: type[BaseModel] = PipelineConfig
    for part in loc:
        field = next(
            (f for name, f in model.model_fields.items() if part in (name, f.alias)),
            None,
        )
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [f.alias or name for name, f in model.model_fields.items()]
