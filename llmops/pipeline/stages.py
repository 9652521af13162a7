"""The stage table: the single source of the pipeline's wiring.

Each stage names its function, the config fields it reads, the stages whose records it takes (in
the order its function takes them), and how its artifact is made and kept. The flow, `llmops stage
NAME`, `llmops plan`, each stage's key and dvc.yaml all derive from this table; functions are named
by import path, so reading the table imports no stage.

A stage function is `build(config, *upstream records, context) -> Figures`: it writes its artifact
into `context.folder` and returns its figures, of the type the table names (`returns`). The runner
(pipeline/runner.py) computes its key, finds or builds the artifact, and makes the record; a stage
knows nothing of keys, stores or registries, and gets from the runner only what its context holds.
What the runner calls in the layers above its own is named here by import path too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from llmops.io.errors import UserError

if TYPE_CHECKING:
    from llmops.tracking.cost import CostFigures
    from llmops.tracking.log import RunHandle

# a read of "" is a read of the whole config
WHOLE_CONFIG = ""


@dataclass(frozen=True)
class StageContext:
    """What the runner hands a stage besides the config and its upstream records: the one way in."""

    # where the stage writes its artifact (a private folder, renamed into place once complete); None for a stage
    # without an artifact
    folder: Path | None = None
    # the stage's key: it names a resumable training in the checkpoint store
    key: str = ""
    # the pipeline's MLflow run, for the live figures of a training and for registering
    run: RunHandle | None = None
    # what the run's stages so far cost, for the stage that records it on the registered version
    cost: CostFigures | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    # "module:function"; see the module docstring for its signature
    function: str
    # "module:Class" of what the function returns: its figures (a StageRecord of them is the record), or the
    # record itself for a stage without an artifact
    returns: str
    # dotted config paths; a section name covers every field in it
    reads: tuple[str, ...]
    # fields inside `reads` that the stage uses but that do not shape its artifact (where machines meet, where
    # copies go, how often to retry): left out of its key
    unkeyed: tuple[str, ...] = ()
    upstream: tuple[str, ...] = ()
    # the selected objective's code that shapes the artifact: its record kind's module (the data stages), the
    # objective's own module, or none
    objective_code: Literal["kind", "objective"] | None = None
    # "module:function" of (config, root) -> fingerprints of the files outside the workspace it reads
    inputs: str | None = None
    # the config fields that name those files (a list of sources stands for each source's path)
    input_fields: tuple[str, ...] = ()
    # "module:function" of a file's relative path -> whether it is content (its hash is the artifact's hash);
    # none: every file is
    content: str | None = None
    # a failed build keeps its folder to resume from (training)
    resumable: bool = False
    # stage artifacts worth a look in the tracking UI, logged under the folder named here
    logged_files: tuple[str, ...] = ()
    logged_folder: str = "data"
    # JSONL artifacts also logged as tables (the tracking UI shows them as such), under the same folder
    logged_tables: tuple[str, ...] = ()
    # tables (splits) logged as the run's datasets (MLflow's inputs), each with its MLflow context
    logged_datasets: tuple[tuple[str, str], ...] = ()
    # a check on the record that may stop the run, reading fields that do not shape the artifact
    gate: str | None = None
    gate_reads: tuple[str, ...] = ()
    retries: int = 0
    # a config field that sets the retries instead (a retried training resumes from its last checkpoint)
    retries_field: str | None = None
    # the config field naming a Prefect work pool whose worker runs the stage (unset: the flow's own process);
    # a placement field, so it is never in `reads`
    pool_field: str | None = None
    # the config field of the seconds a worker of that pool has to take the stage and start it (placement too)
    pool_wait_field: str | None = None
    # "module:function" of the config -> the Compute (devices and their name) the stage holds while it
    # builds, what its build is costed at; none: one device, the CPU
    holds: str | None = None
    # "module:function" of the config -> this machine's node rank in a build several machines take part in, each
    # started by its own launcher (0: it leads; above 0 it builds alongside, without the key's lock); none: 0
    follower: str | None = None
    # whether the stage writes a content-addressed artifact (register writes to the registry instead)
    artifact: bool = True
    # "module:function" of (config, the records of the run so far, the run) -> what they cost, handed to a stage
    # without an artifact that records it (and logged on the run); none: the stage is not given the cost
    cost: str | None = None
    libraries: tuple[str, ...] = field(default=())

    @property
    def module(self) -> str:
        return self.function.partition(":")[0]


# what the runner calls in the layers above it, named like the stage functions so that the table and the runner
# import none of them: a registered starting model (models:/) as a local folder, for a stage that reads the model
RESOLVE_BASE = "llmops.registry.bases:resolved"
# (data config, "kind" or "objective") -> the selected objective's modules whose code shapes a stage's artifact
OBJECTIVE_CODE = "llmops.objectives.registry:code_modules"
# (command, root, scheduled) -> the tags saying where a run came from (git state, user, entry point)
SOURCE_TAGS = "llmops.data.lineage:source_tags"
# (config, folder, splits, key, root) -> a stage's splits as the run's MLflow datasets
SPLIT_DATASETS = "llmops.data.lineage:split_datasets"

# the fields that select the objective: every stage whose code is the objective's reads them
OBJECTIVE = ("data.kind", "data.objective")

STAGES: tuple[Stage, ...] = (
    Stage("ingest", "llmops.data.ingest:ingest", "llmops.data.ingest:IngestFigures",
          reads=(*OBJECTIVE, "data.sources", "data.eval_sources", "data.max_record_bytes"), objective_code="kind",
          inputs="llmops.data.ingest:input_fingerprints", input_fields=("data.sources", "data.eval_sources"),
          retries=2),
    Stage("validate", "llmops.data.validate:validate", "llmops.data.validate:ValidateFigures",
          reads=(*OBJECTIVE, "data.labels", "validate.min_chars", "validate.max_chars", "validate.chunk_rows"),
          upstream=("ingest",), objective_code="kind", logged_files=("quarantine.jsonl",),
          logged_tables=("quarantine.jsonl",), gate="llmops.data.validate:check_bad_fraction",
          gate_reads=("validate.max_bad_fraction",), libraries=("great-expectations", "pandas", "pyarrow")),
    Stage("dedup", "llmops.data.dedup:dedup", "llmops.data.dedup:DedupFigures",
          reads=("dedup", *OBJECTIVE, "data.eval_sources", "data.eval_fraction", "data.split_salt"),
          upstream=("validate",), objective_code="kind", content="llmops.data.dedup:split_files",
          logged_files=("clusters.jsonl", "contaminated.jsonl"),
          logged_datasets=(("train", "training"), ("eval", "evaluation")), libraries=("rensa", "pyarrow")),
    Stage("tokenize", "llmops.data.tokenize:tokenize", "llmops.data.tokenize:TokenizeFigures",
          reads=("tokenize", *OBJECTIVE, "data.labels", "model.name_or_path", "model.revision",
                 "model.trust_remote_code"),
          upstream=("dedup",), objective_code="objective", inputs="llmops.data.tokenize:input_fingerprints",
          input_fields=("tokenize.tokenizer", "model.name_or_path", "tokenize.chat_template"),
          content="llmops.data.tokenize:token_data", libraries=("tokenizers", "transformers", "datasets", "pyarrow")),
    Stage("report", "llmops.data.report:describe", "llmops.data.report:ReportFigures",
          reads=(*OBJECTIVE, "data.license", "data.sources", "data.eval_sources", "tokenize.max_length",
                 "train.batch_size"),
          upstream=("ingest", "validate", "dedup", "tokenize"), objective_code="kind",
          content="llmops.data.report:not_the_plot",
          logged_files=("dataset_card.md", "report.json", "token_lengths.png", "inputs_profile.json"),
          libraries=("matplotlib",)),
    # the unkeyed fields say where and how robustly training runs, not what it makes; the objectives' own sections
    # shape the model (a section the objective does not read holds its defaults: objectives/config.py)
    Stage("train", "llmops.training.train:train", "llmops.training.session:TrainFigures",
          reads=("train", "preference", "grpo", "model", *OBJECTIVE, "data.labels", "launch.rendezvous", "launch.ray",
                 "launch.retries"),
          unkeyed=("train.checkpoint_dir", "launch.rendezvous", "launch.ray", "launch.retries"),
          retries_field="launch.retries", upstream=("tokenize",), objective_code="objective",
          inputs="llmops.training.train:input_fingerprints", input_fields=("model.name_or_path",),
          content="llmops.training.train:model_files", resumable=True, pool_field="launch.work_pool",
          pool_wait_field="launch.work_pool_wait",
          holds="llmops.training.launch:devices_held", follower="llmops.training.launch:follower_rank",
          libraries=("torch", "transformers", "trl", "peft", "accelerate", "datasets")),
    Stage("evaluate", "llmops.evaluation.evaluate:evaluate", "llmops.evaluation.evaluate:EvaluateFigures",
          reads=("evaluate", "model", "train.seed", "preference.beta", *OBJECTIVE, "data.labels",
                 "tokenize.stride"),
          upstream=("train", "tokenize", "dedup"), objective_code="objective",
          inputs="llmops.evaluation.benchmarks:input_fingerprints", input_fields=("evaluate.benchmark_paths",),
          logged_files=("metrics.json", "samples.jsonl", "heldout.jsonl", "benchmarks.json"),
          logged_folder="evaluation", logged_tables=("samples.jsonl",),
          libraries=("torch", "transformers", "peft", "sacrebleu", "numpy")),
    # the registered version carries the resolved config's hash, so every field shapes it (placement aside)
    Stage("register", "llmops.registry.register:register", "llmops.registry.register:Registration",
          reads=(WHOLE_CONFIG,),
          upstream=("ingest", "train", "evaluate", "report"), retries=2, artifact=False,
          cost="llmops.registry.accounting:logged_run_cost", libraries=("mlflow",)),
)

BY_NAME = {stage.name: stage for stage in STAGES}
NAMES = tuple(BY_NAME)


class UnknownStageError(UserError, KeyError):
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
