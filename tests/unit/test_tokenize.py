import json
from pathlib import Path

import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from llmops.config.schema import PipelineConfig
from llmops.io.tables import table_rows
from llmops.text.encoding import IGNORE_INDEX
from tests.helpers import data_stages, stage

# short enough that some prompts leave no room for their response
MAX = 20


def test_labels_carry_exactly_the_responses_and_the_end_token(sft_config: PipelineConfig) -> None:
    deduped, tokenized = data_stages(sft_config)
    tokenizer = AutoTokenizer.from_pretrained(tokenized.dir / "tokenizer")
    dataset = load_from_disk(str(tokenized.dir / "train"))
    rows = list(table_rows(deduped.dir / "train"))
    assert len(dataset) == len(rows) == tokenized.figures.train.rows
    for example, row in list(zip(dataset, rows, strict=True))[:50]:
        targets = [t for t, label in zip(example["input_ids"], example["labels"], strict=True) if label != IGNORE_INDEX]
        assert tokenizer.decode(targets) == row["output"] + "<|end|>"
        first = example["labels"].index(targets[0])
        prompt = tokenizer.decode(example["input_ids"][:first])
        assert prompt.endswith("<|assistant|>\n") and row["instruction"] in prompt


def test_plain_text_is_trained_on_in_full(pretrain_config: PipelineConfig) -> None:
    _, tokenized = data_stages(pretrain_config)
    example = load_from_disk(str(tokenized.dir / "train"))[0]
    tokenizer = AutoTokenizer.from_pretrained(tokenized.dir / "tokenizer")
    assert example["labels"] == example["input_ids"]
    assert example["input_ids"][-1] == tokenizer.eos_token_id


def test_cache_is_reused_unless_template_tokenizer_or_max_length_change(sft_config: PipelineConfig,
                                                                         tmp_path: Path) -> None:
    deduped, first = data_stages(sft_config)

    def again(config: PipelineConfig):
        return stage("tokenize", config, deduped)

    assert again(sft_config).reused
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|end|>{% endfor %}" \
               "{% if add_generation_prompt %}[assistant] {% endif %}"
    variants = {
        "max_length": sft_config.model_copy(update={"tokenize": sft_config.tokenize.model_copy(
            update={"max_length": 40})}),
        "template": sft_config.model_copy(update={"tokenize": sft_config.tokenize.model_copy(
            update={"chat_template": template})}),
        "tokenizer": sft_config.model_copy(update={"tokenize": sft_config.tokenize.model_copy(
            update={"vocab_size": 300})}),
    }
    keys = {first.key}
    for name, config in variants.items():
        record = again(config)
        assert not record.reused, name
        keys.add(record.key)
    assert len(keys) == 4
    # a pretrained tokenizer is keyed by its files: the one trained above, saved and loaded from a path
    saved = tmp_path / "tok"
    AutoTokenizer.from_pretrained(first.dir / "tokenizer").save_pretrained(saved)
    pretrained = sft_config.model_copy(update={"tokenize": sft_config.tokenize.model_copy(
        update={"tokenizer": str(saved)})})
    from_path = again(pretrained)
    assert not from_path.reused and again(pretrained).reused
    tok = AutoTokenizer.from_pretrained(saved)
    tok.add_tokens(["<|new|>"])
    tok.save_pretrained(saved)
    assert again(pretrained).key != from_path.key


def test_truncation_is_counted(sft_config: PipelineConfig) -> None:
    short = sft_config.model_copy(update={"tokenize": sft_config.tokenize.model_copy(update={"max_length": 24})})
    _, tokenized = data_stages(short)
    split = tokenized.figures.train
    assert split.truncated > 0 and 0 < split.truncation_rate <= 1
    assert split.max_length <= 24
    assert split.rows + split.dropped_no_target <= 1500


