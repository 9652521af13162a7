"""Token classification: column mapping, quarantine codes with line numbers, sub-token label alignment, the entity
span rules and their metrics, prediction requests (a tagger trained, registered and predicted with:
tests/integration/test_token_classification_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmops.config.schema import DataConfig
from llmops.data.synthetic import ENTITY_TAGS, entity_records
from llmops.data.tokenize import training_texts
from llmops.io.files import read_jsonl, write_jsonl
from llmops.io.tables import table_rows
from llmops.objectives import load_config, metrics, selected, token_classification
from llmops.objectives.base import Encoding, RowError, Served
from llmops.objectives.token_classification import IGNORE_INDEX, METRICS, entities, tag_parts, whole_words
from llmops.registry.loading import LoadedVersion
from llmops.serving.predict import read_request
from tests.helpers import stage

REPO = Path(__file__).resolve().parents[2]
LABELS = list(ENTITY_TAGS)
LABEL_IDS = {label: index for index, label in enumerate(LABELS)}
OBJECTIVE = selected(DataConfig(kind="tokens", labels=LABELS))


# --- ingest and validation -----------------------------------------------------------------------------------


def test_common_column_names_are_mapped_first_present_wins() -> None:
    def canonical(row: dict, columns: dict) -> dict:
        return OBJECTIVE.kind.canonical(row, columns)

    assert canonical({"words": ["a"], "ner_tags": [0], "pos_tags": [3]}, {}) == {"tokens": ["a"], "tags": [0]}
    assert canonical({"tokens": ["a"], "labels": ["O"]}, {}) == {"tokens": ["a"], "tags": ["O"]}
    assert canonical({"tokens": ["a"], "tags": None, "pos_tags": [1]}, {}) == {"tokens": ["a"], "tags": [1]}
    # a configured column is the only one read
    assert canonical({"w": ["a"], "ner_tags": [0], "t": [2]}, {"tokens": "w", "tags": "t"}) == \
        {"tokens": ["a"], "tags": [2]}


def row(tokens: Any, tags: Any, **extra: Any) -> dict[str, Any]:
    return {"tokens": tokens, "tags": tags, **extra}


def test_malformed_rows_are_quarantined_with_line_field_and_code(tmp_path: Path) -> None:
    rows = [
        row(["King", "Louis", "XIV"], ["O", "O", "B-ROMAN"]),                      # 1 good
        {"words": ["on", "May", "2"], "ner_tags": [0, 1, 2]},                      # 2 good: ClassLabel ids
        row(["three", "hundred", "men"], ["B-NUM", "I-NUM"]),                       # 3 fewer tags than words
        row(["King", "Louis", "XIV"], ["O", "B-PER", "B-ROMAN"]),                  # 4 a tag outside data.labels
        row(["page", "nine"], [0, 9]),                                              # 5 an integer tag out of range
        row("King Louis XIV", ["O", "O", "B-ROMAN"]),                               # 6 words not a list
        row([], []),                                                                # 7 no words
        row(["a\u0000b", "c"], ["O", "O"]),                                         # 8 a NUL inside a word
        {"tokens": ["just", "words"]},                                              # 9 no tags
        row(["chapter", 4], ["O", "B-NUM"]),                                        # 10 a word that is a number
        row(["a", " "], ["O", "O"]),                                                # 11 a blank word
        row(["a", "b"], ["O", True]),                                               # 12 a boolean tag
        *entity_records(40, seed=5),                                                # 13.. good
    ]
    data = tmp_path / "entities.jsonl"
    write_jsonl(data, rows)
    config = load_config(REPO / "configs" / "tiny_tokens_cpu.yaml", [f"data.path={data}",
                                                                      "validate.max_bad_fraction=0.5"])
    validated = stage("validate", config, stage("ingest", config))
    quarantine = {entry["line"]: entry for entry in read_jsonl(validated.dir / "quarantine.jsonl")}
    found = {line: (entry["code"], entry["field"]) for line, entry in quarantine.items()}
    assert found == {3: ("tags_mismatch", "tags"), 4: ("label_unknown", "tags"), 5: ("label_unknown", "tags"),
                     6: ("wrong_type", "tokens"), 7: ("empty", "tokens"), 8: ("nul_byte", "tokens"),
                     9: ("missing_field", "tags"), 10: ("wrong_type", "tokens"), 11: ("empty", "tokens"),
                     12: ("label_unknown", "tags")}
    messages = {line: entry["message"] for line, entry in quarantine.items()}
    assert messages[3] == "tags: 2 tags for 3 words; expected one tag per word"
    assert messages[4] == "tags: tag 'B-PER' at index 1 is not one of data.labels (O, B-DATE, I-DATE, B-NUM, " \
                          "I-NUM, B-ROMAN)"
    assert messages[5] == "tags: tag 9 at index 1 is out of range: an integer tag indexes data.labels (0 to 5)"
    assert messages[6] == "tokens: a string where a list of words is expected"
    assert messages[7] == "tokens: an empty list of words"
    assert messages[8] == "tokens: the word at index 0 holds a NUL character"
    assert messages[10] == "tokens: the word at index 1 is a number, not text"
    assert messages[11] == "tokens: the word at index 1 is empty or only whitespace"
    # a file outside the project is named by its absolute path
    assert all(entry["source"] == str(data) for entry in quarantine.values())
    kept = list(table_rows(validated.dir / "valid"))
    assert validated.figures.rows_kept == len(kept) == 42
    # integer tags become the names they index
    assert [r["tags"] for r in kept if r["_line"] == 2] == [["O", "B-DATE", "I-DATE"]]


# --- alignment -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The byte-level BPE tokenizer the tokenize stage trains on tokens records."""
    train_file = tmp_path_factory.mktemp("bpe") / "train.jsonl"
    write_jsonl(train_file, entity_records(300, seed=1))
    return OBJECTIVE.train_tokenizer(training_texts(read_jsonl(train_file), OBJECTIVE), 300)


