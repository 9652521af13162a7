"""Chat templates: turning records into conversations, and conversations into text with response spans.

A span is where an assistant turn sits in the rendered text, from its first character through
its end-of-turn marker; tokens inside a span are the ones the model is trained to produce.
Rendering goes through the tokenizer's Jinja template, once per conversation shape: the shape is
rendered with placeholder contents and each row fills them in, a fast path that is checked
against a real rendering before it is trusted (templates that transform content are rendered
row by row). A conversation with tools passes them to the template (`tools=`, as transformers
renders them) and is rendered row by row; a template that leaves tools out is refused, never used.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

from llmops.io.errors import UserError

# for tokenizers trained here: each turn is `<|role|>` newline content `<|end|>` newline; tools, when a conversation
# has them, come first as a system turn of one line a tool, `name(parameter: type, ...) description` (short: a model
# trained here is small, and a JSON schema is hundreds of tokens), and an assistant's calls follow its content as
# `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Hermes' and Qwen's convention, records/tool_calls.py)
SCRATCH_TEMPLATE = (
    "{% if tools %}<|system|>\n{% for tool in tools %}{% set f = tool.function %}{{ f.name }}("
    "{% for key, spec in f.parameters.properties.items() %}{{ key }}: {{ spec.type }}{{ ', ' if not loop.last }}"
    "{% endfor %}) {{ f.description }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "<|end|>\n{% endfor %}"
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

Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None
# a template that filters, slices or calls methods on a message's content renders each row itself
CONTENT_TRANSFORM = re.compile(r"""content['"]?\]?\s*(\||\.\w|\[)""")
Span = tuple[int, int]


class TemplateError(UserError, ValueError):
    """The chat template cannot be used to mark response tokens."""


def render(tokenizer: Any, messages: Messages, generation_prompt: bool = False, tools: Tools = None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def render_with_spans(tokenizer: Any, messages: Messages, tools: Tools = None) -> tuple[str, list[Span]]:
    """The conversation's text and the span of each assistant turn (its tool calls too), end-of-turn marker
    included; tool results are not spans."""
    full = render(tokenizer, messages, tools=tools)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:index], generation_prompt=True, tools=tools)
        through = render(tokenizer, messages[: index + 1], tools=tools).rstrip()
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
        self.renders_tools = False  # checked once, on the first conversation with tools

    def __call__(self, messages: Messages, tools: Tools = None) -> tuple[str, list[Span]]:
        if tools is not None or any("tool_calls" in m for m in messages):
            if not self.renders_tools:
                require_tools(self.tokenizer, "the tokenizer's chat template")
                self.renders_tools = True
            return render_with_spans(self.tokenizer, messages, tools)  # calls are no content a plan can fill
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


# a conversation that shows whether a template renders tools: its definitions, a call with its arguments, a result
PROBE_NAME, PROBE_ARGUMENT, PROBE_RESULT = "llmops_probe_tool", "llmops-probe-value", "llmops-probe-result"
PROBE_TOOLS = [{"type": "function", "function": {
    "name": PROBE_NAME, "description": "Shows whether a chat template renders tools.",
    "parameters": {"type": "object", "properties": {"value": {"type": "string"}}, "required": ["value"]}}}]
PROBE_TURNS: Messages = [
    {"role": "user", "content": "Call the tool."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": PROBE_NAME, "arguments": {"value": PROBE_ARGUMENT}}}]},
    {"role": "tool", "content": PROBE_RESULT},
]


def tools_left_out(tokenizer: Any) -> str | None:
    """What of a conversation with tools the tokenizer's template does not render (the tools' definitions, a call,
    a tool's result), or None when it renders them all."""
    try:
        prompt = render(tokenizer, PROBE_TURNS[:1], generation_prompt=True, tools=PROBE_TOOLS)
        called = render(tokenizer, PROBE_TURNS[:2], tools=PROBE_TOOLS)
        answered = render(tokenizer, PROBE_TURNS, tools=PROBE_TOOLS)
    except Exception as err:  # noqa: BLE001 - a template may raise anything (an unknown role, content None)
        return f"conversations with tools (rendering one raised {type(err).__name__}: {err})"
    if PROBE_NAME not in prompt:
        return "the tools' definitions (tools=)"
    call = called[len(prompt):] if called.startswith(prompt) else called.replace(prompt, "", 1)
    if PROBE_NAME not in call or PROBE_ARGUMENT not in call:
        return "an assistant turn's tool_calls"
    if PROBE_RESULT not in answered:
        return "a tool turn's result"
    return None


def require_tools(tokenizer: Any, template: str) -> None:
    """Refuse a template that would drop tools, in one line naming it (`template`)."""
    missing = tools_left_out(tokenizer)
    if missing is not None:
        raise TemplateError(f"{template} cannot render tool data: it leaves out {missing}. Set "
                            "tokenize.chat_template to a template that renders tools= and tool_calls (Qwen2.5's or "
                            "Hermes'; the built-in template of a tokenizer trained here does)")
