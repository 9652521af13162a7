"""Tokenizers: a byte-level BPE trained on the data, its chat template, and a tokenizer's identity.

A model built from scratch gets a tokenizer trained on its training split: byte-level BPE (no
unknown tokens), digits always single tokens (numbers are read digit by digit), with the special
tokens of the scratch chat template. A tokenizer's hash covers every file it saves, so a changed
vocabulary or template is a changed input.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmops.io.errors import MissingInputError
from llmops.io.files import hash_tree
from llmops.text import templates

PAD, END = "<|pad|>", "<|end|>"
SPECIAL_TOKENS = (PAD, END, "<|user|>", "<|assistant|>", "<|system|>")
# an encoder's: the class token that starts a text, and the token that stands for a hidden one
CLS, MASK = "<|cls|>", "<|mask|>"


def train_core(texts: Iterable[str], vocab_size: int, special_tokens: list[Any]) -> Any:
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
    core.train_from_iterator(texts, trainer)
    return core


def train_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """A decoder's tokenizer: byte-level BPE with the scratch template's special tokens, <|end|> ending a text."""
    from transformers import PreTrainedTokenizerFast

    core = train_core(texts, vocab_size, list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=END)


def train_encoder_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """An encoder's tokenizer: the same byte-level BPE with a class token and a mask token added, framing a text as
    `<|cls|> text <|end|>` and a pair as `<|cls|> a <|end|> b <|end|>` (masked LM, and question then context for
    extractive QA). The mask token strips the space before it, as the tokens it stands for carry their leading
    space."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    core = train_core(texts, vocab_size, [*SPECIAL_TOKENS, CLS, AddedToken(MASK, lstrip=True, special=True)])
    cls_id, sep_id = core.token_to_id(CLS), core.token_to_id(END)
    core.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {END}", pair=f"{CLS} $A {END} $B:1 {END}:1",
        special_tokens=[(CLS, cls_id), (END, sep_id)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=END, cls_token=CLS, sep_token=END,
                                   mask_token=MASK)


def prepare_tokenizer(tokenizer: Any, template: str | None, trained_here: bool) -> None:
    """The configured chat template, else the tokenizer's own, else a built-in one; and a pad token."""
    if template is not None:
        tokenizer.chat_template = template
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = templates.SCRATCH_TEMPLATE if trained_here else templates.PLAIN_TEMPLATE
    if tokenizer.pad_token is None:
        # padding positions never carry loss, so reusing EOS as padding is safe
        tokenizer.pad_token = tokenizer.eos_token


def read_template(value: str | None, root: Path) -> str | None:
    """A template given inline, or as the path of a Jinja file."""
    if value is None:
        return None
    candidate = Path(value) if Path(value).is_absolute() else root / value
    if value.endswith((".jinja", ".j2")) or ("\n" not in value and candidate.is_file()):
        if not candidate.is_file():
            raise MissingInputError(f"tokenize.chat_template: template file not found: {candidate}")
        return candidate.read_text(encoding="utf-8")
    return value


def tokenizer_hash(tokenizer: Any) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return hash_tree(Path(tmp))
