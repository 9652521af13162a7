"""Serving throughput: the service on Ray Serve against MLflow's scoring server, an in-process batched generate
loop (the limit of this machine) and a no-op deployment behind the same HTTP path (the limit of the engine).

Each setting runs for `--seconds` with 1, 4, 16 and 64 concurrent clients asking chat completions of the same
prompts, and prints one JSON line: requests/s, generated tokens/s, p50/p95/p99 latency and errors (503s apart:
a refused client waits the Retry-After it is given, as OpenAI's client does). The service runs with its defaults
(`llmops serve`'s), so past saturation it refuses rather than queue; `--max-wait` and `--queue` change them.
The version is `--model` in the workspace LLMOPS_HOME names; by default the default champion, trained first
as `make run` trains it (configs/default.yaml on `llmops data init`'s instructions), in a workspace of the
bench's own.

    python bench/serve_bench.py [--model NAME] [--seconds 20] [--clients 1,4,16,64] [--trace-sample 1.0]
                                [--max-wait 0.5] [--queue 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from _workspace import bench_workspace

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Name a colour.", "What is two plus two?", "Write 42 in words.", "Give a word that rhymes with cat."]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load(ask: Callable[[int], tuple[int, int]], clients: int, seconds: float) -> dict[str, float]:
    """`clients` threads asking in a loop for `seconds`: the figures of what came back."""
    latencies: list[float] = []
    tokens, errors, refused = [0], [0], [0]
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(number: int) -> None:
        asked = number
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                status, generated = ask(asked)
            except Exception:  # a dropped connection is an error of the setting, counted
                status, generated = 0, 0
            with lock:
                if status == 200:
                    latencies.append(time.perf_counter() - started)
                    tokens[0] += generated
                elif status == 503:
                    refused[0] += 1
                else:
                    errors[0] += 1
            asked += clients

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ordered = sorted(latencies) or [float("nan")]

    def pct(share: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(share * len(ordered)))], 1)

    return {"clients": clients, "requests_per_s": round(len(latencies) / seconds, 1),
            "tokens_per_s": round(tokens[0] / seconds, 1), "p50_ms": pct(0.5), "p95_ms": pct(0.95),
            "p99_ms": pct(0.99), "errors": errors[0], "refused_503": refused[0]}


def chat_asker(url: str) -> Callable[[int], tuple[int, int]]:
    import httpx

    http = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=128))

    def ask(number: int) -> tuple[int, int]:
        body = {"messages": [{"role": "user", "content": PROMPTS[number % len(PROMPTS)]}]}
        answer = http.post(f"{url}/v1/chat/completions", json=body)
        if answer.status_code == 503:
            time.sleep(float(answer.headers.get("retry-after", 1)))
        usage = answer.json().get("usage", {}) if answer.status_code == 200 else {}
        return answer.status_code, usage.get("completion_tokens", 0)

    return ask


def mlflow_asker(url: str) -> Callable[[int], tuple[int, int]]:
    import httpx

    http = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=128))

    def ask(number: int) -> tuple[int, int]:
        body = {"messages": [{"role": "user", "content": PROMPTS[number % len(PROMPTS)]}]}
        answer = http.post(f"{url}/invocations", json=body)
        usage = answer.json()[0].get("usage", {}) if answer.status_code == 200 else {}
        return answer.status_code, usage.get("completion_tokens", 0)

    return ask


def in_process_loop(model: str, seconds: float, batch: int) -> dict[str, float]:
    """Greedy generation in this process, batches of `batch` prompts: no HTTP, no engine."""
    from llmops.config.schema import TrackingConfig
    from llmops.objectives.language import generate
    from llmops.serving.predict import load as load_version

    loaded = load_version(model, TrackingConfig())
    served = loaded.served
    answered = tokens = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        # the prompts in turn, as the clients ask them: a batch of one is not always the first prompt
        prompts = [[{"role": "user", "content": PROMPTS[(answered + i) % len(PROMPTS)]}] for i in range(batch)]
        _, lengths, _ = generate(served.model, served.tokenizer, prompts, served.max_new_tokens, batch)
        answered += batch
        tokens += sum(lengths)
    return {"setting": "in_process_generate", "batch": batch, "requests_per_s": round(answered / seconds, 1),
            "tokens_per_s": round(tokens / seconds, 1)}


def noop_ceiling(base: str, seconds: float, clients: int) -> dict[str, float]:
    """A deployment that answers at once, batched as the service is, behind the same ingress (HAProxy or Ray's
    proxy)."""
    from fastapi import FastAPI
    from ray import serve

    app = FastAPI()

    @serve.deployment(max_ongoing_requests=256)
    @serve.ingress(app)
    class Noop:
        @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
        async def batch(self, items: list[int]) -> list[int]:
            return items

        @app.post("/v1/chat/completions")
        async def chat(self) -> dict:
            await self.batch(1)
            return {"usage": {"completion_tokens": 0}}

    serve.run(Noop.bind(), name="noop", route_prefix="/noop", blocking=False)
    return load(chat_asker(f"{base}/noop"), clients, seconds)


def trained_model() -> str:
    """The default champion (configs/default.yaml on the instructions `llmops data init` writes), trained and
    registered in the bench's workspace."""
    from llmops.data.synthetic import DEFAULT_ROWS, DEFAULT_SEED, instruction_records
    from llmops.io.files import write_jsonl

    data = Path(os.environ["LLMOPS_HOME"]).parent / "instructions.jsonl"
    write_jsonl(data, instruction_records(DEFAULT_ROWS, DEFAULT_SEED))
    subprocess.run([sys.executable, "-m", "llmops.cli.app", "run", str(REPO / "configs" / "default.yaml"),
                    f"data.path={data}", "register.model_name=bench-served", "--force"], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    return "bench-served"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a registered version in LLMOPS_HOME's registry")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--trace-sample", type=float, default=1.0,
                        help="the share of requests the service traces (its default: every one)")
    parser.add_argument("--max-wait", type=float, default=None, help="the service's --max-wait (its default)")
    parser.add_argument("--queue", type=int, default=None, help="the service's --queue (its default)")
    args = parser.parse_args()
    if args.model is None:
        bench_workspace()
    model = args.model or trained_model()
    levels = [int(n) for n in args.clients.split(",")]

    from llmops.config.schema import TrackingConfig
    from llmops.serving.ray_app import start_service, stop_service
    from llmops.serving.service import ServeSettings
    from llmops.store.settings import resolved_stores

    tracking = resolved_stores(TrackingConfig())
    started = time.perf_counter()
    limits = {name: value for name, value in (("max_wait_seconds", args.max_wait), ("queue", args.queue))
              if value is not None}
    base = start_service(ServeSettings(reference=model, tracking=tracking, trace_sample=args.trace_sample, **limits),
                         "127.0.0.1", free_port())
    print(json.dumps({"setting": "ray_serve_start", "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    try:
        for clients in levels:
            print(json.dumps({"setting": "ray_serve", "trace_sample": args.trace_sample, **limits,
                              **load(chat_asker(base), clients, args.seconds)}), flush=True)
        for clients in levels:
            print(json.dumps({"setting": "noop_deployment", **noop_ceiling(base, args.seconds, clients)}), flush=True)
    finally:
        stop_service()

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llmops.cli.app", "serve", model, "--engine", "mlflow",
                               "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        import httpx

        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ping", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        for clients in levels:
            print(json.dumps({"setting": "mlflow_scoring_server", **load(mlflow_asker(url), clients, args.seconds)}),
                  flush=True)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    for batch in (1, 16):
        print(json.dumps(in_process_loop(model, args.seconds, batch)), flush=True)


if __name__ == "__main__":
    main()
