"""Training controls: the chat completion-only labels (the trainings themselves are in
tests/integration/test_training_controls.py)."""

from pathlib import Path

from datasets import load_from_disk
from transformers import AutoTokenizer

from llmops.data.synthetic import chat_records
from llmops.io.files import write_jsonl
from llmops.io.tables import table_rows
from llmops.text.encoding import IGNORE_INDEX
from tests.conftest import tiny_config
from tests.helpers import data_stages


def test_chat_labels_cover_every_assistant_turn_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    write_jsonl(path, chat_records(200, seed=4))
    deduped, tokenized = data_stages(tiny_config("tiny_sft_cpu.yaml", path, "data.kind=chat",
                                                 "tokenize.max_length=128"))
    tokenizer = AutoTokenizer.from_pretrained(tokenized.dir / "tokenizer")
    rows = list(table_rows(deduped.dir / "train"))
    for example, row in zip(load_from_disk(str(tokenized.dir / "train")), rows, strict=True):
        runs, current = [], []
        for token, label in zip(example["input_ids"], example["labels"], strict=True):
            if label == IGNORE_INDEX:
                if current:
                    runs.append(current)
                current = []
            else:
                assert label == token
                current.append(token)
        runs += [current] if current else []
        answers = [m["content"] + "<|end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in runs] == answers
