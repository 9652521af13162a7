"""The stage table: the single source of the pipeline's wiring.

Each stage names its function, the config fields it reads, the stages whose records it takes
(in the order its function takes them), and the module whose code (with everything it imports
from this project) shapes its artifact. The flow, `llmops stage NAME`, each stage's key and
dvc.yaml all derive from this table; functions are named by import path, so reading the table
imports no stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# a read of "" is a read of the whole config
WHOLE_CONFIG = ""


@dataclass(frozen=True)
class Stage:
    name: str
    # "module:function"; the function takes (config, *upstream records) and returns the stage's record
    function: str
    # dotted config paths; a section name covers every field in it
    reads: tuple[str, ...]
    # fields inside `reads` that the stage uses but that do not shape its artifact (where machines meet, where
    # copies go, how often to retry): left out of its key
    unkeyed: tuple[str, ...] = ()
    upstream: tuple[str, ...] = ()
    # "module:function" of (config, root) -> fingerprints of the files outside the workspace it reads
    inputs: str | None = None
    # the config fields that name those files (a list of sources stands for each source's path)
    input_fields: tuple[str, ...] = ()
    # stage artifacts worth a look in the tracking UI, logged under the folder named here
    logged_files: tuple[str, ...] = ()
    logged_folder: str = "data"
    # JSONL artifacts also logged as tables (the tracking UI shows them as such), under the same folder
    logged_tables: tuple[str, ...] = ()
    # a check on the record that may stop the run, reading fields that do not shape the artifact
    gate: str | None = None
    gate_reads: tuple[str, ...] = ()
    retries: int = 0
    # a config field that sets the retries instead (a retried training resumes from its last checkpoint)
    retries_field: str | None = None
    # the config field naming a Prefect work pool whose worker runs the stage (unset: the flow's own process);
    # a placement field, so it is never in `reads`
    pool_field: str | None = None
    # whether the stage writes a content-addressed artifact (register writes to the registry instead)
    artifact: bool = True
    libraries: tuple[str, ...] = field(default=())

    @property
    def module(self) -> str:
        return self.function.partition(":")[0]


STAGES: tuple[Stage, ...] = (
    Stage("ingest", "llmops.data.ingest:ingest",
          reads=("data.kind", "data.sources", "data.eval_sources", "data.max_record_bytes"),
          inputs="llmops.data.ingest:input_fingerprints", input_fields=("data.sources", "data.eval_sources"),
          retries=2),
    Stage("validate", "llmops.data.validate:validate",
          reads=("data.kind", "data.labels", "validate.min_chars", "validate.max_chars", "validate.chunk_rows"),
          upstream=("ingest",), logged_files=("quarantine.jsonl",), logged_tables=("quarantine.jsonl",),
          gate="llmops.data.validate:check_bad_fraction", gate_reads=("validate.max_bad_fraction",),
          libraries=("great-expectations", "pandas")),
    Stage("dedup", "llmops.data.dedup:dedup",
          reads=("dedup", "data.kind", "data.eval_sources", "data.eval_fraction", "data.split_salt"),
          upstream=("validate",), logged_files=("clusters.jsonl", "contaminated.jsonl"), libraries=("rensa",)),
    Stage("tokenize", "llmops.data.tokenize:tokenize",
          reads=("tokenize", "data.kind", "data.objective", "data.labels", "model.name_or_path", "model.revision",
                 "model.trust_remote_code", "tracking"),
          # a registered base is found through the registry; its content, not where it is kept, is keyed
          unkeyed=("tracking",),
          upstream=("dedup",), inputs="llmops.data.tokenize:input_fingerprints",
          input_fields=("tokenize.tokenizer", "model.name_or_path", "tokenize.chat_template"),
          libraries=("tokenizers", "transformers", "datasets", "pyarrow")),
    Stage("report", "llmops.data.report:describe",
          reads=("data.kind", "data.license", "data.sources", "data.eval_sources", "tokenize.max_length",
                 "train.batch_size"),
          upstream=("ingest", "validate", "dedup", "tokenize"),
          logged_files=("dataset_card.md", "report.json", "token_lengths.png"), libraries=("matplotlib",)),
    # the unkeyed train fields say where and how robustly training runs, not what it makes
    Stage("train", "llmops.training.train:train",
          reads=("train", "model", "data.kind", "data.objective", "data.labels", "tracking"),
          unkeyed=("train.rendezvous", "train.checkpoint_dir", "train.retries", "train.work_pool", "tracking"),
          retries_field="train.retries",
          upstream=("tokenize",), inputs="llmops.training.train:input_fingerprints",
          input_fields=("model.name_or_path",),
          pool_field="train.work_pool",
          libraries=("torch", "transformers", "trl", "peft", "accelerate", "datasets")),
    Stage("evaluate", "llmops.evaluation.evaluate:evaluate",
          reads=("evaluate", "model", "train.seed", "train.preference_beta", "data.kind", "data.objective",
                 "data.labels", "tracking"),
          unkeyed=("tracking",),
          upstream=("train", "tokenize", "dedup"), logged_files=("metrics.json", "samples.jsonl", "heldout.jsonl"),
          logged_folder="evaluation", logged_tables=("samples.jsonl",),
          libraries=("torch", "transformers", "peft", "sacrebleu", "numpy")),
    # the registered version carries the resolved config's hash, so every field shapes it (placement aside)
    Stage("register", "llmops.registry.register:register", reads=(WHOLE_CONFIG,),
          upstream=("ingest", "train", "evaluate", "report"), retries=2, artifact=False,
          libraries=("mlflow",)),
)

BY_NAME = {stage.name: stage for stage in STAGES}
NAMES = tuple(BY_NAME)


class UnknownStageError(KeyError):
    def __str__(self) -> str:
        return f"unknown stage {self.args[0]!r}; expected one of: {', '.join(NAMES)}"


def stage(name: str) -> Stage:
    try:
        return BY_NAME[name]
    except KeyError:
        raise UnknownStageError(name) from None


def downstream(name: str) -> set[str]:
    """Every stage that takes this one's record, directly or through others."""
    found: set[str] = set()
    for candidate in STAGES:
        if name in candidate.upstream or found & set(candidate.upstream):
            found.add(candidate.name)
    return found
