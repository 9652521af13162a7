"""Tool data through the chat template: tools rendered, loss on the assistant's calls and answers, never on results."""

import json
from pathlib import Path

import pytest

from llmops.config.schema import DataConfig, PipelineConfig, TokenizeConfig
from llmops.io.errors import UserError
from llmops.objectives import selected
from llmops.text.encoding import IGNORE_INDEX
from llmops.text.templates import TemplateError
from llmops.text.tokenizers import prepare_tokenizer, train_bpe
from tests.helpers import project_at, stage

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
ROW = {"tools": json.dumps(TOOLS), "messages": [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": json.dumps([{"name": "calculator",
                                                                   "arguments": {"expression": "2+3"}}])},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5."}]}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def tokenizer(template: str | None = None, trained_here: bool = True):
    made = train_bpe([f"row {i}: what is {i}+{i * 3}? it is {i * 4}. calculator expression" for i in range(60)], 300)
    prepare_tokenizer(made, template, trained_here=trained_here)
    return made


def test_the_built_in_template_renders_tools_and_a_plain_chat_as_before() -> None:
    from llmops.records.conversations import CHAT
    from llmops.text.templates import render

    made = tokenizer()
    text = render(made, CHAT.conversation(ROW), tools=CHAT.tools(ROW))
    assert text == ("<|system|>\ncalculator(expression: string) Evaluate arithmetic.\n<|end|>\n"
                    f"<|user|>\nWhat is 2+3?<|end|>\n<|assistant|>\n{CALL}<|end|>\n"
                    "<|tool|>\n5<|end|>\n<|assistant|>\nIt is 5.<|end|>\n")
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert render(made, plain) == "<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n"


def test_labels_fall_on_the_call_and_the_answer_token_by_token_never_on_tools_or_results() -> None:
    from llmops.objectives.base import Encoding

    made = tokenizer()
    sft = selected(DataConfig(kind="chat"))
    encoded = sft.encode(made, [ROW], Encoding(max_length=512))
    ids, labels = encoded["input_ids"][0], encoded["labels"][0]
    text = made.decode(ids)
    # the trained spans, found in the text by hand: each assistant turn from its first character through <|end|>
    call_start = text.index(CALL)
    answer_start = text.index("It is 5.")
    spans = [(call_start, call_start + len(CALL + "<|end|>")), (answer_start, answer_start + len("It is 5.<|end|>"))]
    offsets = made(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert len(offsets) == len(ids)
    for index, (start, end) in enumerate(offsets):
        inside = any(low <= start and end <= high for low, high in spans)
        assert (labels[index] != IGNORE_INDEX) == inside, (index, text[start:end])
        assert labels[index] in (IGNORE_INDEX, ids[index])
    trained = made.decode([token for token, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert trained == f"{CALL}<|end|>It is 5.<|end|>"


def test_a_template_that_drops_tools_is_one_error_naming_it() -> None:
    from llmops.objectives.base import Encoding

    sft = selected(DataConfig(kind="chat"))
    plain = tokenizer(trained_here=False)  # a pretrained tokenizer without a template gets the plain one
    with pytest.raises(TemplateError, match="leaves out the tools' definitions"):
        sft.encode(plain, [ROW], Encoding(max_length=512))
    own = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if tools %}{{ tools }}{% endif %}"
    with pytest.raises(TemplateError, match="leaves out an assistant turn's tool_calls"):
        sft.encode(tokenizer(own), [ROW], Encoding(max_length=512))


def test_tokenize_refuses_a_configured_template_that_drops_tools(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    project_at(tmp_path, monkeypatch)
    rows = []
    for i in range(40):
        row = json.loads(json.dumps(ROW))
        row["messages"][0]["content"] = f"What is {i}+3?"
        row["tools"] = TOOLS
        rows.append(row)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "flat.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    config = PipelineConfig(data=DataConfig(kind="chat", path="chat.jsonl"),
                            tokenize=TokenizeConfig(vocab_size=300, chat_template="flat.jinja"))
    deduped = stage("dedup", config, stage("validate", config, stage("ingest", config)))
    with pytest.raises(UserError) as raised:
        stage("tokenize", config, deduped)
    assert str(raised.value).startswith("tokenize.chat_template (flat.jinja) cannot render tool data: it leaves out "
                                        "the tools' definitions")


def test_tool_call_accuracy_counts_the_right_tool_with_equal_arguments_with_intervals() -> None:
    from llmops.objectives.metrics import Scored
    from llmops.objectives.tool_answers import call_parts

    sft = selected(DataConfig(kind="chat"))
    expected = [("calculator", {"expression": "2+3"})]
    predictions = [CALL,                                                                        # right
                   '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>',  # arguments
                   '<tool_call>{"name": "convert", "arguments": {"expression": "2+3"}}</tool_call>',      # tool
                   "It is 5.",                                                                  # no call
                   '<tool_call>\n{"arguments": {"expression": "2+3"}, "name": "calculator"}\n</tool_call>',  # right
                   "anything"]                                                                  # row without a call
    parts = call_parts(predictions, [expected] * 5 + [None])
    values = Scored(parts, predictions, sft.metrics).values()
    assert values == {"tool_call_accuracy": 2 / 5, "tool_name_accuracy": 3 / 5, "tool_arguments_accuracy": 3 / 5}
    intervals = Scored(parts, predictions, sft.metrics).intervals()
    for name, value in values.items():
        assert 0 <= intervals[name]["low"] <= value <= intervals[name]["high"] <= 1
    assert intervals["tool_call_accuracy"]["low"] < intervals["tool_call_accuracy"]["high"]


def test_held_out_rows_ending_with_a_call_make_tool_call_accuracy_primary_and_are_scored() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from llmops.config.schema import EvaluateConfig
    from llmops.objectives.base import Encoding, ScoringContext

    sft = selected(DataConfig(kind="chat"))
    ending = {**ROW, "messages": ROW["messages"][:2]}
    assert sft.primary(None, [ending, ending, ROW])[0] == "tool_call_accuracy"
    assert sft.primary(None, [ending, ROW, ROW])[0] == "exact_match"
    made = tokenizer()
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(made), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        pad_token_id=made.pad_token_id, eos_token_id=made.eos_token_id)).eval()
    context = ScoringContext(EvaluateConfig(max_new_tokens=4, batch_size=2), Encoding(max_length=256))
    scored = sft.score(model, made, [ending, ROW, ending], context)
    # a random model writes no call: every call row is a miss, and the row ending with an answer is not counted
    assert scored.parts["tool_call_accuracy"].tolist() == [[0.0, 1.0], [0.0, 0.0], [0.0, 1.0]]
    assert scored.values()["tool_call_accuracy"] == 0.0 and "exact_match" in scored.values()


