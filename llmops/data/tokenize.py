"""Tokenize: fast batched tokenization into a cached, content-addressed dataset.

The tokenizer is the configured one, the base model's own, or a BPE tokenizer trained here on the
training split (the selected objective says which kind: a masked LM's has a mask token). Each split
is encoded by the objective (objectives/: chat templates and response labels for SFT, a label index
for classification, aligned tags for a tagger, ...) in batches, streamed into an Arrow file. The key
covers the data, the tokenizer files, the chat template, max length, the record kind and label set,
and the code of this stage and of the selected objective: an unchanged run never re-tokenizes, and
any of those changes always does.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from llmops.config.engine import EngineConfig
from llmops.config.schema import PipelineConfig
from llmops.data.dedup import DedupRecord, EmptySplitError
from llmops.data.rows import excerpt
from llmops.io.errors import MissingInputError, UserError
from llmops.io.figures import Figures
from llmops.io.files import project_root
from llmops.io.rejects import Reject
from llmops.io.shards import join_files
from llmops.io.tables import (
    TableShard,
    regrouped,
    shard_rows,
    table_bytes,
    table_index,
    table_rows,
    table_schema,
    table_shards,
)
from llmops.models.modeling import check_positions, pretrained_config, remote_code_refused
from llmops.objectives import selected
from llmops.objectives.base import Encoding, Objective
from llmops.pipeline.engine import Engine
from llmops.pipeline.stages import StageContext
from llmops.store.artifacts import StageRecord
from llmops.text.encoding import IGNORE_INDEX
from llmops.text.templates import require_tools
from llmops.text.tokenizers import prepare_tokenizer, read_template, tokenizer_hash

log = logging.getLogger("llmops.tokenize")

BATCH_ROWS = 1000


class SplitFigures(Figures):
    rows: int
    tokens: int
    # tokens that carry a training target (responses, or every token of plain text; 1 per classified row)
    target_tokens: int
    truncated: int
    # tokens training never sees because of max_length: what truncation cut off, and the whole of a row it left
    # without a target (None in records made before they were counted)
    truncated_tokens: int | None = None
    truncation_rate: float
    dropped_no_target: int
    max_length: int


class TokenizeFigures(Figures):
    vocab_size: int
    tokenizer_source: str
    max_length: int
    train: SplitFigures
    eval: SplitFigures
    # how the work was spread (None in records made before it was): input shards, workers, the peak memory of the
    # largest worker
    shards: int | None = None
    workers: int | None = None
    peak_worker_rss_mb: float | None = None


TokenizeRecord = StageRecord[TokenizeFigures]


def tokenize(config: PipelineConfig, deduped: DedupRecord, context: StageContext) -> TokenizeFigures:
    objective, settings, folder = selected(config.data), config.tokenize, context.folder
    source = tokenizer_source(config)
    tokenizer = load_pretrained_tokenizer(config) if source else objective.train_tokenizer(
        training_texts(table_rows(deduped.dir / "train"), objective), settings.vocab_size)
    if source:
        objective.check_tokenizer(tokenizer, source)
    check_base_positions(config)
    prepare_tokenizer(tokenizer, read_template(settings.chat_template, project_root()), trained_here=not source)
    columns = {name for split in ("train", "eval") for name in table_columns(deduped.dir / split)}
    if columns & set(objective.kind.tool_columns):  # tool data: a template that would drop the tools is refused
        require_tools(tokenizer, template_label(config, source))
    tokenizer.save_pretrained(folder / "tokenizer")
    encoding = Encoding(settings.max_length, tuple(config.data.labels), settings.stride)
    with Engine(config.engine) as engine:
        # every worker encodes with the tokenizer as saved, the one training reads
        splits = {split: encode_split(objective, folder / "tokenizer", encoding, deduped.dir / split,
                                      folder / split, engine, config.engine, f"{context.key}-{split}")
                  for split in ("train", "eval")}
        spread = engine.figures()
    for split, figures in splits.items():
        if figures.rows == 0:
            raise EmptySplitError(f"the {split} split has no rows with target tokens (a response, a tagged word, an "
                                  f"answer) left after truncating at tokenize.max_length={settings.max_length}: "
                                  "raise it")
    return TokenizeFigures(vocab_size=len(tokenizer), tokenizer_source=source or "trained-here",
                           max_length=settings.max_length, **splits, **spread)


def table_columns(folder: Path) -> list[str]:
    """The columns of a table's rows (none for a table without parts)."""
    return list(table_schema(folder).names) if table_index(folder)["parts"] else []


