"""Tool-calling chat SFT end to end on CPU, from the shipped tiny config and the data `llmops data init` writes: the
trained model makes right calls where its untrained start makes none, on held-out rows that end with a call,
and `llmops predict` answers a row with tools with a call in OpenAI's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmops.data.synthetic import example_data
from llmops.data.synthetic_tools import TOOLS
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.serving import predict
from tests.helpers import run_all_stages
from tests.sources import REPO

pytestmark = pytest.mark.slow


def test_tool_calling_sft_beats_its_untrained_model_on_tool_call_accuracy(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "tools.jsonl", example_data()["data/tools.jsonl"]())
    config = load_config(REPO / "configs" / "tiny_tools_cpu.yaml", [f"data.path={tmp_path / 'tools.jsonl'}"])
    records = run_all_stages(config, "tools")
    figures = records["evaluate"].figures
    trained, untrained = figures.metrics["trained"], figures.metrics["untrained"]
    print(f"\ntool calling, {figures.examples} held-out rows: tool_call_accuracy {untrained['tool_call_accuracy']:.3f}"
          f" -> {trained['tool_call_accuracy']:.3f} (name {trained['tool_name_accuracy']:.3f}, arguments "
          f"{trained['tool_arguments_accuracy']:.3f}); interval {figures.intervals['trained']['tool_call_accuracy']}")
    assert figures.primary_metric == "tool_call_accuracy"
    assert untrained["tool_call_accuracy"] == 0.0 and untrained["tool_name_accuracy"] == 0.0
    # the tools are learned first, then copying the arguments from the question (about 0.1 after 8 tiny epochs)
    assert trained["tool_name_accuracy"] >= 0.9 and trained["tool_call_accuracy"] > untrained["tool_call_accuracy"]
    assert figures.gain_over_baseline["tool_call_accuracy"]["low"] > 0
    assert records["register"].alias == "champion"
    loaded = predict.load(config.registry.model_name, config.tracking)
    rows = [{"tools": TOOLS, "messages": [{"role": "user", "content": "What is 12 * 34?"}]},
            {"tools": TOOLS, "messages": [{"role": "user", "content": "Convert 5 km to mi."}]}]
    answers = list(predict.predict_lines(loaded, [json.dumps(row).encode() for row in rows], batch_size=8))
    calls = [answer["tool_calls"][0] for answer in answers]
    assert [call["type"] for call in calls] == ["function", "function"]
    assert [call["function"]["name"] for call in calls] == ["calculator", "convert_units"]
    assert isinstance(json.loads(calls[0]["function"]["arguments"]), dict)