def test_generation_has_room_for_the_longest_held_out_call_whatever_max_new_tokens_says() -> None:
    from llmops.objectives.base import Encoding
    from llmops.objectives.sft import generation_room

    made = tokenizer()
    sft = selected(DataConfig(kind="chat"))
    rows = [{**ROW, "messages": ROW["messages"][:2]}, ROW]
    labels = sft.encode(made, rows, Encoding(max_length=512))["labels"]
    calls = sft.reference_calls(rows)
    call_tokens = len(made(CALL + "<|end|>", add_special_tokens=False)["input_ids"])
    assert call_tokens > 4
    # a call cut short is no call: the room is the call's tokens through its end-of-turn marker, at least
    assert generation_room(4, labels, calls) == call_tokens
    assert generation_room(call_tokens + 10, labels, calls) == call_tokens + 10
    # a row that ends with an answer leaves evaluate.max_new_tokens as it is
    assert calls[1] is None and generation_room(4, labels[1:], calls[1:]) == 4


def test_a_predict_row_with_tools_is_read_as_training_data_is_and_bad_tool_data_is_one_line() -> None:
    from llmops.objectives.base import RowError
    from llmops.objectives.language import chat_prompt

    turns = [{"role": "user", "content": "What is 2+3?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    prompt, tools, reference = chat_prompt(turns, TOOLS)
    assert tools == TOOLS and reference is None
    assert prompt[1]["tool_calls"] == [{"type": "function", "function": {"name": "calculator",
                                                                         "arguments": {"expression": "2+3"}}}]
    prompt, tools, reference = chat_prompt(turns[:2], json.dumps(TOOLS))  # closing call: the reference
    assert reference == CALL and [turn["role"] for turn in prompt] == ["user"]
    shared = [{"from": "human", "value": "2+3?"}, {"from": "function_call", "value": '{"name": "calculator"}'},
              {"from": "observation", "value": "5"}]
    assert chat_prompt(shared, TOOLS)[0][2] == {"role": "tool", "content": "5"}
    with pytest.raises(RowError, match="^messages: turn 2 calls 'weather', which is not declared in tools"):
        chat_prompt([turns[0], {"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "weather", "arguments": "{}"}}]}, turns[2]], TOOLS)
    with pytest.raises(RowError, match="the prompt must end with a user turn or a tool's result"):
        chat_prompt([turns[0], {"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "hi"}])
