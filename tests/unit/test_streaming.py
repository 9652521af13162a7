"""Replies streamed from a batched generate call (serving/streaming.py), with a real tokenizer and a tiny random
model: what each row sends is exactly the start of its final reply, rows stream independently, a row stops at its
end token, partial characters, trailing spaces and tool calls are held back, and the events a client reads carry
the whole reply (the service itself: tests/integration/test_service.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
import torch

from llmops.data.synthetic import instruction_records
from llmops.objectives.base import Encoding, Served
from llmops.objectives.language import LanguageModel
from llmops.serving import openai_api
from llmops.serving.streaming import BatchStreamer, events, settled, streamers
from llmops.text.tokenizers import prepare_tokenizer, train_bpe


@pytest.fixture(scope="module")
def served() -> Served:
    """A byte-level BPE trained here (with the scratch chat template) and a random tiny Llama that replies with
    anything but its end token, so that every reply runs to max_new_tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = instruction_records(80, seed=4)
    tokenizer = train_bpe((f"{row['instruction']} {row['output']}" for row in rows), 300)
    prepare_tokenizer(tokenizer, None, trained_here=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=256,
                                         pad_token_id=tokenizer.pad_token_id,
                                         eos_token_id=tokenizer.eos_token_id)).eval()
    model.generation_config.suppress_tokens = [tokenizer.eos_token_id]  # the reply never ends early
    return Served(model=model, tokenizer=tokenizer, labels=None, encoding=Encoding(max_length=128),
                  max_new_tokens=12)


def requests_of(rows: list[dict[str, Any]], served: Served) -> list[Any]:
    objective = LanguageModel.__new__(LanguageModel)  # its predict methods read no record kind
    return [objective.request(line, row, served) for line, row in enumerate(rows, 1)]


def test_each_streamed_row_sends_exactly_the_start_of_its_reply_and_rows_stream_independently(
        served: Served) -> None:
    """Three chats in one generate call, the middle one not streamed: each streamed row's pieces arrive one token
    at a time and join to its final reply (all of it but trailing spaces); the answers are those of no streaming."""
    import dataclasses

    objective = LanguageModel.__new__(LanguageModel)
    rows = [{"messages": [{"role": "user", "content": text}]} for text in ("Name a colour.", "Add two and three.",
                                                                            "What is the capital of France?")]
    requests = requests_of(rows, served)
    plain = objective.answer(served, requests)
    pieces: dict[int, list[str]] = {0: [], 2: []}
    sinks = {id(requests[row]): pieces[row].append for row in pieces}
    streamed = objective.answer(dataclasses.replace(served, streamer=streamers(served.tokenizer, sinks)), requests)
    assert streamed == plain
    for row, sent in pieces.items():
        reply = plain[row]["output"]
        assert len(sent) > 1 and all(sent)
        assert "".join(sent) == settled(reply, strip=True) and reply.startswith("".join(sent))
    assert pieces[0] != pieces[2]


def test_a_continuation_streams_unstripped_and_no_streamer_is_made_where_no_row_streams(served: Served) -> None:
    import dataclasses

    objective = LanguageModel.__new__(LanguageModel)
    requests = requests_of([{"prefix": "Add two"}, {"prefix": "Name a"}], served)
    sent: list[str] = []
    made = streamers(served.tokenizer, {id(requests[1]): sent.append})
    assert made(requests[:1], False) is None and isinstance(made(requests, False), BatchStreamer)
    answers = objective.answer(dataclasses.replace(served, streamer=made), requests)
    continued = answers[1]["output"]
    assert len(sent) > 1 and "".join(sent) == settled(continued, strip=False) and continued.startswith("".join(sent))


def test_a_row_stops_at_its_end_token_and_partial_characters_and_tool_calls_are_held_back(served: Served) -> None:
    tokenizer = served.tokenizer
    one, other = ([] for _ in range(2))
    streamer = BatchStreamer(tokenizer, [one.append, other.append], strip=True)
    first = tokenizer(" a café ☕ done", add_special_tokens=False)["input_ids"]
    second = tokenizer(' Sure <tool_call>{"name": "add"}</tool_call>', add_special_tokens=False)["input_ids"]
    end = tokenizer.eos_token_id
    steps = max(len(first), len(second)) + 2
    first = first[:4] + [end] + [first[5]] * (steps - 5)  # ends after its 4th token; what follows is not its
    second = second + [end] * (steps - len(second))
    streamer.put(torch.tensor([[7, 8], [9, 10]]))  # the prompt
    for step in range(steps):
        streamer.put(torch.tensor([first[step], second[step]]))
    streamer.end()
    assert "".join(one) == settled(tokenizer.decode(first[:4], skip_special_tokens=True), strip=True) != ""
    assert not any("\ufffd" in piece for piece in one + other)
    assert "".join(other) == "Sure"
    # a multi-byte character comes whole, once all of its bytes have come
    whole = tokenizer(" ☕ ok", add_special_tokens=False)["input_ids"]
    sent: list[str] = []
    streamer = BatchStreamer(tokenizer, [sent.append], strip=False)
    streamer.put(torch.tensor([[7]]))
    for token in whole:
        streamer.put(torch.tensor([token]))
    assert len(whole) > 3 and sent[0] == " ☕" and "".join(sent) == " ☕ ok"


@pytest.mark.parametrize(("text", "strip", "expected"), [
    ("  Hello there \n", True, "Hello there"), ("  Hello there \n", False, "  Hello there"),
    ("caf\ufffd", True, "caf"), ("Sure <tool", True, "Sure"), ("Sure <", True, "Sure"),
    ("Sure <tool_call>{", True, "Sure"), ("a < b", True, "a < b"),
])
def test_settled_text_is_what_later_tokens_cannot_change(text: str, strip: bool, expected: str) -> None:
    assert settled(text, strip) == expected


def test_the_events_carry_the_pieces_as_they_arrive_then_the_rest_and_the_finish() -> None:
    """Pieces sent from another thread while the answer runs, then the answer: the client reads the role, each
    piece, the text not yet sent, the finish with the usage and [DONE]; a failed answer is one error event."""
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    failures: list[int] = []

    async def run(fails: bool) -> list[str]:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str] = asyncio.Queue()
        generating = threading.Event()

        def generate() -> None:
            for piece in ("Hello", " there"):
                loop.call_soon_threadsafe(pieces.put_nowait, piece)
            generating.wait(5)

        async def answer() -> dict[str, Any]:
            await asyncio.to_thread(generate)
            if fails:
                raise TimeoutError
            return openai_api.chat_completion("tr-1", "m/1", "Hello there, friend", usage, "stop")

        task = loop.create_task(answer())
        read = []
        async for event in events(True, "tr-1", "m/1", pieces, task, failures.append):
            read.append(event)
            if len(read) == 3:  # both pieces came before the answer was done
                assert not task.done()
                generating.set()
        return read

    read = asyncio.run(run(fails=False))
    chunks = [json.loads(event[6:]) for event in read[:-1]]
    assert read[-1] == "data: [DONE]\n\n"
    assert [chunk["choices"][0]["delta"].get("content") for chunk in chunks] == ["", "Hello", " there", ", friend",
                                                                                 None]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"] == usage
    failed = asyncio.run(run(fails=True))
    assert json.loads(failed[-1][6:])["error"]["code"] == 504 and failures == [504]
