"""`llmops predict`: a registered version's answers for JSONL rows; `llmops serve`: the version behind MLflow's
scoring server."""

from __future__ import annotations

import os
import subprocess
from typing import Annotated

import typer

from llmops.cli.io import STDIN, errors, fail, open_rows, write_results
from llmops.cli.pipeline import DEFAULT_CONFIG, ConfigOpt
from llmops.flows.environment import configure_environment
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


def serve(
    model: Annotated[str, typer.Argument(help="NAME (its champion), NAME@alias or NAME/VERSION.")],
    host: Annotated[str, typer.Option(help="Address to listen on; the default answers this machine only.")] =
        "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 5001,
    workers: Annotated[int, typer.Option(help="Server processes, each holding the model in memory.")] = 1,
    timeout: Annotated[int, typer.Option(min=1, help="Seconds a request may take before the server cuts it.")] = 120,
    config: ConfigOpt = DEFAULT_CONFIG,
) -> None:
    """Serve a registered version with MLflow's scoring server (`mlflow models serve`) until interrupted.

    POST /invocations. A chat or instruction model takes OpenAI-style {"messages": ...} and answers a chat
    completion. A classifier, masked LM or causal LM takes {"inputs": ...}, a list of texts. A seq2seq, QA or
    tagging model takes {"inputs": ...}, a list of rows as `llmops predict` reads them. GET /ping answers once the
    model is loaded.
    """
    configure_environment()
    from llmops.serving.serve import plan_server

    try:
        server = plan_server(model, load_config(config).tracking, host, port, workers, timeout)
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
