"""The pipeline's one config model, section by section; reading YAML files and overrides into it is
config/files.py."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from llmops.config.engine import EngineConfig
from llmops.config.evaluation import EvaluateConfig, RegisterConfig
from llmops.config.grpo import GrpoConfig
from llmops.config.monitor import MonitorConfig
from llmops.config.nonfinite import NonfiniteConfig
from llmops.config.preference import PreferenceConfig
from llmops.config.scale import LaunchConfig
from llmops.config.section import Section
from llmops.config.speed import SpeedConfig

SourceFormat = Literal["auto", "jsonl", "json", "csv", "tsv", "parquet", "text", "text-files", "arrow", "hub"]


class SourceConfig(Section):
    """One data source: files (`path`), or a dataset loaded by `datasets.load_dataset` (`name`)."""

    # a file, a folder of data files, a glob, or a folder written by datasets' save_to_disk
    path: str | None = Field(None, min_length=1)
    # a hub id or a local dataset folder for load_dataset (read streaming; nothing is cached)
    name: str | None = Field(None, min_length=1)
    subset: str | None = None
    split: str = "train"
    # a hub dataset's commit or tag; without one, a hub dataset is read once and reused until this changes
    revision: str | None = None
    format: SourceFormat = "auto"
    # a JSON file that is one object ({"version": ..., "data": [...]}): the top-level key whose array holds the
    # records, as datasets' json `field`
    field: str | None = None
    # CSV/TSV: whether a field may be quoted, as CSV writers quote a field holding a delimiter, a quote or a line
    # end; auto: yes for CSV, no for TSV, whose fields hold no tab or line end and whose quotes are text
    # (tab-separated values as IANA registers them, and as most corpora ship: a sentence may start with a quote)
    quoting: Literal["auto", "csv", "none"] = "auto"
    # CSV/TSV: the one character between fields (default: "," for CSV, a tab for TSV; ";" for many spreadsheets)
    delimiter: str | None = Field(None, min_length=1, max_length=1)
    # canonical field -> column name in this source, e.g. {output: response, messages: conversations}; the fields
    # are the record kind's (objectives/ checks them)
    columns: dict[str, str] = Field(default_factory=dict)
    # how often each training row of this source is seen: 2.0 doubles it, 0.5 keeps a (fixed) half; at most
    # 1000, since the train split holds every copy
    weight: float = Field(1.0, gt=0, le=1000)

    @field_validator("delimiter")
    @classmethod
    def usable_delimiter(cls, delimiter: str | None) -> str | None:
        if delimiter is not None and delimiter in '"\r\n\x00':
            raise ValueError(f"{delimiter!r} cannot separate fields: a quote or a line end means something else in "
                             "CSV, and a NUL is no text")
        return delimiter

    @model_validator(mode="after")
    def one_location(self) -> SourceConfig:
        if (self.path is None) == (self.name is None):
            raise ValueError("a source needs exactly one of path (files) or name (load_dataset)")
        if self.field is not None and (self.path is None or self.format not in ("auto", "json")):
            raise ValueError("field is the key of a JSON file's array of records: it needs a path and format json "
                             "(or auto)")
        return self


# what describes a source at the top of `data` when it has just one
SHORTHAND = ("path", "format", "field", "quoting", "delimiter", "columns")


class DataConfig(Section):
    # the shape of a record (text, instruction, chat, classification, tokens, seq2seq, preference, ...): the record
    # kinds are the objectives' (objectives/registry.py)
    kind: str = Field("instruction", min_length=1)
    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig(path="data/instructions.jsonl")],
                                        min_length=1)
    # held-out sources; without them a salted hash of each row's content picks the eval split
    eval_sources: list[SourceConfig] = Field(default_factory=list)
    eval_fraction: float = Field(0.05, gt=0, lt=1)
    # salt of the hash split: the same row always lands in the same split, whatever else changes
    split_salt: str = "llmops"
    # what the model learns from the records: an objective's name (objectives/registry.py) or module:Class of your
    # own; None: the record kind's own (resolved when the config is loaded: causal_lm for text, sft for instruction)
    objective: str | None = None
    # the label set, for kind classification; the tag set (e.g. O, B-PER, I-PER), for kind tokens
    labels: list[str] = Field(default_factory=list)
    # a longer record is quarantined without being parsed
    max_record_bytes: int = Field(1_000_000, ge=1)
    license: str = "unknown"

    @field_validator("labels", mode="before")
    @classmethod
    def integer_labels_as_text(cls, raw: Any) -> Any:
        """`labels: [0, 1]` names the labels "0" and "1", as a row's integer label reads (YAML writes them bare)."""
        if isinstance(raw, list):
            return [str(label) if isinstance(label, int) and not isinstance(label, bool) else label for label in raw]
        return raw

    @field_validator("labels")
    @classmethod
    def distinct_labels(cls, labels: list[str]) -> list[str]:
        """A label given twice would take two class ids (two outputs of the head for one class); an empty one
        names nothing a row could hold."""
        repeated = [label for label, count in Counter(labels).items() if count > 1]
        if repeated:
            raise ValueError(f"each label once: {', '.join(map(repr, repeated))} appears more than once")
        if "" in labels:
            raise ValueError("a label is empty")
        return labels

    @field_validator("eval_sources")
    @classmethod
    def unweighted_eval_sources(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        """A held-out source is read once, as it is: a weight would change nothing, and saying so beats ignoring
        it."""
        weighted = [index for index, source in enumerate(sources) if source.weight != 1.0]
        if weighted:
            index = weighted[0]
            raise ValueError(f"source {index} has weight {sources[index].weight:g}: a weight applies to training "
                             "sources (how often their rows are seen); a held-out source is read once as it is")
        return sources

    @model_validator(mode="before")
    @classmethod
    def single_source_shorthand(cls, raw: Any) -> Any:
        """The SHORTHAND keys (`path`, `format`, ...) at the top of `data` describe its one source; set to null
        (`data.path=null` on the command line, beside `data.sources=[...]`), they are not there."""
        if isinstance(raw, dict):
            raw = {key: value for key, value in raw.items() if key not in SHORTHAND or value is not None}
        if not isinstance(raw, dict) or not set(SHORTHAND) & set(raw):
            return raw
        if "sources" in raw:
            raise ValueError("data.path (one source) and data.sources (a list) are both set; keep one")
        raw = dict(raw)
        source = {key: raw.pop(key) for key in SHORTHAND if key in raw}
        return {**raw, "sources": [source]}


class ValidateConfig(Section):
    max_bad_fraction: float = Field(0.05, ge=0, le=1)
    min_chars: int = Field(1, ge=1)
    max_chars: int = Field(20_000, ge=1)
    chunk_rows: int = Field(50_000, ge=1)

    @model_validator(mode="after")
    def chars_in_order(self) -> ValidateConfig:
        if self.min_chars > self.max_chars:
            raise ValueError(f"min_chars ({self.min_chars}) is over max_chars ({self.max_chars}): every row would be "
                             "quarantined")
        return self


class DedupConfig(Section):
    # exact duplicates: same text after NFKC and whitespace folding (and case folding, if set)
    casefold: bool = False
    # near duplicates: MinHash-LSH over word shingles, confirmed on estimated Jaccard similarity
    near_duplicates: bool = True
    threshold: float = Field(0.7, gt=0, lt=1)
    # each row's signature holds num_perm 32-bit values (past a few hundred, estimates gain little and memory grows)
    num_perm: int = Field(128, ge=16, le=1024)
    shingle_size: int = Field(2, ge=1)
    # shorter records get only the exact check: a few shingles, mostly shared template, say little
    min_words: int = Field(20, ge=1)
    seed: int = 1


class TokenizeConfig(Section):
    # path or hub id; None: the pretrained model's own, or a BPE tokenizer trained on the data
    tokenizer: str | None = None
    vocab_size: int = Field(1024, ge=300)
    max_length: int = Field(256, ge=8)
    # a Jinja template, or the path of a .jinja file; None: the tokenizer's own or a built-in default
    chat_template: str | None = None
    # objectives that read an input longer than max_length in windows (question answering): the tokens each window
    # shares with the one before
    stride: int = Field(64, ge=0)


class LoraConfig(Section):
    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.05, ge=0, lt=1)
    # module names, or "all-linear"
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    # save the base model with the adapter merged in, instead of the adapter alone
    merge: bool = False


