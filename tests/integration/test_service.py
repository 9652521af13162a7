"""The service on a real Ray Serve, asked with the real `openai` client: it answers as `llmops predict` does,
follows its alias to a new version without a failed request, refuses a damaged one and keeps serving, records
feedback on the request's MLflow trace, and answers 503 rather than queueing without end; `llmops monitor` reads its
traffic back, flags drift and exports rated requests as rows."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmops.config.schema import TrackingConfig
from llmops.registry.manifest import MANIFEST_TAG, record_manifest
from llmops.serving.follow import REFUSED_TAG
from llmops.serving.predict import load, predict_lines
from llmops.serving.service import ServeSettings
from llmops.store.settings import resolved_stores
from llmops.tracking import log as tracking

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NAME = "served-sft"
ROWS = [{"instruction": "Name a colour."}, {"messages": [{"role": "user", "content": "What is two plus two?"}]},
        {"question": "not a shape this version reads"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def register_copies(client: Any, config: TrackingConfig, tmp_path: Path) -> None:
    """NAME/1 and NAME/2: copies of the tiny SFT champion (so that a switch shows in the version only), each with
    its file manifest; NAME/3: a copy whose weights were overwritten in the store after registration. Its weights
    still load: only the manifest tells them from the ones registered."""
    import mlflow

    source = client.get_model_version("tiny-sft", "1")
    assert MANIFEST_TAG in source.tags  # registration recorded what its files hash to
    original = Path(mlflow.artifacts.download_artifacts("models:/tiny-sft/1", dst_path=str(tmp_path / "original"),
                                                        tracking_uri=config.tracking_uri,
                                                        registry_uri=config.registry_uri))
    client.create_registered_model(NAME)
    for number in (1, 2, 3):
        copy = shutil.copytree(original, tmp_path / f"copy-{number}")
        client.create_model_version(NAME, source=str(copy), run_id=source.run_id)
        record_manifest(client, NAME, str(number))
        if number == 3:
            weights = next(copy.rglob("*.safetensors"))
            damaged = bytearray(weights.read_bytes())
            damaged[len(damaged) // 2: len(damaged) // 2 + 64] = bytes(64)
            weights.write_bytes(bytes(damaged))
    client.set_registered_model_alias(NAME, "champion", "1")


@pytest.fixture(scope="module")
def service(sft_registry: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, Any]]:
    from llmops.serving.ray_app import start_service, stop_service
    from tests.helpers import workspace_at

    with workspace_at(sft_registry):
        config = resolved_stores(TrackingConfig())
        client = tracking.client(config)
        register_copies(client, config, tmp_path_factory.mktemp("versions"))
        settings = ServeSettings(reference=NAME, tracking=config, follow_seconds=1.0, queue=4, max_batch=4,
                                 timeout_seconds=60.0)
        url = start_service(settings, "127.0.0.1", free_port())
        try:
            yield url, client, config
        finally:
            stop_service()


def chat(url: str, content: str = "What is two plus two?", **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                          **extra}, timeout=120)


@contextmanager
def asking(url: str) -> Iterator[list[tuple[int, str]]]:
    """A client asking in a loop while the block runs: (status, version that answered) of each request."""
    statuses: list[tuple[int, str]] = []
    done = threading.Event()

    def keep_asking() -> None:
        while not done.is_set():
            answer = chat(url)
            statuses.append((answer.status_code, answer.headers.get("x-model-version", "")))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        yield statuses
    finally:
        done.set()
        asker.join(timeout=120)


def test_the_openai_client_gets_the_answers_predict_gives(service: tuple[str, Any, Any]) -> None:
    import mlflow
    import openai

    url, _, config = service
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    raw = api.chat.completions.with_raw_response.create(model=NAME, messages=ROWS[1]["messages"])
    completion = raw.parse()
    assert raw.headers["x-model-version"] == completion.model == f"{NAME}/1"
    assert completion.usage.prompt_tokens > 0 and completion.choices[0].finish_reason in ("stop", "length")
    streamed = api.chat.completions.create(model=NAME, messages=ROWS[1]["messages"], stream=True)
    pieces = [chunk.choices[0].delta.content for chunk in streamed if chunk.choices[0].delta.content]
    assert "".join(pieces) == completion.choices[0].message.content  # (may be one token; see the continuation)
    # a body the stream cannot answer is refused before any stream begins
    refused = chat(url, stream=True, temperature=0.5)
    assert refused.status_code == 400 and "decodes greedily" in refused.json()["error"]["message"]
    assert [model.id for model in api.models.list()] == [f"{NAME}/1"]

    loaded = load(f"{NAME}/1", config)
    expected = list(predict_lines(loaded, [json.dumps(row).encode() for row in ROWS], batch_size=8))
    answered = httpx.post(f"{url}/v1/predict", json={"rows": ROWS}, timeout=120).json()["results"]
    assert [{k: v for k, v in row.items() if k != "excerpt"} for row in expected] == answered
    assert answered[1]["output"] == completion.choices[0].message.content  # the chat is predict's row too

    # a raw prompt is continued without the chat template, as predict continues a prefix row
    text = api.completions.with_raw_response.create(model=NAME, prompt="Write 42 in")
    continued = text.parse()
    (expected_text,) = predict_lines(loaded, [b'{"prefix": "Write 42 in"}'], batch_size=1)
    assert continued.choices[0].text == expected_text["output"] and continued.model == f"{NAME}/1"
    assert text.headers["x-model-version"] == f"{NAME}/1" and continued.usage.prompt_tokens > 0
    pieces = [chunk.choices[0].text for chunk in api.completions.create(model=NAME, prompt="Write 42 in",
                                                                         stream=True)]
    assert "".join(pieces) == expected_text["output"]
    # token by token, not whole once generated: a continuation of 12 tokens comes in several pieces
    assert expected_text["tokens"] > 1 and len([piece for piece in pieces if piece]) > 1

    # feedback lands on the request's trace; an unknown request is 404, a malformed body 400
    feedback = httpx.post(f"{url}/v1/feedback", json={"request_id": completion.id, "score": 0.5}, timeout=60)
    assert feedback.status_code == 200, feedback.text
    mlflow.set_tracking_uri(config.tracking_uri)  # where the replicas trace (each test's own home is elsewhere)
    trace = mlflow.get_trace(completion.id)
    assert trace.data.spans[0].attributes["model_version"] == f"{NAME}/1"
    assert [(a.name, a.value) for a in trace.info.assessments if a.name == "score"] == [("score", 0.5)]
    assert httpx.post(f"{url}/v1/feedback", json={"request_id": "tr-unknown", "label": "good"},
                      timeout=60).status_code == 404
    bad = httpx.post(f"{url}/v1/feedback", json={"request_id": completion.id, "score": "high"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "score: expected int or float"
    metrics = httpx.get(f"{url}/metrics").text
    assert f'llmops_serving_version{{version="{NAME}/1"}} 1.0' in metrics and "llmops_request_seconds_bucket" in metrics


def test_a_promotion_is_followed_without_a_failed_request_and_a_broken_version_is_refused(
        service: tuple[str, Any, Any]) -> None:
    url, client, _ = service
    with asking(url) as statuses:
        client.set_registered_model_alias(NAME, "champion", "2")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(label == f"{NAME}/2" for _, label in statuses):
            time.sleep(0.5)
        client.set_registered_model_alias(NAME, "champion", "3")  # the damaged copy: refused, 2 keeps serving
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and REFUSED_TAG not in client.get_model_version(NAME, "3").tags:
            time.sleep(0.5)
        time.sleep(2)
    assert statuses and {status for status, _ in statuses} == {200}, statuses
    served = [label for _, label in statuses]
    assert served[0] == f"{NAME}/1" and served[-1] == f"{NAME}/2" and f"{NAME}/3" not in served
    assert served == sorted(served)  # never back to an older version
    assert "differs from the manifest it was registered with" in client.get_model_version(NAME, "3").tags[REFUSED_TAG]
    client.set_registered_model_alias(NAME, "champion", "2")


def test_past_its_queue_a_replica_answers_503_with_retry_after(service: tuple[str, Any, Any]) -> None:
    url, _, _ = service
    with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
        answers = list(pool.map(lambda _: chat(url, "Tell me everything about the river. " * 20), range(48)))
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 4 and 503 in statuses, statuses
    refused = [answer for answer in answers if answer.status_code == 503]
    ours = [answer for answer in refused if answer.headers.get("retry-after") == "1"]
    assert ours and all(answer.json()["error"]["message"] == "the service is full; try again shortly"
                        for answer in ours)


def asked_until_traced(config: Any, since: float, count: int) -> dict[str, Any]:
    """The monitor's report once the replicas' background exporter has stored `count` traces since `since`."""
    from llmops.config.schema import PipelineConfig
    from llmops.monitoring.monitor import monitor

    deadline = time.monotonic() + 60
    while True:
        report = monitor(PipelineConfig(tracking=config), NAME, time.time() - since)
        if report["requests"] >= count or time.monotonic() > deadline:
            return report
        time.sleep(1)


def test_monitor_reads_the_traffic_flags_drift_and_exports_rated_requests_as_rows(
        service: tuple[str, Any, Any], sft_registry: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from llmops.cli.app import run
    from llmops.config.schema import PipelineConfig
    from llmops.data.synthetic import instruction_records
    from llmops.monitoring.monitor import export, frozen_rows
    from llmops.registry.gate import FROZEN_MD5, FROZEN_URI
    from tests.helpers import workspace_at

    url, client, config = service
    version = f"{NAME}/{client.get_model_version_by_alias(NAME, 'champion').version}"
    frozen_tags = client.get_registered_model("tiny-sft").tags  # the copies share tiny-sft's frozen set
    for key in (FROZEN_MD5, FROZEN_URI):
        client.set_registered_model_tag(NAME, key, frozen_tags[key])
    time.sleep(2)  # the window starts after the requests of the tests before
    started = time.time()
    questions = [f"{row['instruction']}\n{row['input']}" for row in instruction_records(40, seed=99)]
    answers = [chat(url, question) for question in questions]
    assert {answer.status_code for answer in answers} == {200}
    report = asked_until_traced(config, started, 40)
    figures = report["versions"][version]
    assert report["requests"] == figures["requests"] == 40 and figures["errors"] == 0
    latency = figures["latency_ms"]
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"]
    assert figures["tokens"]["prompt"] > 0 and figures["drift"]["judged"] and not figures["drift"]["drifted"]

    time.sleep(2)
    shifted = time.time()
    for n in range(35):
        assert chat(url, f"Переведи на английский язык длинный абзац номер {n} о реке, мосте и городе.").status_code \
            == 200
    drifted = asked_until_traced(config, shifted, 35)["versions"][version]["drift"]
    assert drifted["drifted"] and drifted["checks"]["scripts"]["drifted"], drifted

    # rated requests become rows: a correction, a preferred answer; a score alone and a frozen question do not
    frozen = frozen_rows(client, NAME)[0]
    leaked = chat(url, f"{frozen['instruction']}\n{frozen.get('input') or ''}".strip())
    ids = [answer.json()["id"] for answer in (*answers[:3], leaked)]
    for request_id, rated in zip(ids, ({"correction": "the corrected answer"}, {"preferred": "a better answer"},
                                       {"score": 1}, {"correction": "an answer to an evaluation question"}),
                                 strict=True):
        assert httpx.post(f"{url}/v1/feedback", json={"request_id": request_id, **rated}, timeout=60).status_code == 200
    exported = export(PipelineConfig(tracking=config), NAME, time.time() - started, tmp_path / "feedback.jsonl")
    assert dict(exported.added) == {"instruction": 1, "preference": 1}
    assert exported.dropped["score only"] == 1
    assert exported.dropped["asked by the frozen evaluation set (contamination)"] == 1
    rows = [json.loads(line) for line in (tmp_path / "feedback.jsonl").read_text().splitlines()]
    assert rows == [{"instruction": questions[0], "input": "", "output": "the corrected answer"}]

    with workspace_at(sft_registry):
        assert run(["monitor", NAME, "--since", "10m", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["requests"] >= 76 and set(printed["latency_ms"]) == {"p50", "p95", "p99"}
    assert sum(figures["requests"] for figures in printed["versions"].values()) == printed["requests"]
    assert printed["mlflow_run_id"] and printed["versions"][version]["drift"]["judged"]


def test_rated_requests_become_data_that_retrains_and_the_service_follows_the_new_champion(
        service: tuple[str, Any, Any], sft_registry: Path, tmp_path: Path) -> None:
    """The loop: serve the champion, users correct its answers, the corrections are exported as rows, the data change
    retrains (from the champion, on the data and the feedback), the gate promotes, and the service follows without
    a failed request."""
    from llmops.config.schema import PipelineConfig
    from llmops.data.synthetic import instruction_records
    from llmops.flows.retrain import retrain_on_data_change
    from llmops.monitoring.monitor import export
    from tests.conftest import REPO
    from tests.helpers import workspace_at

    url, client, config = service
    time.sleep(2)
    started = time.time()
    rows = instruction_records(24, seed=123)
    for row in rows:
        answer = chat(url, f"{row['instruction']}\n{row['input']}")
        assert httpx.post(f"{url}/v1/feedback", json={"request_id": answer.json()["id"], "correction": row["output"]},
                          timeout=60).status_code == 200
    feedback = tmp_path / "feedback.jsonl"
    exported = export(PipelineConfig(tracking=config), NAME, time.time() - started, feedback)
    assert exported.added["instruction"] + exported.dropped["already trained on"] == len(rows)
    assert exported.added["instruction"] >= len(rows) - 4

    with asking(url) as statuses:
        data = sft_registry.parent / "instructions.jsonl"
        with workspace_at(sft_registry):
            result = retrain_on_data_change(str(REPO / "configs" / "tiny_sft_cpu.yaml"), [
                "data.path=null", f"data.sources=[{{path: {data}}}, {{path: {feedback}}}]",
                f"model.name_or_path=models:/{NAME}@champion",
                "train.epochs=1", "train.learning_rate=5e-4", "evaluate.max_examples=20",
                "evaluate.primary_metric=completion_loss", f"register.model_name={NAME}"], settle_seconds=0)
        assert result["retrained"], result
        registration = result["registration"]
        assert registration["alias"] == "champion", registration["reason"]
        new = f"{NAME}/{registration['version']}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(label == new for _, label in statuses):
            time.sleep(0.5)
        time.sleep(1)
    assert statuses and {status for status, _ in statuses} == {200}, statuses
    assert statuses[-1][1] == new
