"""The team stack end to end, without Docker, every component real and on loopback.

The services of docker/compose.yaml, each started with the command and environment that Compose resolves from
the file (tests/integration/compose_stack.py): a Prefect server on its PostgreSQL database, with its login; an
MLflow server whose backend store is PostgreSQL (pgserver standing in for the postgres service, through the
driver the team extra installs) and whose artifacts go to S3 (moto's server standing in for the object store,
with the buckets compose creates), which also holds the DVC remote and the team's shared artifact store; the
two workers, on the `cpu` and `gpu` pools (the gpu one trains on CPU here), through the images' entry point;
deployments created by `llmops deploy` from prefect.yaml. A teammate pushes changed data: the event starts the pipeline
on the cpu worker, which sends training to the gpu worker and registers the model; the same event
again registers nothing; compose's model service follows the champion in the team's registry (the openai client,
with the service's API key) through a version promoted by hand and rolled back.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import boto3
import httpx
import psycopg
import pytest
import yaml
from mlflow import MlflowClient

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from llmops.registry.aliases import history
from tests.integration.compose_stack import (
    LoopbackStack,
    compose_services,
    created_buckets,
    image_copy,
    start_mlflow_server,
    start_model_service,
    start_postgres,
    start_prefect_server,
    start_worker,
)
from tests.integration.stack import BIN, GIT_IDENTITY, Processes, free_port, moto_s3, run, team_repository, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# the model compose's serve service follows by default (LLMOPS_SERVE_MODEL)
MODEL = "llmops-default"
EVENT = "llmops.data.updated"
# the team's pipeline config: tiny, training on the gpu pool, artifacts shared through S3
TEAM_CONFIG = {
    "data": {"path": "data/instructions.jsonl", "kind": "instruction"},
    "tokenize": {"vocab_size": 320, "max_length": 48},
    "model": {"architecture": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2},
    "train": {"max_steps": 40, "batch_size": 32, "learning_rate": 5.0e-3, "logging_steps": 10},
    "launch": {"work_pool": "gpu"},
    # 40 steps lower the loss on the answers long before they make exact matches: the gate judges by that loss
    "evaluate": {"max_examples": 20, "max_new_tokens": 12, "primary_metric": "completion_loss"},
    "register": {"model_name": MODEL},
    # the team's own bucket on the object store, beside the two compose creates
    "workspace": {"remote": "s3://artifacts/team"},
}
FLOW_RUN_SECONDS = 480  # generous: a loaded 2-core machine is several times slower than an idle one
# the CLI of the clone it runs in (python -m puts the working directory first on the path)
LLMOPS = [sys.executable, "-m", "llmops.cli.app"]


def flow_runs(api: httpx.Client, flow_name: str) -> list[dict]:
    body = {"flows": {"name": {"any_": [flow_name]}}, "sort": "START_TIME_ASC"}
    return api.post("flow_runs/filter", json=body).json()


def wait_for_runs(api: httpx.Client, flow_name: str, count: int, processes: Processes) -> list[dict]:
    """The flow's runs, once `count` of them have reached a final state."""
    deadline = time.monotonic() + FLOW_RUN_SECONDS
    while time.monotonic() < deadline:
        runs = flow_runs(api, flow_name)
        done = [r for r in runs if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")]
        if len(done) >= count:
            failed = [r for r in done if r["state_type"] != "COMPLETED"]
            assert not failed, f"{failed[0]['state']}\n{processes.logs()}"
            return runs
        time.sleep(1)
    states = [(r["name"], r["state_type"]) for r in flow_runs(api, flow_name)]
    raise AssertionError(f"{count} run(s) of {flow_name} did not finish in {FLOW_RUN_SECONDS}s; its runs: {states}\n"
                         f"{processes.logs()}")


def wait_for_log(api: httpx.Client, flow_run_id: str, text: str, seconds: float = 60) -> None:
    """A flow run's logs reach the API in batches, possibly after its final state: wait for the line."""
    body = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}
    deadline = time.monotonic() + seconds
    while True:
        lines = [entry["message"] for entry in api.post("logs/filter", json=body).json()]
        if any(text in line for line in lines):
            return
        assert time.monotonic() < deadline, f"no log line {text!r} in {lines}"
        time.sleep(1)


def sent_events(output: str) -> list[str]:
    """The ids of the llmops.data.updated events a `llmops data` command says it sent."""
    return [line.split()[2] for line in output.splitlines() if line.startswith(f"event {EVENT} ")]