class ModelConfig(Section):
    # path or hub id for from_pretrained; None: build `architecture` from this config with random init
    name_or_path: str | None = None
    # a hub model's commit or tag: pins what `name_or_path` names
    revision: str | None = None
    # decoders (llama, gpt2), encoders (bert, roberta: masked LM, token classification), encoder-decoder (t5)
    architecture: Literal["llama", "gpt2", "bert", "roberta", "t5"] = "llama"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    # grouped-query attention (llama): key/value heads; None: as many as num_heads
    num_kv_heads: int | None = Field(None, ge=1)
    intermediate_size: int | None = None
    # attention kernel; auto: a varlen kernel (FlashAttention 4/3/2) on a GPU that has one installed, else
    # flex_attention on CUDA, sdpa on CPU
    attention: Literal["auto", "eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                       "flash_attention_4"] = "auto"
    trust_remote_code: bool = False
    # full fine-tuning, or a LoRA adapter (qlora: on a 4-bit base, CUDA only)
    adapter: Literal["none", "lora", "qlora"] = "none"
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @model_validator(mode="after")
    def adapters_need_a_base(self) -> ModelConfig:
        if self.adapter != "none" and not self.name_or_path:
            raise ValueError(f"model.adapter={self.adapter} adapts a pretrained model: set model.name_or_path")
        return self


class TrainConfig(Section):
    epochs: float = Field(3.0, gt=0)
    max_steps: int = -1
    batch_size: int = Field(32, ge=1)
    grad_accum: int = Field(1, ge=1)
    # 0 is allowed: a run that must not learn (a baseline, or a check that the gates notice)
    learning_rate: float = Field(3e-3, ge=0)
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "cosine"
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    # a step whose gradient norm is NaN or infinite: skipped (up to a limit) or the end of the training
    nonfinite: NonfiniteConfig = Field(default_factory=NonfiniteConfig)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    gradient_checkpointing: bool = False
    # several samples per sequence, attention kept inside each (decoders); a model that fails the check that packed
    # samples stay apart stops the training in one line, unless packing_fallback lets it train unpacked
    packing: bool = True
    packing_fallback: bool = False
    # with packing off: batches of similar lengths, less padding
    group_by_length: bool = False
    seed: int = 0
    logging_steps: int = Field(25, ge=1)
    save_steps: int = Field(200, ge=1)
    save_total_limit: int = Field(2, ge=1)
    # evaluate the eval split every N steps (None: only after training)
    eval_steps: int | None = Field(None, ge=1)
    # stop after this many evaluations without a better eval loss (needs eval_steps)
    early_stopping_patience: int | None = Field(None, ge=1)
    # how training is spread over processes; auto: none on CPU or one GPU, ddp on more
    distributed: Literal["auto", "none", "ddp", "fsdp", "deepspeed"] = "auto"
    # processes per machine; auto: one per visible GPU (one on CPU)
    processes: int | Literal["auto"] = "auto"
    # DeepSpeed: the ZeRO stage, and what moves to CPU memory
    zero_stage: Literal[2, 3] = 2
    offload: Literal["none", "optimizer", "optimizer_and_parameters"] = "none"
    # FSDP: shard over every process, or within each machine (replicated across machines)
    fsdp_sharding: Literal["full", "hybrid"] = "full"
    # your own DeepSpeed JSON (distributed: deepspeed) or accelerate YAML (distributed: fsdp), instead of the
    # shipped file the options above choose
    launch_config: str | None = None
    # machines taking part in one training
    nodes: int = Field(1, ge=1)
    # besides the workspace, checkpoints go here as they are written (any fsspec URL, e.g. s3://bucket/path),
    # so that a run on another machine resumes the same training
    checkpoint_dir: str | None = None
    # speed levers: torch.compile, Liger kernels, fused AdamW, a token budget per micro-batch (config/speed.py)
    speed: SpeedConfig = Field(default_factory=SpeedConfig)

    @model_validator(mode="after")
    def early_stopping_needs_evaluation(self) -> TrainConfig:
        if self.early_stopping_patience is not None and self.eval_steps is None:
            raise ValueError("train.early_stopping_patience needs train.eval_steps")
        return self

    @model_validator(mode="after")
    def offload_fits_the_stage(self) -> TrainConfig:
        if self.offload == "optimizer_and_parameters" and self.zero_stage != 3:
            raise ValueError("train.offload=optimizer_and_parameters needs train.zero_stage=3 (ZeRO-2 does not "
                             "shard parameters)")
        if isinstance(self.processes, int) and self.processes < 1:
            raise ValueError("train.processes must be at least 1, or auto")
        return self


class TrackingConfig(Section):
    # None: MLFLOW_TRACKING_URI, else a SQLite store and artifact folder inside the workspace
    tracking_uri: str | None = None
    # None: MLFLOW_REGISTRY_URI, else the tracking URI
    registry_uri: str | None = None
    experiment: str = "llmops"
    # where a local store (SQLite, a folder) keeps run artifacts; None: an `artifacts` folder beside the store.
    # A tracking server keeps them where the server says.
    artifact_location: str | None = None


class WorkspaceConfig(Section):
    # an fsspec URL (s3://bucket/prefix, gs://..., a shared folder) that holds every stage's artifact, so that
    # stages can run on different machines; None: artifacts stay in the local workspace only
    remote: str | None = None
    # how long a machine of a multi-node training waits for the leading machine (node rank 0) to publish the
    # artifact in `remote` once its own part is done: the leader still consolidates and uploads the weights
    leader_wait_minutes: float = Field(30.0, gt=0)


class CostConfig(Section):
    # price of one device for an hour, by device: part of a GPU's name as it reports it ("H100" prices "NVIDIA H100
    # 80GB HBM3"; the longest match wins), and "cpu" for the stages run on the CPU. Empty (the default): no money
    device_hour: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)


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
    # the objectives' own settings, each section set only by a config whose objective reads it (Objective.section):
    # DPO's, ORPO's and KTO's beta (config/preference.py); GRPO's completions per prompt, their length, the KL
    # penalty and the weighted rewards (config/grpo.py), whose default scores exact match against each answer
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    # where and how robustly the train stage runs (work pool, rendezvous, Ray Train workers, retries): no key covers it
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    registry: RegisterConfig = Field(default_factory=RegisterConfig, alias="register")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    workspace: WorkspaceConfig = Field(default_factory=WorkspaceConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    # where the data stages work: local (a process pool) or ray (a Ray cluster); placement
    engine: EngineConfig = Field(default_factory=EngineConfig)

    @model_validator(mode="after")
    def node_rank_among_the_nodes(self) -> PipelineConfig:
        if self.launch.rendezvous.node_rank >= self.train.nodes:
            raise ValueError(f"launch.rendezvous.node_rank={self.launch.rendezvous.node_rank} but train.nodes="
                             f"{self.train.nodes}: the machines' ranks run from 0 to {self.train.nodes - 1}")
        return self

    @model_validator(mode="after")
    def guarded_benchmarks_run(self) -> PipelineConfig:
        missing = [name for name in self.registry.benchmark_guards() if name not in self.evaluate.benchmarks]
        if missing:
            raise ValueError(f"register.guards: {', '.join(missing)} is not in evaluate.benchmarks, so it is never "
                             "scored; add it there")
        return self

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def recipe(self) -> dict[str, Any]:
        """The resolved config without its placement fields: everything that can shape what a run makes."""
        tree = self.as_dict()
        for path in PLACEMENT:
            *parents, last = path.split(".")
            node = tree
            for part in parents:
                node = node[part]
            node.pop(last)
        return tree

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.recipe(), sort_keys=True).encode()).hexdigest()


# where stages run, where artifacts are kept and what compute is priced at: they never shape an artifact or a model,
# so no stage key and no config hash covers them (a model trained on a GPU worker is the model trained in-process)
PLACEMENT = ("workspace", "launch.work_pool", "launch.work_pool_wait", "cost", "engine", "monitor")
# sections an objective owns (Objective.section): a config whose objective does not read one leaves it as it is
OBJECTIVE_SECTIONS = ("preference", "grpo")
# keys that moved to another section: a config that still sets one is told where it went
MOVED = {**{f"train.{name}": f"launch.{name}" for name in ("work_pool", "work_pool_wait", "rendezvous", "ray",
                                                           "retries")},
         "train.preference_beta": "preference.beta", "train.grpo": "grpo"}


def is_placement(path: str) -> bool:
    return any(path == field or path.startswith(field + ".") for field in PLACEMENT)
