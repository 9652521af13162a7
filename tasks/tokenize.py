"""Tokenize: fast batched tokenization into a cached, content-addressed dataset.

Instruction records are rendered with the tokenizer's chat template (or the configured one);
labels are -100 everywhere except the response tokens, end-of-turn token included. Plain text
gets the end-of-sequence token appended and is trained on in full. The cache key covers the data
hash, the tokenizer files' hash, the chat template, max length, record kind and this code.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.config import ModelConfig, PipelineConfig, RecordKind, TokenizeConfig
from tasks import tracking, workspace
from tasks.tracking import RunHandle
from tasks.workspace import StageRecord

log = logging.getLogger("llmops.tokenize")

IGNORE_INDEX = -100
SPECIAL_TOKENS = ("<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>")
# for tokenizers trained here: each turn is `<|role|>` newline content `<|end|>` newline
SCRATCH_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# for pretrained tokenizers that ship no template: Alpaca-style headings, the model's own EOS
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n### Response:\n"
    "{% else %}{{ message['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}"
)


def tokenize(config: TokenizeConfig, model: ModelConfig, kind: RecordKind, deduped: StageRecord,
             root: Path) -> StageRecord:
    source = config.tokenizer or model.name_or_path
    template = read_template(config.chat_template, root)
    pretrained = load_pretrained_tokenizer(source, model.trust_remote_code) if source else None
    key = workspace.stage_key(
        "tokenize", config.model_dump(exclude={"tokenizer", "chat_template"}), [deduped],
        workspace.code_version(sys.modules[__name__]), kind=kind, template=template,
        tokenizer=tokenizer_hash(pretrained) if pretrained is not None else "trained-here",
        libraries=library_versions(),
    )

    def build(folder: Path) -> tuple[str, dict[str, Any]]:
        tokenizer = pretrained or train_tokenizer(deduped.dir / "train.jsonl", kind, config.vocab_size)
        prepare_tokenizer(tokenizer, template, trained_here=pretrained is None)
        tokenizer.save_pretrained(folder / "tokenizer")
        stats: dict[str, Any] = {"vocab_size": len(tokenizer), "tokenizer_source": source or "trained-here"}
        for split in ("train", "eval"):
            stats.update(encode_split(tokenizer, kind, config.max_length, deduped.dir / f"{split}.jsonl",
                                      folder / split, split))
        return tokenized_hash(folder), stats

    return workspace.build_artifact("tokenize", key, build)


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


def load_pretrained_tokenizer(source: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)


def tokenizer_hash(tokenizer: Any) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return workspace.hash_tree(Path(tmp))


def library_versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__}


def training_texts(path: Path, kind: RecordKind) -> Any:
    for row in workspace.read_jsonl(path):
        if kind == "text":
            yield row["text"]
        else:
            yield "\n".join(part for part in (row["instruction"], row.get("input"), row["output"]) if part)


def train_tokenizer(train_file: Path, kind: RecordKind, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on the training split; digits stay single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(training_texts(train_file, kind), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|end|>")


def prepare_tokenizer(tokenizer: Any, template: str | None, trained_here: bool) -> None:
    if template is not None:
        tokenizer.chat_template = template
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = SCRATCH_TEMPLATE if trained_here else PLAIN_TEMPLATE
    if tokenizer.pad_token is None:
        # padding positions never carry loss, so reusing EOS as padding is safe
        tokenizer.pad_token = tokenizer.eos_token


def prompt_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    prompt = row["instruction"] if not row.get("input") else f"{row['instruction']}\n\n{row['input']}"
    return [{"role": "user", "content": prompt}]


def render_instruction(tokenizer: Any, row: dict[str, Any]) -> tuple[str, int, int]:
    """The full text, and where the response (end-of-turn token included) starts and ends in it."""
    messages = prompt_messages(row)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": row["output"]}],
                                         tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template renders the prompt differently once a response follows; "
                         "set tokenize.chat_template to a template whose prompt is a prefix of the full turn")
    return full, len(prompt), len(full.rstrip())


def encode_instructions(tokenizer: Any, rows: list[dict[str, Any]]) -> dict[str, list[list[int]]]:
    rendered = [render_instruction(tokenizer, row) for row in rows]
    encoded = tokenizer([text for text, _, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    labels = []
    for ids, offsets, (_, start, end) in zip(encoded["input_ids"], encoded["offset_mapping"], rendered,
                                             strict=True):
        labels.append([tok if start <= s < end else IGNORE_INDEX for tok, (s, _) in zip(ids, offsets, strict=True)])
    return {"input_ids": encoded["input_ids"], "labels": labels}


def encode_texts(tokenizer: Any, rows: list[dict[str, Any]]) -> dict[str, list[list[int]]]:
    encoded = tokenizer([row["text"] for row in rows], add_special_tokens=True)
    ids = [seq + [tokenizer.eos_token_id] for seq in encoded["input_ids"]]
    return {"input_ids": ids, "labels": [list(seq) for seq in ids]}


def truncate(batch: dict[str, list[list[int]]], max_length: int) -> dict[str, list[Any]]:
    truncated = [len(ids) > max_length for ids in batch["input_ids"]]
    ids = [seq[:max_length] for seq in batch["input_ids"]]
    labels = [seq[:max_length] for seq in batch["labels"]]
    has_target = [any(label != IGNORE_INDEX for label in seq) for seq in labels]
    return {"input_ids": ids, "labels": labels, "truncated": truncated, "has_target": has_target,
            "length": [len(seq) for seq in ids]}


def encode_split(tokenizer: Any, kind: RecordKind, max_length: int, source: Path, target: Path,
                 split: str) -> dict[str, Any]:
    from datasets import Dataset

    rows = list(workspace.read_jsonl(source))
    encode = encode_texts if kind == "text" else encode_instructions
    columns = ("text",) if kind == "text" else ("instruction", "input", "output")
    table = Dataset.from_dict({c: [row.get(c) or "" for row in rows] for c in columns})

    def encode_batch(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        as_rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        return truncate(encode(tokenizer, as_rows), max_length)

    encoded = table.map(encode_batch, batched=True, batch_size=1000, remove_columns=list(columns))
    truncated = sum(encoded["truncated"])
    usable = encoded.filter(lambda keep: keep, input_columns="has_target")
    dropped = len(encoded) - len(usable)
    if dropped:
        log.warning("%s: %d rows have no response tokens left after truncation at %d tokens; not trained on",
                    split, dropped, max_length)
    usable = usable.remove_columns(["truncated", "has_target"])
    usable.save_to_disk(str(target))
    lengths = usable["length"]
    return {
        f"{split}_rows": len(usable),
        f"{split}_tokens": int(sum(lengths)),
        f"{split}_target_tokens": int(sum(sum(1 for x in seq if x != IGNORE_INDEX) for seq in usable["labels"])),
        f"{split}_truncated": int(truncated),
        f"{split}_truncation_rate": truncated / len(encoded) if len(encoded) else 0.0,
        f"{split}_dropped_no_target": int(dropped),
        f"{split}_max_length": int(max(lengths, default=0)),
    }


def tokenized_hash(folder: Path) -> str:
    """Hash the token data and tokenizer files, not the datasets bookkeeping (which holds random ids)."""
    def counts(path: Path) -> bool:
        return path.is_file() and (path.suffix != ".json" or path.parent.name == "tokenizer")

    files = sorted(p for p in folder.rglob("*") if counts(p))
    return workspace.hash_json({p.relative_to(folder).as_posix(): workspace.hash_file(p) for p in files})


@task(name="tokenize", cache_policy=NO_CACHE)
def tokenize_task(config: PipelineConfig, deduped: StageRecord, run: RunHandle) -> StageRecord:
    return tracking.tracked(run, lambda: tokenize(config.tokenize, config.model, config.data.kind, deduped,
                                                  workspace.project_root()))