def template_label(config: PipelineConfig, source: str | None) -> str:
    """The chat template in use, as an error names it."""
    configured = config.tokenize.chat_template
    if configured is not None:
        return f"tokenize.chat_template ({configured if chr(10) not in configured else 'inline'})"
    return f"the chat template of tokenizer {source} (or the built-in one it falls back to)" if source else \
        "the built-in template"


def tokenizer_source(config: PipelineConfig) -> str | None:
    """The configured tokenizer, else the base model's own (a registered base is a local folder by now)."""
    return config.tokenize.tokenizer or config.model.name_or_path


def input_fingerprints(config: PipelineConfig, root: Path) -> dict[str, Any]:
    """What tokenize reads besides its config: a pretrained tokenizer's files and a template file."""
    pretrained = load_pretrained_tokenizer(config) if tokenizer_source(config) else None
    return {"tokenizer": tokenizer_hash(pretrained) if pretrained is not None else "trained-here",
            "template": read_template(config.tokenize.chat_template, root)}


def load_pretrained_tokenizer(config: PipelineConfig) -> Any:
    """The configured tokenizer, or the pretrained model's own (at its pinned revision)."""
    from transformers import AutoTokenizer

    own = config.tokenize.tokenizer is None
    source = tokenizer_source(config)
    try:
        with remote_code_refused(source):
            return AutoTokenizer.from_pretrained(source, trust_remote_code=config.model.trust_remote_code,
                                                 revision=config.model.revision if own else None)
    except UserError:
        raise
    except (OSError, ValueError) as err:  # no tokenizer files there, a hub id that does not exist, offline
        field = "model.name_or_path" if own else "tokenize.tokenizer"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MissingInputError(f"{field}: cannot load a tokenizer from {source} ({first[:300]})") from None


def check_base_positions(config: PipelineConfig) -> None:
    """Refuse a max_length the pretrained base cannot read, before anything is encoded at that length (a base whose
    config cannot be read is left to the train stage, which loads it and says why)."""
    if not config.model.name_or_path:
        return
    try:
        base = pretrained_config(config.model)
    except (OSError, ValueError):
        return
    check_positions(base, config.tokenize.max_length, config.model.name_or_path)


def training_texts(rows: Iterable[dict[str, Any]], objective: Objective) -> Iterator[str]:
    """What a tokenizer trained here reads: each training record's text, as its record kind gives it."""
    for row in rows:
        yield objective.kind.tokenizer_text(row)