def test_changed_data_retrains_on_the_team_stack(tmp_path: Path) -> None:
    started = time.monotonic()
    processes = Processes(tmp_path)
    # docker/.env names the team's repository, which team_repository makes below
    services = compose_services(tmp_path, (tmp_path / "origin.git").as_uri())
    with moto_s3(*created_buckets(services), "artifacts") as s3:
        pg = start_postgres(tmp_path, services["postgres"])
        stack = LoopbackStack(services, s3, pg, mlflow_port=free_port(), prefect_port=free_port())
        # what every process here starts from: this environment's tools, none of the test session's settings
        base = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
        base.pop("PYTHONPATH", None)  # every process runs the code of its own clone of the team's repository
        for name in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "LLMOPS_HOME", "PREFECT_HOME"):
            base.pop(name, None)
        # a client of the stack on the host: the settings compose gives its services, on loopback
        team = {**base, **stack.environment("worker-cpu")}
        api = httpx.Client(base_url=f"{stack.prefect_api}/", auth=tuple(team["PREFECT_API_AUTH_STRING"].split(":", 1)),
                           timeout=10)
        try:
            # no schedule runs in the test: only the event starts the retraining
            prefect_process = start_prefect_server(processes, stack, {
                **base, "PREFECT_HOME": str(tmp_path / "prefect-server"),
                "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
                "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false"})
            mlflow_process = start_mlflow_server(processes, stack, base)
            mlflow_url = stack.mlflow_url
            origin = team_repository(tmp_path, {**team, "LLMOPS_HOME": str(tmp_path / "seed-home")},
                                     lambda path: write_jsonl(path, instruction_records(rows=800, seed=1)),
                                     team["LLMOPS_DVC_REMOTE"], edit=point_retraining_at_the_team_config)
            assert team["LLMOPS_GIT_REPO"] == origin.as_uri()  # what the workers clone, as docker/.env says
            wait_for(f"{stack.prefect_api}/health", prefect_process)
            wait_for(f"{mlflow_url}/health", mlflow_process)
            assert httpx.post(f"{stack.prefect_api}/flows/filter", json={}, timeout=10).status_code == 401
            stack_up = time.monotonic()

            deployed = run([*LLMOPS, "deploy"], tmp_path / "seed",
                           {**team, "LLMOPS_HOME": str(tmp_path / "seed-home")})
            assert "work pool gpu (process) created" in deployed.stdout
            assert "global concurrency limit gpu: 1 at once" in deployed.stdout
            for pool in ("cpu", "gpu"):
                # each worker with a home of its own (compose shares one volume): the stages meet in the shared store
                home = tmp_path / f"worker-{pool}"
                image = image_copy(tmp_path / "seed", tmp_path / f"image-{pool}")
                start_worker(processes, stack, pool, image, home, {
                    **base, "PREFECT_HOME": str(home / "prefect"),
                    "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "5"})

            md5, events = push_changed_data(tmp_path, origin, team)
            first_event = events[0]
            runs = wait_for_runs(api, "retrain_on_data_change", 1, processes)
            event_to_version = registered_after(mlflow_url, first_event)
            check_first_run(api, runs, md5, first_event["id"])
            check_registry(mlflow_url, stack, team, md5, first_event["id"])
            service = f"http://127.0.0.1:{free_port()}"
            serving = start_model_service(processes, stack, int(service.rpartition(":")[2]), tmp_path / "serve",
                                          base)
            for pool in ("cpu", "gpu"):  # the entry point pulled the data the image's data.dvc pins
                assert (tmp_path / f"image-{pool}" / "data" / "instructions.jsonl").is_file(), processes.logs()
            pipeline_done = time.monotonic()

            # the same event once the debounce window has passed: a run, and no second version. The window opens when
            # the event that fired occurred, which on a loaded machine can be well after its push began, so it is
            # counted from when the last push of the burst returned: an event before the window's end is dropped
            window = 60 - (time.time() - events[-1]["sent_by"])
            if window > 0:
                time.sleep(window + 1)
            repeated = sent_events(run([*LLMOPS, "data", "push"], tmp_path / "teammate",
                                       {**team, "LLMOPS_HOME": str(tmp_path / "teammate-home")}).stdout)
            assert len(repeated) == 1
            runs = wait_for_runs(api, "retrain_on_data_change", 2, processes)
            assert runs[1]["parameters"]["trigger_event_id"] == repeated[0]
            wait_for_log(api, runs[1]["id"], f"version 1 was trained on data md5 {md5}: nothing to retrain")
            registry = MlflowClient(tracking_uri=mlflow_url, registry_uri=mlflow_url)
            versions = registry.search_model_versions(f"name = '{MODEL}'")
            assert [v.version for v in versions] == ["1"]
            wait_for(f"{service}/health", serving, seconds=240)
            key = stack.environment("serve")["LLMOPS_API_KEY"]
            assert served_version(service, key) == f"{MODEL}/1"
            assert httpx.get(f"{service}/v1/models", timeout=30).status_code == 401  # no key, no answer
            check_feedback(service, key, mlflow_url)
            check_rollback(mlflow_url, tmp_path / "teammate", {**team, "LLMOPS_HOME": str(tmp_path / "teammate-home")},
                           lambda: served_version(service, key))

            total = time.monotonic() - started
            print(f"\nteam stack: servers up in {stack_up - started:.0f}s, event -> registered version "
                  f"{event_to_version:.1f}s, first pipeline done at {pipeline_done - started:.0f}s, "
                  f"whole test {total:.0f}s")
        finally:
            api.close()
            processes.stop_all()
            pg.cleanup()


def served_version(service: str, key: str) -> str:
    """The version compose's serve service answers a chat completion with, asked by the openai client."""
    import openai

    api = openai.OpenAI(base_url=f"{service}/v1", api_key=key, max_retries=0, timeout=60)
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Write 42 in words."}])
    return raw.headers["x-model-version"]


def check_feedback(service: str, key: str, mlflow_url: str) -> None:
    """A request's trace reaches the team's MLflow server (on PostgreSQL), and feedback on it is an assessment."""
    headers = {"Authorization": f"Bearer {key}"}
    asked = httpx.post(f"{service}/v1/chat/completions", headers=headers, timeout=60,
                       json={"messages": [{"role": "user", "content": "Write 7 in words."}]})
    assert asked.status_code == 200, asked.text
    trace_id = asked.headers["x-trace-id"]
    rated = httpx.post(f"{service}/v1/feedback", headers=headers, timeout=60, json={"request_id": trace_id, "score": 1})
    assert rated.status_code == 200, rated.text
    trace = MlflowClient(tracking_uri=mlflow_url).get_trace(trace_id)
    assert trace.data.spans[0].attributes["model_version"] == asked.headers["x-model-version"]
    assert [(assessment.name, assessment.feedback.value) for assessment in trace.info.assessments] == [("score", 1)]


def follows_to(label: str, served: Callable[[], str]) -> None:
    """The service answers with `label` within its follow interval (10 s) and a load, no request failing."""
    deadline = time.monotonic() + 60
    while (answered := served()) != label:
        assert time.monotonic() < deadline, f"the service still answers with {answered}, not {label}"
        time.sleep(1)


def check_rollback(mlflow_url: str, checkout: Path, env: dict[str, str], served: Callable[[], str]) -> None:
    """A second version (version 1's weights registered again) promoted by hand, then rolled back: champion is
    version 1 again, both moves are in the alias history with their reasons, and the service followed each."""
    client = MlflowClient(tracking_uri=mlflow_url, registry_uri=mlflow_url)
    first = client.get_model_version(MODEL, "1")
    # the source is the logged model (models:/m-...), which the registry wants named by its id as well
    logged = first.model_id or first.source.removeprefix("models:/")
    second = client.create_model_version(MODEL, first.source, run_id=first.run_id, model_id=logged)
    run([*LLMOPS, "models", "promote", MODEL, str(second.version), "--reason", "checked by hand"], checkout, env)
    assert client.get_model_version_by_alias(MODEL, "champion").version == "2"
    follows_to(f"{MODEL}/2", served)
    run([*LLMOPS, "models", "rollback", MODEL, "--reason", "bad answers"], checkout, env)
    assert client.get_model_version_by_alias(MODEL, "champion").version == "1"
    follows_to(f"{MODEL}/1", served)
    moves = history(client, MODEL)
    assert [(m["action"], m["version"], m["previous"]) for m in moves[-2:]] == [("promote", "2", "1"),
                                                                                 ("rollback", "1", "2")]
    assert moves[-1]["reason"] == "rolled back from version 2: bad answers"


def point_retraining_at_the_team_config(seed: Path) -> None:
    """The team's own config, and its on-data-change deployment pointed at it."""
    (seed / "configs" / "team.yaml").write_text(yaml.safe_dump(TEAM_CONFIG, sort_keys=False))
    spec = yaml.safe_load((seed / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        if deployment["name"] == "on-data-change":
            deployment["parameters"]["config_path"] = "configs/team.yaml"
    (seed / "prefect.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def push_changed_data(root: Path, origin: Path, env: dict[str, str]) -> tuple[str, list[dict]]:
    """A teammate's clone: new data, `llmops data add`, commit and push data.dvc, then `llmops data push` twice
    (a burst of two identical events). Returns the new md5 and the pushes' events."""
    teammate = root / "teammate"
    git_env = {**env, **GIT_IDENTITY, "LLMOPS_HOME": str(root / "teammate-home")}
    run(["git", "clone", "-q", origin.as_uri(), str(teammate)], root, git_env)
    (teammate / "data").mkdir()
    write_jsonl(teammate / "data" / "instructions.jsonl", instruction_records(rows=900, seed=2))
    added = run([*LLMOPS, "data", "add", "data"], teammate, git_env).stdout
    md5 = yaml.safe_load((teammate / "data.dvc").read_text())["outs"][0]["md5"]
    assert md5 in added and len(sent_events(added)) == 1  # pinned, not stored yet: no trigger matches it
    run(["git", "commit", "-qam", "more data"], teammate, git_env)
    run(["git", "push", "-q", "origin", "main"], teammate, git_env)
    events = []
    for _ in range(2):
        sent_at = time.time()
        pushed = run([*LLMOPS, "data", "push"], teammate, git_env).stdout
        events += [{"id": event_id, "sent_at": sent_at, "sent_by": time.time()} for event_id in sent_events(pushed)]
    assert len(events) == 2
    return md5, events


def registered_after(mlflow_url: str, event: dict) -> float:
    """Seconds from sending the event to the version's creation in the registry."""
    version = MlflowClient(tracking_uri=mlflow_url, registry_uri=mlflow_url).get_model_version(MODEL, "1")
    return version.creation_timestamp / 1000 - event["sent_at"]


def check_first_run(api: httpx.Client, runs: list[dict], md5: str, event_id: str) -> None:
    """One run for the burst, on the cpu pool, started with the event's md5; training went to the gpu pool."""
    assert len(runs) == 1, [r["parameters"] for r in runs]
    retrain = runs[0]
    assert retrain["work_pool_name"] == "cpu"
    assert retrain["parameters"]["data_md5"] == md5 and retrain["parameters"]["trigger_event_id"] == event_id
    (pipeline,) = flow_runs(api, "training_pipeline")
    assert pipeline["state_type"] == "COMPLETED" and pipeline["parent_task_run_id"]
    (remote,) = flow_runs(api, "remote_stage")
    assert remote["state_type"] == "COMPLETED" and remote["work_pool_name"] == "gpu"
    assert remote["parameters"]["stage"] == "train" and remote["parameters"]["pool"] == "gpu"
    body = {"flow_runs": {"id": {"any_": [pipeline["id"]]}}}
    tasks = {t["name"].rsplit("-", 1)[0] for t in api.post("task_runs/filter", json=body).json()}
    assert {"ingest", "tokenize", "train", "evaluate", "register"} <= tasks
    limit = api.get("v2/concurrency_limits/gpu").json()
    assert limit["limit"] == 1 and limit["active_slots"] == 0  # held while training, given back after


def check_registry(mlflow_url: str, stack: LoopbackStack, team: dict[str, str], md5: str, event_id: str) -> None:
    """Version 1 in MLflow's Postgres store, champion, tagged with the event; its weights in S3."""
    client = MlflowClient(tracking_uri=mlflow_url, registry_uri=mlflow_url)
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert champion.version == "1"
    assert champion.tags["trigger_event_id"] == event_id and champion.tags["trigger_event"] == EVENT
    assert champion.tags["dvc_data_md5"] == md5
    run_data = client.get_run(champion.run_id).data
    assert run_data.metrics["train/steps"] == 40  # logged by the gpu worker into the pipeline's run
    assert run_data.tags["trigger_event_id"] == event_id
    with psycopg.connect(stack.backend_store()) as connection, connection.cursor() as cursor:
        cursor.execute("SELECT name, version FROM model_versions")
        assert cursor.fetchall() == [(MODEL, 1)]
        cursor.execute("SELECT name, alias, version FROM registered_model_aliases")
        assert cursor.fetchall() == [(MODEL, "champion", 1)]
    bucket = boto3.client("s3", endpoint_url=team["AWS_ENDPOINT_URL"], aws_access_key_id=team["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=team["AWS_SECRET_ACCESS_KEY"], region_name=team["AWS_DEFAULT_REGION"])
    weights = [o["Key"] for o in bucket.list_objects_v2(Bucket=stack.artifacts_bucket())["Contents"]
               if o["Key"].endswith("model.safetensors")]
    assert weights, "the registered weights are not in the S3 artifact store"
    shared = [o["Key"] for o in bucket.list_objects_v2(Bucket="artifacts", Prefix="team/train/")["Contents"]]
    assert any(key.endswith("/model/model.safetensors") for key in shared)
