"""`llmops predict`: a registered version's answers for JSONL rows; `llmops serve`: the version behind an
OpenAI-compatible service on Ray Serve that follows its alias (or MLflow's scoring server)."""

from __future__ import annotations

import os
import subprocess
from typing import Annotated

import typer

from llmops.cli.environment import configure_environment
from llmops.cli.io import STDIN, errors, fail, open_rows, write_results
from llmops.cli.pipeline import DEFAULT_CONFIG, ConfigOpt
from llmops.config.schema import TrackingConfig
from llmops.io.errors import UserError
from llmops.objectives import load_config


def predict(
    model: Annotated[str, typer.Argument(help="NAME (its champion), NAME@alias or NAME/VERSION.")],
    input_path: Annotated[str, typer.Option("--input", "-i", help="JSONL rows; - reads standard input.")] = STDIN,
    output: Annotated[str | None, typer.Option("--output", "-o", help="Write the JSONL results to this file "
                                                                     "(default: standard output).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Rows per forward pass.")] = 32,
    config: ConfigOpt = DEFAULT_CONFIG,
) -> None:
    """A registered version's answers for JSONL rows: replies, labels with scores, perplexities, word tags or mask
    fills.

    Rows take the pipeline's shapes: instruction (optional input), messages, text, or tokens (a list of words).
    Results are JSONL, one per row with its line number; a bad row becomes an error row (and the exit code 1).
    """
    configure_environment()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the progress bar here is ours
    from llmops.serving.predict import limits, load, predict_lines

    try:
        source, total = open_rows(input_path)
        loaded = load(model, load_config(config).tracking)
    except UserError as err:
        fail(str(err))
    errors.print(f"[bold]{loaded.name}/{loaded.version}[/] ({model}) on {loaded.device}: {limits(loaded)}",
                 highlight=False, soft_wrap=True)
    with source:
        bad = write_results(predict_lines(loaded, source, batch_size), total, output, errors)
    if bad:
        lines = ", ".join(map(str, bad[:20])) + (", …" if len(bad) > 20 else "")
        errors.print(f"{len(bad)} row{'s' if len(bad) != 1 else ''} could not be predicted (line {lines}): "
                     "error rows in the output", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


Engine = Annotated[str, typer.Option(help="ray: the OpenAI-compatible service on Ray Serve, following the alias; "
                                          "mlflow: MLflow's scoring server for the version named at start.")]


def serve(
    model: Annotated[str, typer.Argument(help="NAME (its champion), NAME@alias or NAME/VERSION.")],
    host: Annotated[str, typer.Option(help="Address to listen on; the default answers this machine only (any "
                                           "other needs an API key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 5001,
    engine: Engine = "ray",
    replicas: Annotated[int, typer.Option(min=1, help="Replicas, each holding the model (ray).")] = 1,
    max_replicas: Annotated[int | None, typer.Option(min=1, help="Autoscale from --replicas up to this many "
                                                                 "(ray).")] = None,
    follow_seconds: Annotated[float, typer.Option(min=0.5, help="How often the alias is looked up (ray).")] = 10.0,
    api_key: Annotated[str | None, typer.Option(envvar="LLMOPS_API_KEY", help="Key every request must send as "
                                                "Authorization: Bearer KEY (ray); required beyond loopback.")] = None,
    queue: Annotated[int, typer.Option(min=1, help="Requests a replica holds, running and waiting; past it 503 "
                                                   "(ray).")] = 64,
    max_wait: Annotated[float, typer.Option(min=0.0, help="Seconds a request may expect to wait for its batch, "
                                                          "from the batches measured; past it 503 with Retry-After, "
                                                          "once two batches are full (ray).")] = 0.5,
    max_batch: Annotated[int, typer.Option(min=1, help="Requests answered in one batch (ray).")] = 16,
    trace_sample: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of requests traced in MLflow "
                                                                       "(ray).")] = 1.0,
    redact: Annotated[bool, typer.Option(help="Traces keep sizes and counts, not the words (ray).")] = False,
    workers: Annotated[int, typer.Option(help="Server processes, each holding the model in memory (mlflow).")] = 1,
    timeout: Annotated[int, typer.Option(min=1, help="Seconds a request may take before it is cut.")] = 120,
    config: ConfigOpt = DEFAULT_CONFIG,
) -> None:
    """Serve a registered version until interrupted.

    On Ray Serve (the default): POST /v1/chat/completions (OpenAI's API, "stream": true too), GET /v1/models,
    POST /v1/predict {"rows": [...]} (the rows `llmops predict` reads, every objective), POST /v1/feedback,
    GET /health and GET /metrics. NAME and NAME@alias follow the alias: a promotion or rollback is served within
    --follow-seconds, without a failed request. --engine mlflow runs MLflow's scoring server instead (POST
    /invocations), for the version the reference names at start.
    """
    configure_environment()
    if engine not in ("ray", "mlflow"):
        fail(f"--engine {engine}: expected ray or mlflow")
    resolved = load_config(config)
    if engine == "mlflow":
        serve_on_mlflow(model, resolved.tracking, host, port, workers, timeout)
    from llmops.serving.ray_app import start_service, stop_service
    from llmops.serving.serve import check_port
    from llmops.serving.service import ServeSettings, check_access
    from llmops.store.settings import resolved_stores

    settings = ServeSettings(reference=model, tracking=resolved_stores(resolved.tracking),
                             follow_seconds=follow_seconds, max_batch=max_batch, queue=queue, max_wait_seconds=max_wait,
                             timeout_seconds=float(timeout), api_key=api_key, trace_sample=trace_sample, redact=redact)
    try:
        check_access(host, api_key)
        check_port(host, port)
    except UserError as err:
        fail(str(err))
    stop_on_sigterm()
    try:  # Ctrl-C or SIGTERM while Ray starts stops it as well as once it serves
        try:
            url = start_service(settings, host, port, replicas, max_replicas, resolved.engine.ray_address())
        except UserError as err:
            fail(str(err))
        errors.print(f"[bold]{model}[/] at {url}/v1 (OpenAI API; /v1/predict for rows, /metrics, /health); "
                     "Ctrl-C stops it", highlight=False, soft_wrap=True)
        wait_for_interrupt()
    except KeyboardInterrupt:
        errors.print("stopping the service", highlight=False)
    finally:
        stop_service()


def stop_on_sigterm() -> None:
    """SIGTERM ends the service as Ctrl-C does."""
    import signal

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def wait_for_interrupt() -> None:
    """Until Ctrl-C or SIGTERM (KeyboardInterrupt)."""
    import time

    while True:
        time.sleep(1)


def serve_on_mlflow(model: str, tracking_config: TrackingConfig, host: str, port: int, workers: int,
                    timeout: int) -> None:
    from llmops.serving.serve import plan_server

    try:
        server = plan_server(model, tracking_config, host, port, workers, timeout)
    except UserError as err:
        fail(str(err))
    example = f"; POST {server.body}" if server.body else ""
    errors.print(f"[bold]{server.name}/{server.version}[/] ({model}) at {server.url}{example}", highlight=False,
                 soft_wrap=True)
    try:
        code = subprocess.run(server.command, env=server.environment, check=False).returncode
    except KeyboardInterrupt:
        code = 0  # the server stops with its terminal's interrupt: a normal end
    raise typer.Exit(code)
