"""Tokenize: fast batched tokenization into a cached, content-addressed dataset.

Instruction and chat records are rendered with the tokenizer's chat template (or the configured
one); labels are -100 everywhere except the assistant tokens, end-of-turn marker included. Plain
text gets the end-of-sequence token appended and is trained on in full (for masked LM it is framed
by the tokenizer's special tokens, and labels mark the tokens that may be hidden: llmops/objectives/masked_lm.py).
Classification records become token ids and a label index. The cache key covers the data hash, the tokenizer files'
hash, the chat template, max length, record kind and label set, and this code: an unchanged run
never re-tokenizes, and any of those changes always does.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llmops.core import keys, workspace
from llmops.core.config import DataConfig, PipelineConfig, RecordKind
from llmops.core.workspace import Figures, StageRecord
from llmops.data import dedup
from llmops.data.dedup import DedupRecord, EmptySplitError
from llmops.models import modeling
from llmops.objectives import dpo, masked_lm, seq2seq, token_classification
from llmops.registry import registered_base
from llmops.text import templates

log = logging.getLogger("llmops.tokenize")

IGNORE_INDEX = -100
SPECIAL_TOKENS = ("<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>")
BATCH_ROWS = 1000


class SplitFigures(Figures):
    rows: int
    tokens: int
    # tokens that carry a training target (responses, or every token of plain text; 1 per classified row)
    target_tokens: int
    truncated: int
    truncation_rate: float
    dropped_no_target: int
    max_length: int


class TokenizeFigures(Figures):
    vocab_size: int
    tokenizer_source: str
    max_length: int
    train: SplitFigures
    eval: SplitFigures


TokenizeRecord = StageRecord[TokenizeFigures]


def tokenize(config: PipelineConfig, deduped: DedupRecord) -> TokenizeRecord:
    root = workspace.project_root()
    settings, data = config.tokenize, config.data
    source = tokenizer_source(config)
    template = read_template(settings.chat_template, root)
    pretrained = load_pretrained_tokenizer(config) if source else None
    if pretrained is not None and data.objective == "masked_lm":
        masked_lm.check_tokenizer(pretrained, source)
    key = keys.stage_key("tokenize", config, {"dedup": deduped.key}, fingerprint(pretrained, template))

    def build(folder: Path) -> TokenizeFigures:
        tokenizer = pretrained or train_tokenizer(deduped.dir / "train.jsonl", data.kind, settings.vocab_size,
                                                  data.objective)
        prepare_tokenizer(tokenizer, template, trained_here=pretrained is None)
        tokenizer.save_pretrained(folder / "tokenizer")
        encoder = Encoder(tokenizer, data, settings.max_length)
        splits = {split: encode_split(encoder, deduped.dir / f"{split}.jsonl", folder / split, split)
                  for split in ("train", "eval")}
        for split, figures in splits.items():
            if figures.rows == 0:
                raise EmptySplitError(f"the {split} split has no rows with target tokens (a response, a tagged word, "
                                      f"an answer) left after truncating at tokenize.max_length="
                                      f"{settings.max_length}: raise it")
        return TokenizeFigures(vocab_size=len(tokenizer), tokenizer_source=source or "trained-here",
                               max_length=settings.max_length, **splits)

    return workspace.build_artifact(TokenizeRecord, "tokenize", key, build, [deduped], content=token_data)


def tokenizer_source(config: PipelineConfig) -> str | None:
    """The configured tokenizer, else the base model's own (a registered base's exported folder)."""
    return config.tokenize.tokenizer or registered_base.local_name(config.model.name_or_path, config.tracking)


def fingerprint(pretrained: Any, template: str | None) -> dict[str, Any]:
    return {"tokenizer": tokenizer_hash(pretrained) if pretrained is not None else "trained-here",
            "template": template}


def input_fingerprints(config: PipelineConfig, root: Path) -> dict[str, Any]:
    """What tokenize reads besides its config: a pretrained tokenizer's files and a template file."""
    pretrained = load_pretrained_tokenizer(config) if tokenizer_source(config) else None
    return fingerprint(pretrained, read_template(config.tokenize.chat_template, root))


