"""Pretrained tokenizers that come as a SentencePiece model only (T5's spiece.model, Marian's source.spm), as many
hub models do: the one a seq2seq model ships is used as it is, and an objective that needs a fast tokenizer refuses a
Python one in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from llmops.data.synthetic import pair_records, words_task
from llmops.io.files import write_jsonl
from llmops.io.tables import table_rows
from llmops.objectives.base import ObjectiveError
from tests.conftest import tiny_config
from tests.helpers import data_stages


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A unigram SentencePiece model trained on other pairs of the task, with T5's special pieces."""
    import sentencepiece

    folder = tmp_path_factory.mktemp("spm")
    lines = [text for row in pair_records(words_task, 2000, seed=1) for text in (row["source"], row["target"])]
    (folder / "corpus.txt").write_text("\n".join(lines))
    sentencepiece.SentencePieceTrainer.train(input=str(folder / "corpus.txt"), model_prefix=str(folder / "spiece"),
                                             vocab_size=120, model_type="unigram", pad_id=0, eos_id=1, unk_id=2,
                                             bos_id=-1, minloglevel=2)
    return folder / "spiece.model"


def t5_folder(model: Path, folder: Path) -> Path:
    """A T5 tokenizer as a hub repo without tokenizer.json holds it: spiece.model and its config."""
    folder.mkdir()
    (folder / "spiece.model").write_bytes(model.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 0,
                                                              "model_max_length": 512}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>",
                                                                "pad_token": "<pad>"}))
    return folder


def marian_folder(model: Path, folder: Path) -> Path:
    """Marian's tokenizer: a Python one (SentencePiece models and a vocabulary, no fast backend)."""
    import sentencepiece
    from transformers import MarianTokenizer

    folder.mkdir()
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(model))
    (folder / "vocab.json").write_text(json.dumps({pieces.id_to_piece(i): i for i in range(pieces.get_piece_size())}))
    MarianTokenizer(source_spm=str(model), target_spm=str(model), vocab=str(folder / "vocab.json"),
                    pad_token="<pad>", eos_token="</s>", unk_token="<unk>").save_pretrained(folder)
    return folder


def test_a_t5_tokenizer_given_as_a_sentencepiece_model_only_tokenizes_seq2seq_pairs(
        sentencepiece_model: Path, tmp_path: Path) -> None:
    tokenizer_dir = t5_folder(sentencepiece_model, tmp_path / "t5")
    write_jsonl(tmp_path / "pairs.jsonl", pair_records(words_task, 300, seed=7))
    config = tiny_config("tiny_seq2seq_cpu.yaml", tmp_path / "pairs.jsonl", f"tokenize.tokenizer={tokenizer_dir}")
    deduped, tokenized = data_stages(config)
    saved = AutoTokenizer.from_pretrained(tokenized.dir / "tokenizer")
    rows, encoded = list(table_rows(deduped.dir / "train")), load_from_disk(str(tokenized.dir / "train"))
    assert len(encoded) == len(rows) == tokenized.figures.train.rows > 250
    for row, example in list(zip(rows, encoded, strict=True))[:20]:
        # the pieces cover every character of these pairs: each side decodes back to its text
        assert saved.decode(example["input_ids"], skip_special_tokens=True) == row["source"]
        assert saved.decode([t for t in example["labels"] if t >= 0], skip_special_tokens=True) == row["target"]


def test_a_python_tokenizer_serves_seq2seq_and_is_refused_in_one_line_where_offsets_are_needed(
        sentencepiece_model: Path, tmp_path: Path, instruction_file: Path) -> None:
    tokenizer_dir = marian_folder(sentencepiece_model, tmp_path / "marian")
    assert getattr(AutoTokenizer.from_pretrained(tokenizer_dir), "backend_tokenizer", None) is None
    write_jsonl(tmp_path / "pairs.jsonl", pair_records(words_task, 300, seed=7))
    _, tokenized = data_stages(tiny_config("tiny_seq2seq_cpu.yaml", tmp_path / "pairs.jsonl",
                                           f"tokenize.tokenizer={tokenizer_dir}"))
    assert tokenized.figures.train.rows > 250

    sft = tiny_config("tiny_sft_cpu.yaml", instruction_file, f"tokenize.tokenizer={tokenizer_dir}")
    with pytest.raises(ObjectiveError) as refused:
        data_stages(sft)
    message = str(refused.value)
    assert "\n" not in message and "(MarianTokenizer) has no fast backend" in message
    assert "data.objective=sft" in message and "set tokenize.tokenizer" in message
