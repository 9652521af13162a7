"""A registered version answers MLflow's own clients as it answers `llmops predict` (slow): a pyfunc client and the
`mlflow models serve` REST server that `llmops serve` starts, on held-out rows, for the default (instruction SFT)
model as a chat model and for every other objective with a labelled or generated output."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.data.synthetic import (
    classification_records,
    entity_records,
    instruction_records,
    pair_records,
    preference_records,
    qa_records,
    text_records,
    words_task,
)
from llmops.io.files import write_jsonl
from llmops.io.tables import table_rows
from llmops.records.conversations import prompt_messages
from tests.conftest import tiny_config
from tests.helpers import run_all_stages, workspace_at
from tests.sources import REPO

pytestmark = pytest.mark.slow
DEFAULT = REPO / "configs" / "default.yaml"
ROWS = 12


def trained(registry: Path, config: Any, name: str) -> dict[str, Any]:
    with workspace_at(registry):
        return run_all_stages(config, name)


def held_out(records: dict[str, Any], rows: int = ROWS) -> list[dict[str, Any]]:
    return list(table_rows(records["dedup"].dir / "eval"))[:rows]


def predicted(model: str, rows: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """`llmops predict`'s answers, without their line numbers."""
    write_jsonl(folder / "rows.jsonl", rows)
    result = CliRunner().invoke(app, ["predict", model, "-i", str(folder / "rows.jsonl"), "-b", str(len(rows)),
                                      "-c", str(DEFAULT)])
    assert result.exit_code == 0, result.output
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [answer.pop("line") for answer in answers] == list(range(1, len(rows) + 1))
    return answers


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@contextmanager
def served(model: str, registry: Path) -> Iterator[str]:
    """`llmops serve MODEL --engine mlflow` as a user starts it, on a free loopback port; yields its /invocations
    URL once /ping answers, and stops it (the whole process group: the server's workers too)."""
    port = free_port()
    environment = {**os.environ, "LLMOPS_HOME": str(registry)}
    process = subprocess.Popen([sys.executable, "-m", "llmops.cli.app", "serve", model, "--engine", "mlflow",
                                "--port", str(port), "-c", str(DEFAULT)], env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "the server did not answer /ping within 180 s"
                time.sleep(1)
        yield f"http://127.0.0.1:{port}/invocations"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


# --- the default model as a chat model -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_model(registry: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The default config's objective (instruction SFT on the shipped generator's instructions) at the tiny SFT
    config's size, which CI trains in a minute."""
    data = tmp_path_factory.mktemp("default") / "instructions.jsonl"
    write_jsonl(data, instruction_records(1500, seed=7))
    return trained(registry, tiny_config("tiny_sft_cpu.yaml", data, "register.model_name=llmops-clients"),
                   "clients-default")


def test_default_model_answers_chat_messages_through_pyfunc_and_the_rest_server(
        default_model: dict[str, Any], in_registry: Path, tmp_path: Path) -> None:
    import mlflow

    rows = held_out(default_model)
    answers = [a["output"] for a in predicted("llmops-clients@champion", [
        {"instruction": r["instruction"], "input": r["input"]} for r in rows], tmp_path)]
    exact = sum(answer == row["output"] for answer, row in zip(answers, rows, strict=True))
    print(f"\nllmops predict: {exact}/{len(rows)} held-out instructions answered exactly")
    assert exact >= 2, answers  # a trained model: the comparison below is between real answers

    chat = mlflow.pyfunc.load_model("models:/llmops-clients@champion")
    replies = [chat.predict({"messages": prompt_messages(row)})[0] for row in rows]
    assert all(reply["object"] == "chat.completion" for reply in replies)
    assert [reply["choices"][0]["message"]["content"] for reply in replies] == answers

    with served("llmops-clients", in_registry) as url:
        served_replies = [post(url, {"messages": prompt_messages(row)}) for row in rows]
        refused = urllib.request.Request(url, data=b'{"inputs": ["Write 1990-05-12 in words."]}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as raw_prompt:
            urllib.request.urlopen(refused, timeout=60)
    # the server answers a request with its list of completions, as the pyfunc does
    assert [reply[0]["choices"][0]["message"]["content"] for reply in served_replies] == answers
    assert raw_prompt.value.code == 400  # a bare prompt is refused, not answered without the chat template


# --- the other objectives: one case each -----------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    config: str
    data: Callable[[], list[dict[str, Any]]]
    # a held-out row as `llmops predict` reads it, and as MLflow's client for the version takes it
    request: Callable[[dict[str, Any]], dict[str, Any]]
    client: Callable[[dict[str, Any]], Any]
    # the client's answer reduced to what `llmops predict` answers, and that answer reduced alike
    agree: Callable[[Any, dict[str, Any]], tuple[Any, Any]]
    overrides: tuple[str, ...] = ()


def mask_second_word(text: str, mask: str) -> str:
    words = text.split(" ")
    return " ".join([words[0], mask, *words[2:]])


def as_rows(answer: Any) -> Any:
    return answer.to_dict(orient="records") if hasattr(answer, "to_dict") else answer


def same_label(client: dict[str, Any], ours: dict[str, Any]) -> tuple[Any, Any]:
    return (client["label"], round(client["score"], 5)), (ours["label"], round(ours["scores"][ours["label"]], 5))


def same_fill(client: str, ours: dict[str, Any]) -> tuple[Any, Any]:
    return client.strip(), ours["masks"][0]["fills"][0]["token"].strip()


def same_answer(client: dict[str, Any], ours: dict[str, Any]) -> tuple[Any, Any]:
    return client, ours


# the fill-mask pipeline reads the tokenizer's own mask token; `llmops predict` also reads [MASK]
MASK = "<|mask|>"
CASES = {
    "classification": Case("tiny_classify_cpu.yaml", lambda: classification_records(600, seed=3),
                           lambda row: {"text": row["text"]}, lambda row: row["text"], same_label),
    "tagging": Case("tiny_tokens_cpu.yaml", lambda: entity_records(800, seed=7), lambda row: {"tokens": row["tokens"]},
                    lambda row: {"tokens": row["tokens"]}, same_answer),
    "seq2seq": Case("tiny_seq2seq_cpu.yaml", lambda: pair_records(words_task, 800, seed=7),
                    lambda row: {"source": row["source"]}, lambda row: {"source": row["source"]}, same_answer,
                    ("train.max_steps=60",)),
    "masked_lm": Case("tiny_mlm_cpu.yaml", lambda: text_records(800, seed=5),
                      lambda row: {"text": mask_second_word(row["text"], "[MASK]")},
                      lambda row: mask_second_word(row["text"], MASK), same_fill),
    "qa": Case("tiny_qa_cpu.yaml", lambda: qa_records(500, seed=21),
               lambda row: {"question": row["question"], "context": row["context"]},
               lambda row: {"question": row["question"], "context": row["context"]}, same_answer,
               ("train.max_steps=80",)),
    "reward": Case("tiny_reward_cpu.yaml", lambda: preference_records(600, seed=3),
                   lambda row: {"prompt": row["prompt"], "response": row["chosen"]},
                   lambda row: {"prompt": row["prompt"], "response": row["chosen"]}, same_answer,
                   ("train.max_steps=30",)),
}


@pytest.mark.parametrize("objective", list(CASES))
def test_pyfunc_and_rest_clients_answer_as_llmops_predict(objective: str, registry: Path, in_registry: Path,
                                                          tmp_path: Path) -> None:
    import mlflow

    case = CASES[objective]
    write_jsonl(tmp_path / "data.jsonl", case.data())
    name = f"llmops-clients-{objective.replace('_', '-')}"
    # the clients are compared on a handful of rows, so the run evaluates no more than that
    records = trained(registry, tiny_config(case.config, tmp_path / "data.jsonl", f"register.model_name={name}",
                                            f"evaluate.max_examples={ROWS}", *case.overrides), f"clients-{objective}")
    rows, version = held_out(records), f"{name}/{records['register'].version}"
    ours = predicted(version, [case.request(row) for row in rows], tmp_path)
    # answers that differ from row to row: agreeing on them says more than agreeing on one constant answer
    assert len({json.dumps(answer, sort_keys=True) for answer in ours}) > 1, ours

    requests = [case.client(row) for row in rows]
    pyfunc = as_rows(mlflow.pyfunc.load_model(f"models:/{version}").predict(requests))
    agreed = [case.agree(client, answer) for client, answer in zip(pyfunc, ours, strict=True)]
    assert [client for client, _ in agreed] == [answer for _, answer in agreed]

    with served(version, in_registry) as url:
        rest = post(url, {"inputs": requests})["predictions"]
    assert as_rows(rest) == json.loads(json.dumps(pyfunc))