def test_rows_truncation_leaves_without_a_target_are_listed_with_their_origin(sft_config: PipelineConfig) -> None:
    """A row whose response max_length cuts off entirely is not trained on: counted, and each one written to the
    split's dropped file with its source and line, so that no row leaves the pipeline without a trace."""
    short = sft_config.model_copy(update={"tokenize": sft_config.tokenize.model_copy(update={"max_length": MAX})})
    deduped, tokenized = data_stages(short)
    for split in ("train", "eval"):
        figures = getattr(tokenized.figures, split)
        lost = [json.loads(line) for line in (tokenized.dir / f"{split}.dropped.jsonl").read_text().splitlines()]
        assert len(lost) == figures.dropped_no_target
        rows = {(row["_source"], row["_line"]): row for row in table_rows(deduped.dir / split)}
        assert figures.rows + len(lost) == len(rows)
        for entry in lost:
            assert entry["code"] == "no_target" and f"tokenize.max_length={MAX}" in entry["message"]
            row = rows[(entry["source"], entry["line"])]
            assert json.dumps(row["instruction"], ensure_ascii=False)[1:40] in entry["excerpt"]
    assert tokenized.figures.train.dropped_no_target > 0


def test_fast_rendering_matches_the_template_even_when_it_trims(tmp_path: Path) -> None:
    from llmops.config.schema import DataConfig
    from llmops.data.tokenize import training_texts
    from llmops.objectives import selected
    from llmops.text.templates import ShapeRenderer, render_with_spans
    from llmops.text.tokenizers import prepare_tokenizer

    objective = selected(DataConfig(kind="text"))
    tokenizer = objective.train_tokenizer(training_texts([{"text": "hello there"}] * 5, objective), 300)
    trimming = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    for template in (None, trimming):
        prepare_tokenizer(tokenizer, template, trained_here=True)
        renderer = ShapeRenderer(tokenizer)
        clean = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        padded = [{"role": "user", "content": " a \n"}, {"role": "assistant", "content": "\n b  "}]
        for messages in (clean, padded):  # the shape is planned on the clean row, then reused
            assert renderer(messages) == render_with_spans(tokenizer, messages)


def test_token_ids_are_the_tokenizers_own_ids_for_every_framing() -> None:
    """The offset-free fast path gives what `tokenizer(texts)["input_ids"]` gives: a decoder's BPE, an encoder's
    (CLS ... END from its post-processor), and special tokens written in the text."""
    from llmops.text.encoding import token_ids
    from llmops.text.tokenizers import END, train_bpe, train_encoder_bpe

    corpus = [f"row {i}: the quick brown fox jumps over {i * 7} lazy dogs; ünïcødé ✓ 日本語" for i in range(200)]
    texts = [*corpus[:20], "", "   spaced   out  ", f"a special {END} token inside", "tab\tand\nnewline"]
    for tokenizer in (train_bpe(iter(corpus), 300), train_encoder_bpe(iter(corpus), 300)):
        for special in (True, False):
            expected = tokenizer(texts, add_special_tokens=special)["input_ids"]
            assert token_ids(tokenizer, texts, special) == expected
        assert token_ids(tokenizer, texts) != token_ids(tokenizer, texts, False) or tokenizer.cls_token is None
    # a tokenizer whose saved backend truncates and pads by itself: the tokenizer's own call turns both off
    tokenizer = train_bpe(iter(corpus), 300)
    tokenizer.backend_tokenizer.enable_truncation(4)
    tokenizer.backend_tokenizer.enable_padding(length=64, pad_id=0)
    ids = token_ids(tokenizer, texts)
    assert ids == tokenizer(texts)["input_ids"] and max(map(len, ids)) > 4 and min(map(len, ids)) < 64


def test_two_builds_of_the_same_rows_are_the_same_bytes(sft_config: PipelineConfig, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """datasets names a saved dataset by a random id unless told one: the stage names it by its key, so that two
    machines' builds (each of which may publish it) agree to the byte, bookkeeping included."""
    built = []
    for home in ("a", "b"):
        monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / home))
        _, tokenized = data_stages(sft_config)
        assert not tokenized.reused
        built.append({str(p.relative_to(tokenized.dir)): p.read_bytes() for p in sorted(tokenized.dir.rglob("*"))
                      if p.is_file() and p.name != "record.json"})  # the record holds timings
    assert built[0] == built[1]
    assert {"train/state.json", "eval/state.json", "manifest.json"} <= set(built[0])
    assert json.loads(built[0]["train/state.json"])["_fingerprint"].endswith("-train")