def batches(rows: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass(frozen=True)
class EncodeJob:
    objective: Objective
    tokenizer: Path
    encoding: Encoding
    # the shard's rows: a run of row groups of the split's table
    rows: TableShard
    # the shard's encoded rows, an Arrow stream
    target: Path


# the input bytes that pay for a worker process: one starts in about 2.5 s (an interpreter importing transformers and
# loading the tokenizer), in which one process encodes about 6 MB of records (bench/tokenize_bench.py, 2 cores)
WORTH_A_WORKER = 8 * 2**20
TALLY = ("rows", "dropped", "truncated", "truncated_tokens", "tokens", "target_tokens", "max_length")
# the code of a row that truncation left without a target, in the split's dropped file
NO_TARGET = "no_target"


def dropped_file(split: Path) -> Path:
    """The rows of a split's encoding that truncation left without a target, one quarantine line each."""
    return split.with_name(f"{split.name}.dropped.jsonl")


def encode_split(objective: Objective, tokenizer: Path, encoding: Encoding, source: Path, target: Path,
                 engine: Engine, settings: EngineConfig, fingerprint: str) -> SplitFigures:
    """Encode a split shard by shard on the engine, join the shards in order into one Arrow stream (in batches of
    BATCH_ROWS encoded rows, whatever the shards), then save it as a dataset; rows without targets are counted, not
    kept. `fingerprint` names the dataset (from the stage key: what the rows are made from)."""
    from datasets import Features

    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        jobs = [EncodeJob(objective, tokenizer, encoding, rows, Path(scratch) / f"part-{shard}.arrow")
                for shard, rows in enumerate(table_shards(source, settings.shard_size(table_bytes(source),
                                                                                      WORTH_A_WORKER)))]
        tallies = engine.map(f"tokenize: {target.name}", encode_shard, jobs, rows=lambda tally: tally["rows"])
        stream = Path(scratch) / "encoded.arrow"
        # the schema as datasets writes it (with its features), so that the stream is a dataset's data file as it is
        join_streams([job.target for job in jobs], Features.from_arrow_schema(objective.arrow_schema()).arrow_schema,
                     stream)
        save_as_dataset(stream, target, fingerprint)
        lost = dropped_file(target)
        join_files([job.target.with_suffix(".dropped") for job in jobs], lost)
    tally = {name: max((t[name] for t in tallies), default=0) if name == "max_length" else
             sum(t[name] for t in tallies) for name in TALLY}
    if tally["dropped"]:
        log.warning("%s: %d rows have no target tokens left after truncation at %d tokens; not trained on: %s",
                    target.name, tally["dropped"], encoding.max_length, lost)
    return SplitFigures(rows=tally["rows"] - tally["dropped"], tokens=tally["tokens"],
                        target_tokens=tally["target_tokens"], truncated=tally["truncated"],
                        truncated_tokens=tally["truncated_tokens"],
                        truncation_rate=tally["truncated"] / tally["rows"] if tally["rows"] else 0.0,
                        dropped_no_target=tally["dropped"], max_length=tally["max_length"])


@functools.cache
def saved_tokenizer(folder: str) -> Any:
    """A worker loads the stage's tokenizer once, however many shards it encodes."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def encode_shard(job: EncodeJob) -> dict[str, int]:
    """One shard's rows encoded in batches into its Arrow stream; its tally."""
    import pyarrow as pa

    tokenizer = saved_tokenizer(str(job.tokenizer))
    tally = dict.fromkeys(TALLY, 0)
    schema = job.objective.arrow_schema()
    rows = (row for _, row in shard_rows(job.rows))
    with pa.OSFile(str(job.target), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer, \
            job.target.with_suffix(".dropped").open("w", encoding="utf-8") as lost:
        for chunk in batches(rows, BATCH_ROWS):
            batch = job.objective.encode(tokenizer, chunk, job.encoding)
            # an objective that reads long inputs in windows gives more encoded rows than records
            keep = [count(tally, batch, index, job.encoding.max_length) for index in range(len(batch["has_target"]))]
            if not all(keep):
                write_dropped(lost, chunk, batch, keep, job.encoding.max_length)
            writer.write_batch(pa.record_batch(kept_columns(batch, keep, schema), schema=schema))
    return tally


def kept_columns(batch: dict[str, list[Any]], keep: list[bool], schema: Any) -> list[Any]:
    """The kept rows' columns as Arrow arrays, column by column (converting a dict of lists as one batch takes about
    twice as long); a column that is another's very list (a causal LM's labels are its ids) is converted once."""
    import pyarrow as pa

    every = all(keep)
    converted: dict[tuple[int, Any], Any] = {}
    for field in schema:
        values = batch[field.name]
        if (id(values), field.type) not in converted:
            kept = values if every else [v for v, k in zip(values, keep, strict=True) if k]
            converted[id(values), field.type] = pa.array(kept, field.type)
    return [converted[id(batch[field.name]), field.type] for field in schema]


def write_dropped(out: IO[str], chunk: list[dict[str, Any]], batch: dict[str, list[Any]], keep: list[bool],
                  max_length: int) -> None:
    """The rows truncation left without a target, as quarantine lines: where each came from, its length, its start.
    (Only an objective that encodes a record as one row drops any: a windowed one keeps a target in every window,
    so a row of this batch is its record.)"""
    for index, kept in enumerate(keep):
        if kept:
            continue
        row = chunk[index] if len(keep) == len(chunk) else {}
        content = json.dumps({key: value for key, value in row.items() if not key.startswith("_")},
                             ensure_ascii=False)
        reject = Reject(NO_TARGET, f"{batch['raw_length'][index]} tokens, and none of its target left within "
                        f"tokenize.max_length={max_length}", excerpt=excerpt(content))
        out.write(json.dumps(reject.entry(row.get("_source"), row.get("_line")), ensure_ascii=False) + "\n")


def save_as_dataset(stream: Path, target: Path, fingerprint: str) -> None:
    """The joined stream as a `datasets` folder, moved in whole: datasets writes the folder (state and features) for
    the first row, and the stream, already in its format, becomes the data file. Saving all of it through datasets
    would copy it through a memory map, which keeps the whole file resident in this process. Its state names
    `fingerprint`, so that two builds of the same rows are the same bytes (datasets' own is random here: it hashes
    the scratch file's path)."""
    from datasets import Dataset

    encoded = Dataset.from_file(str(stream))
    head = encoded.select(range(min(len(encoded), 1)), new_fingerprint=fingerprint)
    head.save_to_disk(str(target))
    if len(encoded) == 0:
        return  # no rows: the folder holds no data file at all
    files = json.loads((target / "state.json").read_text())["_data_files"]
    if len(files) != 1:
        raise RuntimeError(f"datasets saved one row as {len(files)} data files")
    os.replace(stream, target / files[0]["filename"])


def join_streams(parts: list[Path], schema: Any, target: Path) -> None:
    """The shards' rows, in order, re-cut into batches of BATCH_ROWS: the same file however the input was sharded."""
    import pyarrow as pa

    with pa.OSFile(str(target), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in regrouped(stream_batches(parts), schema, BATCH_ROWS):
            writer.write_table(batch)


def stream_batches(parts: list[Path]) -> Iterator[Any]:
    import pyarrow as pa

    for part in parts:
        with pa.memory_map(str(part)) as source:
            yield from pa.ipc.open_stream(source)


def count(tally: dict[str, int], batch: dict[str, list[Any]], index: int, max_length: int) -> bool:
    """Add one encoded row to the split's figures; whether it has targets and is kept."""
    tally["rows"] += 1
    tally["truncated"] += batch["raw_length"][index] > max_length
    if not batch["has_target"][index]:
        tally["dropped"] += 1
        tally["truncated_tokens"] += batch["raw_length"][index]
        return False
    tally["truncated_tokens"] += max(batch["raw_length"][index] - batch["length"][index], 0)
    tally["tokens"] += batch["length"][index]
    tally["max_length"] = max(tally["max_length"], batch["length"][index])
    if "target_tokens" in batch:  # an objective whose labels are not tokens (positions of an answer) counts them
        tally["target_tokens"] += batch["target_tokens"][index]
        return True
    labels = batch["labels"][index]
    tally["target_tokens"] += 1 if isinstance(labels, int) else len(labels) - labels.count(IGNORE_INDEX)
    return True


def token_data(relative: str) -> bool:
    """The token data and tokenizer files define the content, not the datasets bookkeeping (it holds random ids)."""
    return not relative.endswith(".json") or relative.startswith("tokenizer/")
