"""The Objective interface: everything that differs between what a model is trained to do.

An objective owns its record kinds (fields, columns, checks: records/base.py), the encoding
of a record into token ids and labels, the model class and LoRA task, the trainer, collator and
training arguments, scoring and its metrics with the primary one, the MLflow task it is
registered as, the card's words about it, and the rows `llmops predict` answers. The stages ask
for the selected objective (objectives/registry.py) and call it; none of them compares kinds.

The methods below are the defaults most objectives share; each objective overrides what differs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from llmops.config.schema import EvaluateConfig, ModelConfig, PipelineConfig
from llmops.io.errors import UserError
from llmops.models import architectures, modeling, precision
from llmops.objectives.metrics import MetricTable, Scored, named_metric_problems
from llmops.pipeline.keys import library_version
from llmops.records.base import Problem, RecordKind
from llmops.store.workspace import hash_file_cached, remembered
from llmops.text import packing

if TYPE_CHECKING:  # the types of transformers, datasets, torch and pyarrow, without importing them at run time
    import pyarrow as pa
    import torch
    from datasets import Dataset
    from transformers import Pipeline, Trainer, TrainingArguments
    from transformers import PreTrainedTokenizerBase as Tokenizer

    Model = torch.nn.Module  # transformers' own, or wrapped in a LoRA adapter (peft's: a torch module)
    Collator = Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]


class ObjectiveError(UserError, ValueError):
    """A model, tokenizer or setting cannot serve the selected objective: one line naming the setting to change."""


class RowError(ValueError):
    """One input row cannot be predicted on; the message says why."""


@dataclass(frozen=True)
class Encoding:
    """What encoding a record depends on besides the tokenizer."""

    max_length: int
    labels: tuple[str, ...] = ()
    # overlap, in tokens, of the windows of an input longer than max_length (objectives that read windows)
    stride: int = 0


@dataclass
class ScoringContext:
    """How a model is scored: evaluate's settings, the run's lengths and labels, any starting model it is held to."""

    settings: EvaluateConfig
    encoding: Encoding
    reference: Any = None  # the objective's own (DPO's: the frozen start and its beta), opaque to the stages


@dataclass
class Served:
    """A loaded version, as `llmops predict` asks it: model, tokenizer and the limits its run used."""

    model: Model
    tokenizer: Tokenizer
    labels: list[str] | None
    encoding: Encoding
    max_new_tokens: int
    streamer: Callable[[list[Request], bool], Any] | None = None  # the service's: (requests, strip) -> streamer or None


@dataclass(frozen=True)
class Request:
    """One readable input row: what is asked (`ask`, one of the objective's answers), its fields, a reference."""

    line: int
    ask: str
    fields: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None


class Objective:
    """What a model is trained to do; one instance per (objective, record kind)."""

    name: ClassVar[str]
    # the record kinds it trains on
    kinds: ClassVar[tuple[RecordKind, ...]]
    # what it trains, in a sentence of the model card
    summary: ClassVar[str]
    # the MLflow (and Hub pipeline) task a version is registered as
    task: ClassVar[str]
    metrics: ClassVar[MetricTable]
    # the config section of its own settings (preference, grpo: config/schema.py OBJECTIVE_SECTIONS), if any
    section: ClassVar[str | None] = None
    # what `model.architecture` may build from scratch
    architectures: ClassVar[tuple[str, ...]] = ("llama", "gpt2")
    # the kinds of adapter it trains (model.adapter)
    adapters: ClassVar[tuple[str, ...]] = ("none", "lora", "qlora")
    # peft's task type, and the modules all-linear must leave out (a head trained whole)
    peft_task: ClassVar[str] = "CAUSAL_LM"
    lora_exclude: ClassVar[tuple[str, ...]] = ()
    # transformers still builds the objective's pipeline from its task: MLflow's transformers flavor serves a version
    # (else the version is a pyfunc of this project's code: registry/flavors.py)
    pipeline_served: ClassVar[bool] = True
    # peft's AutoPeftModel class that loads a saved adapter
    peft_auto: ClassVar[str] = "AutoPeftModelForCausalLM"
    # samples may be packed several to a row (decoders reading one sequence)
    packable: ClassVar[bool] = False
    # it tunes a model: model.name_or_path is required
    needs_base: ClassVar[bool] = False
    # its metrics measure a model against the starting model (a DPO reward margin): scoring needs that model too
    measured_against_start: ClassVar[bool] = False
    # encoding reads where each token lies in the text (character offsets, word ids), which only a fast tokenizer
    # (a Rust backend, tokenizer.json) gives: a Python one (Marian's, a remote-code one) gives token ids only
    needs_offsets: ClassVar[bool] = False
    # lm-eval's name for the kind of language model it trains ("causal", "seq2seq"); None: no benchmarks apply
    benchmark_backend: ClassVar[str | None] = None

    def __init__(self, kind: RecordKind) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind.name})"

    # --- config --------------------------------------------------------------------------------------------

    def defaults(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The raw config with this objective's defaults for what it leaves unset (shown in the resolved config)."""
        return raw

    def check(self, config: PipelineConfig) -> list[Problem]:
        """What the config asks that this objective cannot do, as (field, what to change)."""
        problems = self.kind.check(config.data)
        model = config.model
        if self.needs_base and not model.name_or_path:
            problems.append(("model.name_or_path", f"{self.name} tunes a trained model: set model.name_or_path (a "
                             "model folder, a hub id, or a registered version, models:/NAME@alias)"))
        if not model.name_or_path and model.architecture not in self.architectures:
            problems.append(("model.architecture", f"{self.name} builds {' or '.join(self.architectures)} from "
                             f"scratch (got {model.architecture}): set model.architecture to one of them, or "
                             "model.name_or_path to a pretrained model"))
        problems += self.position_problems(config)
        if model.adapter not in self.adapters:
            problems.append(("model.adapter", f"model.adapter={model.adapter} is not supported by {self.name}: use "
                             f"{' or '.join(self.adapters)}"))
        problems += named_metric_problems(config, self.metrics, self.name)
        if config.evaluate.benchmarks and self.benchmark_backend is None:
            problems.append(("evaluate.benchmarks", f"{self.name} trains no language model for lm-eval's tasks to "
                             "ask: leave evaluate.benchmarks empty"))
        return problems

    def position_problems(self, config: PipelineConfig) -> list[Problem]:
        """A model built here with a position table shorter than tokenize.max_length (a pretrained base's table is
        checked at tokenize, which reads its config)."""
        model, length = config.model, config.tokenize.max_length
        limit = None if model.name_or_path else architectures.position_limit(model.architecture)
        if limit is None or length <= limit:
            return []
        builds_llama = "llama" in self.architectures
        rotary = ", or model.architecture=llama (rotary positions, no such limit)" if builds_llama else ""
        return [("tokenize.max_length", f"tokenize.max_length={length} is longer than a {model.architecture} model "
                 f"built here reads (its position embeddings cover {limit} tokens): set tokenize.max_length to at "
                 f"most {limit}{rotary}")]

    # --- tokenize ------------------------------------------------------------------------------------------

    def train_tokenizer(self, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """A tokenizer trained on the training split's texts, for a model built from scratch."""
        from llmops.text.tokenizers import train_bpe

        return train_bpe(texts, vocab_size)

    def check_tokenizer(self, tokenizer: Tokenizer, source: str) -> None:
        """Refuse a pretrained tokenizer the objective cannot use, in one line."""
        if self.needs_offsets and getattr(tokenizer, "backend_tokenizer", None) is None:
            raise ObjectiveError(
                f"tokenizer {source} ({type(tokenizer).__name__}) has no fast backend, and data.objective={self.name} "
                "reads where each token lies in the text (character offsets, words), which only a fast tokenizer (a "
                "tokenizer.json) gives: set tokenize.tokenizer to a fast tokenizer of the same vocabulary, or use an "
                "objective that reads token ids only (causal_lm, classification, seq2seq)")

    def encode(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], encoding: Encoding) -> dict[str, list[Any]]:
        """Rows to `input_ids` and `labels`, with `raw_length`, `length` and `has_target` per row."""
        raise NotImplementedError

    def arrow_schema(self) -> pa.Schema:
        import pyarrow as pa

        return pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
                          ("raw_length", pa.int32()), ("length", pa.int32())])

    # --- model ---------------------------------------------------------------------------------------------

    def auto_class(self) -> type:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def label_settings(self, labels: list[str]) -> dict[str, Any]:
        """Settings of the model's head that the data decides (a label set)."""
        return {}

    def check_model(self, model_config: ModelConfig) -> None:
        """Refuse a pretrained base the objective cannot train, in one line (the config checks came first)."""

    def build_model(self, model_config: ModelConfig, tokenizer: Tokenizer, seed: int, labels: list[str],
                    quantize: bool = False, dtype: str | None = None) -> Model:
        """A pretrained model (in `dtype`; None: as stored), or a fresh one whose random init is fixed by `seed`."""
        import transformers

        transformers.set_seed(seed)
        self.check_model(model_config)
        extra = self.label_settings(labels)
        attention = {"attn_implementation": self.attention(model_config)}
        if model_config.name_or_path:
            loading = modeling.quantization() if quantize else precision.dtype_setting(dtype)
            return modeling.load_pretrained(self.auto_class(), model_config,
                                            **modeling.fitted_head(model_config, extra), **attention, **loading)
        config = architectures.scratch_config(model_config, tokenizer, extra)
        return self.auto_class().from_config(config, **attention)

    def attention(self, model_config: ModelConfig) -> str:
        """The kernel the model trains with: what this machine offers and its class supports (GPT-2 has no flex, T5
        no FlashAttention), the class known from the config; what it supports is remembered (every plan asks)."""
        entry, support = self.model_class_entry(model_config), lambda: self.kernel_support(model_config)
        return modeling.attention_for(model_config, support=remembered("kernel-support", entry, support) if entry
                                      else support())

    def model_class_entry(self, model_config: ModelConfig) -> str | None:
        """What decides the model class (objective, architecture or local config.json, transformers); None: hub id."""
        owner = f"{type(self).__module__}.{type(self).__qualname__}|transformers {library_version('transformers')}"
        if not model_config.name_or_path:
            return f"{owner}|scratch {model_config.architecture}"
        config_file = Path(model_config.name_or_path) / "config.json"
        if not config_file.is_file():
            return None
        return f"{owner}|{hash_file_cached(config_file)}|remote code {model_config.trust_remote_code}"

    def kernel_support(self, model_config: ModelConfig) -> dict[str, Any]:
        try:  # a hub id offline is not readable here: loading it will say so
            config = modeling.pretrained_config(model_config) if model_config.name_or_path else \
                architectures.config_class(model_config.architecture)()
        except OSError:
            config = None
        return modeling.kernel_support(modeling.model_class(self.auto_class(), config))

    def with_adapter(self, model: Model, model_config: ModelConfig, gradient_checkpointing: bool) -> Model:
        """The model wrapped in its LoRA adapter when one is configured; only the adapter (and a head) trains."""
        return modeling.with_adapter(model, model_config, self.peft_task, self.lora_exclude, gradient_checkpointing)

    def load_trained(self, model_dir: Path) -> Model:
        """The trained model from its folder: full weights, or the base model with the saved adapter."""
        modeling.require_safetensors(model_dir)
        if not modeling.is_adapter(model_dir):
            return self.auto_class().from_pretrained(str(model_dir), use_safetensors=True, trust_remote_code=False)
        base = json.loads((model_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if base:
            modeling.require_safetensors(base)
        return self.load_adapter(model_dir, modeling.read_labels(model_dir))

    def load_adapter(self, adapter_dir: Path, labels: list[str]) -> Model:
        """A saved LoRA adapter on its base model, with the head the label set sizes."""
        import peft

        return getattr(peft, self.peft_auto).from_pretrained(str(adapter_dir), use_safetensors=True,
                                                             trust_remote_code=False, **self.label_settings(labels))

    # --- train ---------------------------------------------------------------------------------------------

    def datasets(self, tokenized_dir: Path, packed: bool, max_length: int) -> tuple[Dataset, Dataset]:
        """Train rows packed into sequences of `max_length` tokens, or one sample per row; eval rows as they are.
        Every training row carries the ids of its samples, for the ledger."""
        from llmops.io.files import load_dataset_dir

        train_set = load_dataset_dir(tokenized_dir / "train")
        eval_set = load_dataset_dir(tokenized_dir / "eval").select_columns(["input_ids", "labels"])
        if packed:
            return packing.pack(packing.with_sample_ids(train_set, per_token=True), max_length), eval_set
        columns = ["input_ids", "labels", "length", packing.SAMPLE_IDS]
        return packing.with_sample_ids(train_set, per_token=False).select_columns(columns), eval_set

    def collator(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> Collator:
        """Rows to batches: padded, or packed with position ids restarting at each sample."""
        if packed:
            return packing.packed_collator(model, tokenizer.pad_token_id, max_length)
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        return DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)

    def meter(self, tokenizer: Tokenizer, model: Model, packed: bool, max_length: int, seed: int) -> packing.BatchMeter:
        """The collator, counting real and padded tokens and recording each batch's sample ids."""
        return packing.BatchMeter(self.collator(tokenizer, model, packed, max_length, seed))

    def arguments(self, common: dict[str, Any], config: PipelineConfig) -> TrainingArguments:
        from transformers import TrainingArguments

        return TrainingArguments(**common)

    def trainer(self, model: Model, settings: dict[str, Any], model_config: ModelConfig, tokenizer: Tokenizer,
                seed: int) -> Trainer:
        from transformers import Trainer

        return Trainer(model=model, **settings)

    # --- evaluate ------------------------------------------------------------------------------------------

    def primary(self, configured: str | None, rows: list[dict[str, Any]]) -> tuple[str, str]:
        """The metric that decides between models, and why it was chosen."""
        if configured:
            return configured, "set by evaluate.primary_metric"
        return self.default_primary(rows)

    def default_primary(self, rows: list[dict[str, Any]]) -> tuple[str, str]:
        raise NotImplementedError

    def reference(self, start: Model, config: PipelineConfig) -> Any:
        """What scoring measures a model against, from the starting model (measured_against_start); its own type."""
        return None

    def score(self, model: Model, tokenizer: Tokenizer, rows: list[dict[str, Any]], context: ScoringContext) -> Scored:
        """Every metric, per example, for one model on these rows, and what it answered."""
        raise NotImplementedError

    # --- register ------------------------------------------------------------------------------------------

    def loggable(self, model: Model, tokenizer: Tokenizer) -> dict[str, Model | Tokenizer] | Pipeline:
        """What MLflow's transformers flavor logs: the components, or a pipeline built here."""
        return {"model": model, "tokenizer": tokenizer}

    def flavor_settings(self, max_new_tokens: int) -> dict[str, Any]:
        """What MLflow's transformers flavor is told: its task, the settings its pipeline runs with (evaluation's)."""
        return {"task": self.task}

    def request_example(self) -> dict[str, Any]:
        """A request row as `llmops predict` reads it: the example of a pyfunc version's signature."""
        return {"text": "The bridge over the river opened on 3 May 1990."}

    def serving_body(self) -> dict[str, Any]:
        """A body `mlflow models serve` answers for a version of this objective (registry/flavors.py): rows as
        `llmops predict` reads them for a pyfunc of this project, texts for a transformers pipeline."""
        example = self.request_example()
        return {"inputs": [example if not self.pipeline_served else example["text"]]}

    def usage(self) -> str:
        """Python lines that load and use the version (after `import mlflow` and `uri = "models:/..."`)."""
        if not self.pipeline_served:
            return ("model = mlflow.pyfunc.load_model(uri)  # a list of rows as `llmops predict` reads them\n"
                    f"print(model.predict([{self.request_example()!r}]))")
        return ('parts = mlflow.transformers.load_model(uri, return_type="components")\n'
                'model, tokenizer = parts["model"], parts["tokenizer"]')

    def limitations(self, config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
        """What the card says this model cannot be trusted with, given its trained metrics."""
        return []

    # --- predict -------------------------------------------------------------------------------------------

    def request(self, line: int, row: dict[str, Any], served: Served) -> Request:
        """A prediction row as a request, or RowError saying what is wrong with it."""
        raise NotImplementedError

    def answer(self, served: Served, requests: list[Request]) -> list[dict[str, Any]]:
        """One answer per request, in order."""
        raise NotImplementedError

    def limits(self, served: Served) -> str:
        return f"texts cut at {served.encoding.max_length} tokens"


def string_field(row: dict[str, Any], name: str, required: bool = True) -> str | None:
    """A prediction row's text field, or RowError saying why it is not one."""
    value = row.get(name)
    if value is None and not required:
        return None
    if value is None:
        raise RowError(f"{name}: missing (expected a string)")
    if not isinstance(value, str):
        raise RowError(f"{name}: expected a string, got {type(value).__name__}")
    if required and not value.strip():
        raise RowError(f"{name}: empty or only whitespace")
    return value


Responder = Callable[[Served, list[Request]], list[dict[str, Any]]]


def answered_by_ask(served: Served, requests: list[Request], responders: dict[str, Responder]) -> list[dict[str, Any]]:
    """Answers in request order, each kind of ask answered in one batch by its responder."""
    answers: list[dict[str, Any]] = [{} for _ in requests]
    for ask, respond in responders.items():
        positions = [index for index, request in enumerate(requests) if request.ask == ask]
        if positions:
            for index, result in zip(positions, respond(served, [requests[i] for i in positions]), strict=True):
                answers[index] = result
    return answers


def padded(rows: list[list[int]], value: int) -> torch.Tensor:
    """Rows of ids as one right-padded tensor."""
    import torch

    width = max(len(row) for row in rows)
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])


def generation_limitations(config: PipelineConfig, metrics: dict[str, float]) -> list[str]:
    """What a card says of generated answers: how many were cut short, and what exact match does not count."""
    notes = []
    if metrics.get("truncation_rate", 0.0) > 0:
        notes.append(f"{metrics['truncation_rate']:.0%} of its generations were cut at evaluate.max_new_tokens "
                     f"{config.evaluate.max_new_tokens}.")
    notes.append("Exact match counts only verbatim answers; ROUGE-L and chrF reward overlap, not correctness.")
    return notes