def read_template(value: str | None, root: Path) -> str | None:
    """A template given inline, or as the path of a Jinja file."""
    if value is None:
        return None
    candidate = Path(value) if Path(value).is_absolute() else root / value
    if value.endswith((".jinja", ".j2")) or ("\n" not in value and candidate.is_file()):
        if not candidate.is_file():
            raise FileNotFoundError(f"tokenize.chat_template: template file not found: {candidate}")
        return candidate.read_text(encoding="utf-8")
    return value


def load_pretrained_tokenizer(config: PipelineConfig) -> Any:
    """The configured tokenizer, or the pretrained model's own (at its pinned revision)."""
    from transformers import AutoTokenizer

    own = config.tokenize.tokenizer is None
    with modeling.remote_code_refused(tokenizer_source(config)):
        return AutoTokenizer.from_pretrained(tokenizer_source(config),
                                             trust_remote_code=config.model.trust_remote_code,
                                             revision=config.model.revision if own else None)


def tokenizer_hash(tokenizer: Any) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return workspace.hash_tree(Path(tmp))


def training_texts(path: Path, kind: RecordKind) -> Iterator[str]:
    for row in workspace.read_jsonl(path):
        if kind == "tokens":  # the words only: tags are not text the model reads
            yield token_classification.tokenizer_text(row)
            continue
        yield dedup.record_text(row, kind).replace(dedup.FIELD_SEPARATOR, "\n")