def encode_rows(tokenizer: Any, rows: list[dict[str, Any]], max_length: int) -> dict[str, list[Any]]:
    """The tokenize stage's encoding of validated rows (the objective's), with the word of each labelled position
    that the module's encode adds for prediction."""
    staged = OBJECTIVE.encode(tokenizer, rows, Encoding(max_length, tuple(LABELS)))
    full = token_classification.encode(tokenizer, [row["tokens"] for row in rows],
                                       [[LABEL_IDS[tag] for tag in row["tags"]] for row in rows], max_length)
    assert staged == {name: value for name, value in full.items() if name != "word_index"}
    return full


def wordpiece() -> Any:
    """A BERT-style WordPiece tokenizer ([CLS] ... [SEP], lower-cased, ## continuations)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "king", "louis", "x", "##iv", "was", "crowned", "on", "1", "##8",
              "##7", "##0", "june", "."]
    core = Tokenizer(models.WordPiece({piece: index for index, piece in enumerate(pieces)}, unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")


SENTENCE = {"tokens": ["King", "Louis", "XIV", "was", "crowned", "on", "10", "June", "1870", "."],
            "tags": ["O", "O", "B-ROMAN", "O", "O", "O", "B-DATE", "I-DATE", "I-DATE", "O"]}


def word_groups(labels: list[int], ids: list[int]) -> list[list[int]]:
    """Token ids grouped by word: a group starts at each labelled position and runs to the next one."""
    groups: list[list[int]] = []
    for label, token in zip(labels, ids, strict=True):
        if label != IGNORE_INDEX:
            groups.append([token])
        elif groups:
            groups[-1].append(token)
    return groups


def test_bpe_words_are_encoded_as_in_running_text_with_the_tag_on_their_first_sub_token(bpe: Any) -> None:
    assert token_classification.word_prefix(bpe) == " "
    encoded = encode_rows(bpe, [SENTENCE], max_length=64)
    ids, labels = encoded["input_ids"][0], encoded["labels"][0]
    assert [label for label in labels if label != IGNORE_INDEX] == [LABEL_IDS[tag] for tag in SENTENCE["tags"]]
    groups = word_groups(labels, ids)
    # each word's sub-tokens, in order, spell the word after a space: nothing is lost or shifted between words
    assert [bpe.decode(group) for group in groups] == [" " + word for word in SENTENCE["tokens"]]
    assert bpe.convert_ids_to_tokens(groups[8]) == ["Ġ", "1", "8", "7", "0"]  # digits stay single tokens
    assert encoded["word_index"][0] == list(range(10)) and encoded["raw_length"][0] == len(ids)
    # continuation sub-tokens carry no label: as many -100 as the words have extra sub-tokens
    assert labels.count(IGNORE_INDEX) == sum(len(group) - 1 for group in groups) > 0


def test_wordpiece_special_and_continuation_tokens_carry_no_label() -> None:
    tokenizer = wordpiece()
    assert token_classification.word_prefix(tokenizer) == ""
    encoded = encode_rows(tokenizer, [SENTENCE], max_length=64)
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    assert tokens == ["[CLS]", "king", "louis", "x", "##iv", "was", "crowned", "on", "1", "##0", "june", "1", "##8",
                      "##7", "##0", ".", "[SEP]"]
    tag = [LABEL_IDS[t] for t in SENTENCE["tags"]]
    assert encoded["labels"][0] == [IGNORE_INDEX, tag[0], tag[1], tag[2], IGNORE_INDEX, tag[3], tag[4], tag[5],
                                    tag[6], IGNORE_INDEX, tag[7], tag[8], IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX,
                                    tag[9], IGNORE_INDEX]


def test_truncation_keeps_whole_words_and_the_closing_special_token() -> None:
    tokenizer = wordpiece()
    # 10 tokens fit: [CLS] king louis x ##iv was crowned on 1 | ##0 ... [SEP]: "10" does not fit whole
    encoded = encode_rows(tokenizer, [SENTENCE], max_length=10)
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    assert tokens == ["[CLS]", "king", "louis", "x", "##iv", "was", "crowned", "on", "[SEP]"]
    assert encoded["word_index"][0] == [0, 1, 2, 3, 4, 5] and encoded["length"][0] == 9
    assert encoded["raw_length"][0] == 17 and encoded["has_target"][0]
    assert whole_words([1, 2, 3, 4, 5, 6], [None, 0, 0, 1, 1, None], 4) == ([1, 2, 3, 6], [None, 0, 0, None])
    # no whole word fits: nothing to learn from, the row is dropped by the tokenize stage
    long_word = encode_rows(tokenizer, [{"tokens": ["crowned", "xiv" * 9], "tags": ["O", "O"]}], max_length=2)
    assert not long_word["has_target"][0]


# --- span rules and metrics ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("tags", "spans"), [
    (["B-PER", "I-PER", "O", "B-LOC"], [("PER", 0, 2), ("LOC", 3, 4)]),
    (["I-PER", "I-PER", "O"], [("PER", 0, 2)]),                         # I- without B- starts an entity
    (["B-PER", "I-LOC", "I-LOC"], [("PER", 0, 1), ("LOC", 1, 3)]),      # I- of another type starts a new one
    (["B-PER", "B-PER", "I-PER"], [("PER", 0, 1), ("PER", 1, 3)]),      # B- always starts a new one
    (["O", "I-PER", "B-PER", "I-PER"], [("PER", 1, 2), ("PER", 2, 4)]),
    (["NN", "NN", "O", "VB"], [("NN", 0, 1), ("NN", 1, 2), ("VB", 3, 4)]),  # plain tags are one-word entities
    (["O", "O"], []),
])
def test_entity_spans(tags: list[str], spans: list[tuple[str, int, int]]) -> None:
    assert entities(tags) == spans


def test_entity_metrics_count_exact_span_and_type_matches_over_all_examples() -> None:
    predicted = [["B-DATE", "I-DATE", "O", "B-NUM"], ["O", "O", "O"], ["B-NUM", "O"], ["O"]]
    truth = [["B-DATE", "I-DATE", "O", "B-ROMAN"], ["B-NUM", "I-NUM", "O"], ["B-NUM", "I-NUM"], ["O"]]
    parts = tag_parts(predicted, truth)
    # (true positives, predicted, actual) per example: a wrong type, a missed entity, a span one word short
    assert parts["entity_f1"].tolist() == [[1, 2, 2], [0, 0, 1], [0, 1, 1], [0, 0, 0]]
    assert metrics.value(METRICS["entity_precision"], parts["entity_precision"]) == pytest.approx(1 / 3)
    assert metrics.value(METRICS["entity_recall"], parts["entity_recall"]) == pytest.approx(1 / 4)
    assert metrics.value(METRICS["entity_f1"], parts["entity_f1"]) == pytest.approx(2 * 1 / (3 + 4))
    assert metrics.value(METRICS["token_accuracy"], parts["token_accuracy"]) == pytest.approx(6 / 10)
    # nothing predicted and nothing to find: undefined, not perfect
    assert np.isnan(metrics.value(METRICS["entity_precision"], parts["entity_precision"][3:]))
    assert OBJECTIVE.primary(None, [])[0] == "entity_f1"
    assert metrics.directed(OBJECTIVE.metrics) == ("entity_f1", "entity_precision", "entity_recall", "token_accuracy")


# --- prediction requests -------------------------------------------------------------------------------------


def tagger() -> LoadedVersion:
    """A tagger as predict holds it; reading its rows needs neither model nor tokenizer."""
    served = Served(model=None, tokenizer=None, labels=LABELS, encoding=Encoding(64, tuple(LABELS)),
                    max_new_tokens=32)
    return LoadedVersion(name="tagger", version="1", objective=OBJECTIVE, task=OBJECTIVE.task, served=served)


def test_prediction_rows_give_words_from_tokens_or_whitespace_split_text() -> None:
    assert read_request(tagger(), 1, b'{"tokens": ["King", "Louis", "XIV"]}').fields["words"] == ["King", "Louis",
                                                                                                   "XIV"]
    request = read_request(tagger(), 2, json.dumps({"text": " born on  10 June\t1870 "}).encode())
    assert request.ask == "tag" and request.fields["words"] == ["born", "on", "10", "June", "1870"]
    with pytest.raises(RowError, match="tokens: expected a non-empty list of non-empty strings"):
        read_request(tagger(), 3, b'{"tokens": ["a", ""]}')
    with pytest.raises(RowError, match="expected tokens"):
        read_request(tagger(), 4, b'{"text": "   "}')
