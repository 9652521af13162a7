"""Language models: decoders trained to predict the next token, scored on likelihood and on what they generate.

Shared by causal LM (plain text) and SFT (instructions, chats), and by the preference objectives
that tune such a model. Asked through `llmops predict`, a language model replies to instruction and
chat rows (greedy, through its chat template, as evaluation generates) and gives the perplexity of
text rows.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from llmops.models import modeling
from llmops.objectives.base import Objective, Request, RowError, Served, answered_by_ask, string_field
from llmops.objectives.tool_answers import openai_calls
from llmops.records import tool_calls
from llmops.records.conversations import Messages, prompt_messages, sharegpt_turn
from llmops.text.encoding import IGNORE_INDEX
from llmops.text.templates import render

if TYPE_CHECKING:
    from llmops.objectives.base import Model, Tokenizer

ROLES = ("system", "user", "assistant", "tool")


class LanguageModel(Objective):
    """A decoder-only language model: packed training, likelihood and generation, replies and perplexities."""

    task = "text-generation"
    packable = True
    benchmark_backend = "causal"

    def flavor_settings(self, max_new_tokens: int) -> dict[str, Any]:
        """A chat model: OpenAI-style messages in, a chat completion out, through the model's chat template;
        greedy replies of the run's length, as evaluation generated them."""
        return {"task": "llm/v1/chat", "model_config": {"max_new_tokens": max_new_tokens, "do_sample": False}}

    def serving_body(self) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "When did the bridge over the river open?"}]}

    def usage(self) -> str:
        return ('chat = mlflow.pyfunc.load_model(uri)  # OpenAI-style messages in, a chat completion out\n'
                'print(chat.predict({"messages": [{"role": "user", "content": "your question"}]}))')

    # --- predict -------------------------------------------------------------------------------------------

    def request(self, line: int, row: dict[str, Any], served: Served) -> Request:
        if "messages" in row or "conversations" in row:
            prompt, tools, reference = chat_prompt(row.get("messages", row.get("conversations")), row.get("tools"))
            return Request(line, "generate", {"prompt": prompt, **({"tools": tools} if tools else {})}, reference)
        if "instruction" in row:
            fields = {"instruction": string_field(row, "instruction"),
                      "input": string_field(row, "input", required=False)}
            return Request(line, "generate", {"prompt": prompt_messages(fields)},
                           string_field(row, "output", required=False))
        if "text" in row:
            return Request(line, "perplexity", {"text": string_field(row, "text")})
        if "prefix" in row:
            return Request(line, "continue", {"prefix": string_field(row, "prefix")})
        raise RowError("expected a field instruction (with optional input and output), messages, text or prefix; got "
                       f"{', '.join(sorted(row)) or 'an empty object'}")

    def answer(self, served: Served, requests: list[Request]) -> list[dict[str, Any]]:
        return answered_by_ask(served, requests, {"generate": reply, "perplexity": perplexity,
                                                  "continue": continuation})

    def limits(self, served: Served) -> str:
        return f"replies of up to {served.max_new_tokens} tokens, texts cut at {served.encoding.max_length} tokens"


def chat_prompt(turns: Any, tools: Any = None) -> tuple[Messages, list[dict[str, Any]] | None, str | None]:
    """The turns to reply to, the tools they may call (read and checked as training data's are), and the closing
    assistant turn as the reference when there is one."""
    if not isinstance(turns, list) or not turns:
        raise RowError("messages: expected a non-empty list of {role, content} turns")
    turns = [sharegpt_turn(turn) for turn in turns]
    for number, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not (
                isinstance(turn.get("content"), str) or turn.get("content") is None and tool_calls.is_call(turn)):
            raise RowError(f"messages: turn {number} is not a {{role: {'|'.join(ROLES)}, content: string}}")
    listed = None
    if tool_calls.has_tool_data(turns, tools):
        problem = tool_calls.tool_problem(turns, tools)
        if problem is not None:
            raise RowError(str(problem))
        stored = tool_calls.stored_row({"messages": turns, "tools": tools})
        turns, listed = stored["messages"], tool_calls.stored_tools(stored)
    messages = [tool_calls.rendered_turn(turn) for turn in turns]
    reference = tool_calls.turn_text(messages.pop()) if messages[-1]["role"] == "assistant" else None
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise RowError("messages: the prompt must end with a user turn or a tool's result (a closing assistant turn "
                       "is the reference)")
    return messages, listed, reference