def test_a_split_encodes_to_the_same_bytes_whatever_its_shards(tmp_path: Path) -> None:
    from llmops.config.engine import EngineConfig
    from llmops.data.tokenize import encode_split, token_data
    from llmops.objectives import selected
    from llmops.objectives.base import Encoding
    from llmops.objectives.config import complete
    from llmops.pipeline.engine import Engine
    from tests.helpers import output_bytes, write_rows_table

    rows = [{"text": f"row {i} " + "word " * (i % 37), "_source": "d.jsonl", "_line": i + 1} for i in range(2500)]
    source = write_rows_table(rows, tmp_path / "table", rows_per_group=64)
    objective = selected(complete({"data": {"objective": "causal_lm", "kind": "text"}}).data)
    objective.train_tokenizer((row["text"] for row in rows), 300).save_pretrained(tmp_path / "tokenizer")
    outputs, shards = [], []
    for name, settings in (("whole", EngineConfig(workers=1)), ("cut", EngineConfig(workers=1, shard_bytes=4096)),
                           ("two", EngineConfig(workers=2, shard_bytes=8192))):
        (tmp_path / name).mkdir()
        with Engine(settings) as engine:
            figures = encode_split(objective, tmp_path / "tokenizer", Encoding(16), source, tmp_path / name / "train",
                                   engine, settings, "same")
            shards.append(engine.figures()["shards"])
        assert figures.rows == 2500
        outputs.append({file: data for file, data in output_bytes(tmp_path / name, "train").items()
                        if token_data(file.partition("/")[2])})
    # the encoded rows are re-cut into batches of their own, across the shards' ends
    assert shards[0] == 1 and shards[1] > 10 and shards[2] > 5
    assert outputs[0] == outputs[1] == outputs[2] and any(name.endswith(".arrow") for name in outputs[0])


def test_rows_have_a_target_exactly_when_some_label_carries_a_loss() -> None:
    """The end-of-row shortcut agrees with counting, and labels that are the ids stay the ids' own lists."""
    import random

    from llmops.text.encoding import has_target, truncated

    rng = random.Random(0)
    for _ in range(2000):
        labels = [rng.choice([IGNORE_INDEX, rng.randrange(50)]) for _ in range(rng.randrange(6))]
        assert has_target(labels) == any(label != IGNORE_INDEX for label in labels)
    ids = [[1, 2, 3, 4, 5], [6, 7], []]
    cut = truncated(ids, ids, 3)
    assert cut["input_ids"] == [[1, 2, 3], [6, 7], []] and cut["labels"] is cut["input_ids"]
    assert cut["raw_length"] == [5, 2, 0] and cut["length"] == [3, 2, 0] and cut["has_target"] == [True, True, False]
    other = truncated(ids, [[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 4, 5], [6, IGNORE_INDEX], []], 3)
    assert other["labels"] == [[IGNORE_INDEX] * 3, [6, IGNORE_INDEX], []]
    assert other["has_target"] == [False, True, False]


def test_kept_columns_keep_the_kept_rows_and_convert_a_shared_list_once() -> None:
    import pyarrow as pa

    from llmops.data.tokenize import kept_columns

    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
                        ("length", pa.int32())])
    ids = [[1, 2], [3], [4, 5, 6]]
    shared = kept_columns({"input_ids": ids, "labels": ids, "length": [2, 1, 3]}, [True, True, True], schema)
    assert shared[0] is shared[1] and shared[0].to_pylist() == ids and shared[2].to_pylist() == [2, 1, 3]
    apart = kept_columns({"input_ids": ids, "labels": [[-100, 2], [3], [-100, 5, 6]], "length": [2, 1, 3]},
                          [True, False, True], schema)
    assert [column.to_pylist() for column in apart] == [[[1, 2], [4, 5, 6]], [[-100, 2], [-100, 5, 6]], [2, 3]]