def train_tokenizer(train_file: Path, kind: RecordKind, vocab_size: int, objective: str = "causal_lm") -> Any:
    """A byte-level BPE tokenizer trained on the training split; digits stay single tokens."""
    from transformers import PreTrainedTokenizerFast

    if objective == "masked_lm":
        return masked_lm.train_tokenizer(train_file, vocab_size)
    core = train_core(train_file, kind, vocab_size, list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|end|>")


def train_core(train_file: Path, kind: RecordKind, vocab_size: int, special_tokens: list[Any]) -> Any:
    """The byte-level BPE model itself (a `tokenizers.Tokenizer`), with these special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(training_texts(train_file, kind), trainer)
    return core


def prepare_tokenizer(tokenizer: Any, template: str | None, trained_here: bool) -> None:
    if template is not None:
        tokenizer.chat_template = template
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = templates.SCRATCH_TEMPLATE if trained_here else templates.PLAIN_TEMPLATE
    if tokenizer.pad_token is None:
        # padding positions never carry loss, so reusing EOS as padding is safe
        tokenizer.pad_token = tokenizer.eos_token


class Encoder:
    """Rows of one kind to token ids and labels, in batches."""

    def __init__(self, tokenizer: Any, data: DataConfig, max_length: int) -> None:
        self.tokenizer, self.kind, self.max_length = tokenizer, data.kind, max_length
        self.objective = data.objective
        self.label_ids = {label: index for index, label in enumerate(data.labels)}
        self.render = templates.ShapeRenderer(tokenizer)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
        if self.objective == "masked_lm":
            return masked_lm.encode(self.tokenizer, rows, self.max_length)
        if self.kind == "text":
            return self.texts(rows)
        if self.kind == "classification":
            return self.classes(rows)
        if self.kind == "tokens":
            return token_classification.encode_rows(self.tokenizer, rows, self.label_ids, self.max_length)
        if self.kind == "preference":
            return dpo.encode(self.tokenizer, self.render, rows, self.max_length)
        if self.kind == "seq2seq":
            return seq2seq.encode(self.tokenizer, rows, self.max_length)
        return self.conversations(rows)

    def texts(self, rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
        encoded = self.tokenizer([row["text"] for row in rows], add_special_tokens=True)["input_ids"]
        ids = [seq + [self.tokenizer.eos_token_id] for seq in encoded]
        return self.truncated(ids, [list(seq) for seq in ids])

    def classes(self, rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
        ids = self.tokenizer([row["text"] for row in rows], add_special_tokens=True)["input_ids"]
        batch = self.truncated(ids, [[] for _ in ids])
        batch["labels"] = [self.label_ids[str(row["label"])] for row in rows]
        batch["has_target"] = [True] * len(rows)
        return batch

    def conversations(self, rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
        rendered = [self.render(templates.conversation(row, self.kind)) for row in rows]
        # the Rust tokenizer itself: its encodings answer char -> token lookups without Python-side offsets
        encodings = self.tokenizer.backend_tokenizer.encode_batch([text for text, _ in rendered],
                                                                  add_special_tokens=False)
        ids = [encoding.ids for encoding in encodings]
        labels = [response_labels(encoding, tokens, spans)
                  for encoding, tokens, (_, spans) in zip(encodings, ids, rendered, strict=True)]
        return self.truncated(ids, labels)

    def truncated(self, ids: list[list[int]], labels: list[list[int]]) -> dict[str, list[Any]]:
        limit = self.max_length
        cut_labels = [seq if len(seq) <= limit else seq[:limit] for seq in labels]
        return {"input_ids": [seq if len(seq) <= limit else seq[:limit] for seq in ids], "labels": cut_labels,
                "raw_length": [len(seq) for seq in ids], "length": [min(len(seq), limit) for seq in ids],
                "has_target": [seq.count(IGNORE_INDEX) < len(seq) for seq in cut_labels]}


def response_labels(encoding: Any, ids: list[int], spans: list[templates.Span]) -> list[int]:
    """Token ids of the tokens that start inside an assistant span; -100 for every other token."""
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        first, last = first_token_from(encoding, start, end), last_token_before(encoding, start, end)
        if first is not None and last is not None and first <= last:
            labels[first:last + 1] = ids[first:last + 1]
    return labels


def first_token_from(encoding: Any, start: int, end: int) -> int | None:
    """The first token that starts at or after `start` (a token straddling `start` belongs to the prompt)."""
    for position in range(start, end):
        index = encoding.char_to_token(position)
        if index is not None:
            return index if encoding.offsets[index][0] >= start else index + 1
    return None


def last_token_before(encoding: Any, start: int, end: int) -> int | None:
    """The last token that starts before `end`."""
    for position in range(end - 1, start - 1, -1):
        index = encoding.char_to_token(position)
        if index is not None:
            return index
    return None


def batches(path: Path, size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for row in workspace.read_jsonl(path):
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_split(encoder: Encoder, source: Path, target: Path, split: str) -> SplitFigures:
    """Encode a split in batches, streamed into an Arrow file, then saved as a dataset; rows without targets
    are counted, not kept."""
    import pyarrow as pa
    from datasets import Dataset

    tally = {"rows": 0, "dropped": 0, "truncated": 0, "tokens": 0, "target_tokens": 0, "max_length": 0}
    schema = arrow_schema(encoder.kind)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        stream = Path(scratch) / "encoded.arrow"
        with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for rows in batches(source, BATCH_ROWS):
                batch = encoder(rows)
                keep = [count(tally, batch, index, encoder.max_length) for index in range(len(rows))]
                columns = {name: [v for v, k in zip(batch[name], keep, strict=True) if k] for name in schema.names}
                writer.write_batch(pa.record_batch(columns, schema=schema))
        Dataset.from_file(str(stream)).save_to_disk(str(target))
    if tally["dropped"]:
        log.warning("%s: %d rows have no target tokens left after truncation at %d tokens; not trained on",
                    split, tally["dropped"], encoder.max_length)
    return SplitFigures(rows=tally["rows"] - tally["dropped"], tokens=tally["tokens"],
                        target_tokens=tally["target_tokens"], truncated=tally["truncated"],
                        truncation_rate=tally["truncated"] / tally["rows"] if tally["rows"] else 0.0,
                        dropped_no_target=tally["dropped"], max_length=tally["max_length"])


def arrow_schema(kind: RecordKind) -> Any:
    import pyarrow as pa

    if kind == "preference":
        return dpo.arrow_schema()
    label = pa.int64() if kind == "classification" else pa.list_(pa.int32())
    return pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", label), ("raw_length", pa.int32()),
                      ("length", pa.int32())])


def count(tally: dict[str, int], batch: dict[str, list[Any]], index: int, max_length: int) -> bool:
    """Add one encoded row to the split's figures; whether it has targets and is kept."""
    tally["rows"] += 1
    tally["truncated"] += batch["raw_length"][index] > max_length
    if not batch["has_target"][index]:
        tally["dropped"] += 1
        return False
    tally["tokens"] += batch["length"][index]
    tally["max_length"] = max(tally["max_length"], batch["length"][index])
    labels = batch["labels"][index]
    tally["target_tokens"] += 1 if isinstance(labels, int) else len(labels) - labels.count(IGNORE_INDEX)
    return True


def token_data(relative: str) -> bool:
    """The token data and tokenizer files define the content, not the datasets bookkeeping (it holds random ids)."""
    return not relative.endswith(".json") or relative.startswith("tokenizer/")
