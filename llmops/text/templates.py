"""Chat templates: turning records into conversations, and conversations into text with response spans.

A span is where an assistant turn sits in the rendered text, from its first character through
its end-of-turn marker; tokens inside a span are the ones the model is trained to produce.
Rendering goes through the tokenizer's Jinja template, once per conversation shape: the shape is
rendered with placeholder contents and each row fills them in, a fast path that is checked
against a real rendering before it is trusted (templates that transform content are rendered
row by row).
"""

from __future__ import annotations

import re
import weakref
from typing import Any

from llmops.io.errors import UserError

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

Messages = list[dict[str, str]]
# a template that filters, slices or calls methods on a message's content renders each row itself
CONTENT_TRANSFORM = re.compile(r"""content['"]?\]?\s*(\||\.\w|\[)""")
Span = tuple[int, int]


class TemplateError(UserError, ValueError):
    """The chat template cannot be used to mark response tokens."""


def render(tokenizer: Any, messages: Messages, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def render_with_spans(tokenizer: Any, messages: Messages) -> tuple[str, list[Span]]:
    """The conversation's text and the span of each assistant turn, end-of-turn marker included."""
    full = render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:index], generation_prompt=True)
        through = render(tokenizer, messages[: index + 1]).rstrip()
        if not full.startswith(through) or not through.startswith(prompt):
            raise TemplateError("the chat template renders a turn differently once more turns follow (or the "
                                "generation prompt differently from an answered turn); set tokenize.chat_template "
                                "to a template whose earlier turns are a prefix of later ones")
        spans.append((len(prompt), len(through)))
    return full, spans


# one renderer per tokenizer in use, so that each conversation shape is planned once per process
RENDERERS: weakref.WeakKeyDictionary[Any, ShapeRenderer] = weakref.WeakKeyDictionary()


def renderer_for(tokenizer: Any) -> ShapeRenderer:
    """The tokenizer's renderer, made on first use; a template set on the tokenizer later gets a fresh one."""
    renderer = RENDERERS.get(tokenizer)
    if renderer is None or renderer.template != tokenizer.chat_template:
        renderer = RENDERERS[tokenizer] = ShapeRenderer(tokenizer)
    return renderer


class ShapeRenderer:
    """Renders conversations through the template once per shape (its sequence of roles)."""

    MARK = "\x00llmops-turn-{}\x00"
    MARKS = re.compile("\x00llmops-turn-(\\d+)\x00")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.template = tokenizer.chat_template
        self.plans: dict[tuple[str, ...], Plan | None] = {}

    def __call__(self, messages: Messages) -> tuple[str, list[Span]]:
        shape = tuple(m["role"] for m in messages)
        if shape not in self.plans:
            self.plans[shape] = self.plan(messages)
        plan = self.plans[shape]
        if plan is None:
            return render_with_spans(self.tokenizer, messages)
        return plan.fill([m["content"] for m in messages])

    def plan(self, messages: Messages) -> Plan | None:
        """The shape rendered with placeholders, or None when the template may not pass content through as is."""
        if CONTENT_TRANSFORM.search(self.tokenizer.chat_template or ""):
            return None
        marked = [{"role": m["role"], "content": self.MARK.format(i)} for i, m in enumerate(messages)]
        padded = [{"role": m["role"], "content": f" \n{m['content']}\n "} for m in marked]
        try:
            text, spans = render_with_spans(self.tokenizer, marked)
            padded_text = render(self.tokenizer, padded)
        except TemplateError:
            return None
        if any(f" \n{m['content']}\n " not in padded_text for m in marked):
            return None  # the template trims or otherwise touches the content
        plan = Plan.of(text, spans, self.MARKS)
        if plan.fill([m["content"] for m in messages]) != render_with_spans(self.tokenizer, messages):
            return None
        return plan


class Plan:
    """A rendered shape: literal pieces between contents, and each span boundary as (contents before, literal
    characters before), so that filling a row costs one join and a few additions."""

    def __init__(self, pieces: list[str], order: list[int], boundaries: list[tuple[int, int, int, int]]) -> None:
        self.pieces, self.order, self.boundaries = pieces, order, boundaries

    @classmethod
    def of(cls, text: str, spans: list[Span], marks: re.Pattern[str]) -> Plan:
        found = list(marks.finditer(text))
        pieces = cls.split(text, found)
        order = [int(match.group(1)) for match in found]

        def locate(position: int) -> tuple[int, int]:
            before = [m for m in found if m.end() <= position]
            return len(before), position - sum(m.end() - m.start() for m in before)

        return cls(pieces, order, [(*locate(start), *locate(end)) for start, end in spans])

    @staticmethod
    def split(text: str, found: list[re.Match[str]]) -> list[str]:
        pieces, cursor = [], 0
        for match in found:
            pieces.append(text[cursor:match.start()])
            cursor = match.end()
        return [*pieces, text[cursor:]]

    def fill(self, contents: list[str]) -> tuple[str, list[Span]]:
        ordered = [contents[index] for index in self.order]
        text = "".join(piece + content for piece, content in zip(self.pieces, [*ordered, ""], strict=True))
        lengths = [0]
        for content in ordered:
            lengths.append(lengths[-1] + len(content))
        return text, [(lengths[m1] + l1, lengths[m2] + l2) for m1, l1, m2, l2 in self.boundaries]