def reply(served: Served, requests: list[Request]) -> list[dict[str, Any]]:
    """Greedy replies through the chat template, as evaluation generates them, with the tokens each generated; the
    tool calls a reply makes also in OpenAI's shape (`tool_calls`)."""
    texts, lengths, _ = generate(served.model, served.tokenizer, [r.fields["prompt"] for r in requests],
                           served.max_new_tokens, len(requests), [r.fields.get("tools") for r in requests],
                           streamer=served.streamer(requests, True) if served.streamer else None)
    answers = []
    for request, text, length in zip(requests, texts, lengths, strict=True):
        calls = openai_calls(text)
        answers.append({"output": text, "tokens": length, **({"tool_calls": calls} if calls else {}),
                        **({"reference": request.reference} if request.reference is not None else {})})
    return answers


def continuation(served: Served, requests: list[Request]) -> list[dict[str, Any]]:
    """Greedy continuations of raw text (no chat template), as a causal LM reads text in training: from its BOS."""
    prefixes = [request.fields["prefix"] for request in requests]
    texts, lengths, cut = complete(served.model, served.tokenizer, prefixes, served.max_new_tokens, len(requests),
                                   special_tokens=True, strip=False,
                                   streamer=served.streamer(requests, False) if served.streamer else None)
    return [{"output": text, "tokens": length, "truncated": flag}
            for text, length, flag in zip(texts, lengths, cut, strict=True)]


def perplexity(served: Served, requests: list[Request]) -> list[dict[str, Any]]:
    """exp of each row's mean negative log-likelihood per predicted token, on the tokens evaluation scores."""
    tokenizer, limit = served.tokenizer, served.encoding.max_length
    ids = [seq + [tokenizer.eos_token_id] for seq in
           tokenizer([r.fields["text"] for r in requests], add_special_tokens=True)["input_ids"]]
    encoded = {"input_ids": [seq[:limit] for seq in ids], "labels": [seq[:limit] for seq in ids]}
    nll, tokens = token_losses(served.model, encoded, tokenizer.pad_token_id, len(requests))
    return [{"perplexity": math.exp(loss / count) if count else math.nan, "tokens": count,
             "truncated": len(seq) > limit} for loss, count, seq in zip(nll, tokens, ids, strict=True)]


def token_losses(model: Model, encoded: dict[str, list[Any]], pad_token_id: int,
                 batch_size: int) -> tuple[list[float], list[int]]:
    """Per row: the summed negative log-likelihood of its target tokens, and how many there are."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)
    rows = [{"input_ids": ids, "labels": labels} for ids, labels in zip(encoded["input_ids"], encoded["labels"],
                                                                        strict=True)]
    nll: list[float] = []
    tokens: list[int] = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = modeling.on_device(collate(rows[start:start + batch_size]), model)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets,
                                                     ignore_index=IGNORE_INDEX, reduction="none")
            nll.extend(loss.sum(dim=1).tolist())
            tokens.extend((targets != IGNORE_INDEX).sum(dim=1).tolist())
    return nll, tokens


def generate(model: Model, tokenizer: Tokenizer, prompts: list[Messages], max_new_tokens: int, batch_size: int,
             tools: list[Any] | None = None, streamer: Any = None) -> tuple[list[str], list[int], list[bool]]:
    """Greedy replies to each prompt's last turn (with its tools, if any), batched with left padding: the texts,
    their lengths in tokens, and whether each was cut at max_new_tokens before it ended."""
    listed = tools or [None] * len(prompts)
    rendered = [render(tokenizer, prompt, generation_prompt=True, tools=one)
                for prompt, one in zip(prompts, listed, strict=True)]
    return complete(model, tokenizer, rendered, max_new_tokens, batch_size, special_tokens=False, strip=True,
                    streamer=streamer)


def complete(model: Model, tokenizer: Tokenizer, texts: list[str], max_new_tokens: int, batch_size: int,
             special_tokens: bool, strip: bool, streamer: Any = None) -> tuple[list[str], list[int], list[bool]]:
    """Greedy continuations of texts, batched with left padding (what `generate` does after the chat template).

    A `streamer` (transformers' BaseStreamer: the service's, streaming replies as they are generated) is handed each
    step's tokens of every row; it reads one batch, so it comes with a batch_size that takes all the texts at once.
    """
    import torch

    tokenizer.padding_side = "left"
    outputs: list[str] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    for start in range(0, len(texts), batch_size):
        ids = modeling.fit_prompts(model.config, tokenizer(texts[start:start + batch_size],
                                                           add_special_tokens=special_tokens)["input_ids"],
                                   max_new_tokens)
        batch = modeling.on_device(tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt"), model)
        with torch.no_grad():
            generated = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for sequence in generated[:, batch["input_ids"].shape[1]:].tolist():
            length = sequence.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in sequence else len(sequence)
            lengths.append(length)
            truncated.append(length >= max_new_tokens)
            text = tokenizer.decode(sequence[:length], skip_special_tokens=True)
            outputs.append(text.strip() if strip else text)
    return outputs, lengths, truncated
