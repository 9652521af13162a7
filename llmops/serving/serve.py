"""Serve: a registered version behind MLflow's own scoring server (`mlflow models serve`).

The version is the one its reference names when the server starts (an alias is resolved to its
number first, so a later promotion does not change what a running server answers), served from
the registry with this environment's packages (`--env-manager local`: the ones that trained it).
Defaults are safe for a laptop: loopback only, one worker. The request body is the version's
flavor's (registry/flavors.py; its objective's `serving_body` is an example): a chat or
instruction model takes OpenAI-style `{"messages": [...]}` and answers a chat completion; a
classifier, masked LM or causal LM takes `{"inputs": [texts]}` as its transformers pipeline does;
a seq2seq, QA or tagging version takes `{"inputs": [rows]}`, rows as `llmops predict` reads them.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from llmops.config.schema import TrackingConfig
from llmops.io.errors import UserError
from llmops.registry.loading import objective_of, run_config
from llmops.registry.references import RegistryError, parse_reference, resolve_version
from llmops.store import settings
from llmops.store.settings import mask
from llmops.tracking import log as tracking

LOOPBACK = "127.0.0.1"
PORT = 5001


@dataclass(frozen=True)
class Server:
    """A server about to start: the version it serves, where, an example body, and how it is started."""

    name: str
    version: str
    url: str
    body: str
    command: list[str]
    environment: dict[str, str]


def plan_server(model: str, tracking_config: TrackingConfig, host: str = LOOPBACK, port: int = PORT,
                workers: int = 1, timeout: int = 120) -> Server:
    """The `mlflow models serve` command for the version `model` names (NAME, NAME@alias, NAME/VERSION)."""
    if workers < 1:
        raise UserError(f"--workers {workers}: expected at least 1")
    check_port(host, port)
    mlflow_client = tracking.client(tracking_config)
    version = resolve_version(mlflow_client, parse_reference(model), mask(tracking.tracking_uri(tracking_config)))
    # bare URIs: a URI's user and password travel in MLflow's credential variables, never on a command line
    stores = {"MLFLOW_TRACKING_URI": tracking.use_credentials(tracking.tracking_uri(tracking_config)),
              "MLFLOW_REGISTRY_URI": tracking.use_credentials(settings.registry_uri(tracking_config))}
    environment = {**os.environ, **stores,
                   # MLflow starts `uvicorn` by name: this environment's, even when it is not activated
                   "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                   # a request that runs longer is cut by the scoring server itself
                   "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT": str(timeout)}
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{version.name}/{version.version}",
               "--host", host, "--port", str(port), "--workers", str(workers), "--env-manager", "local"]
    return Server(name=version.name, version=str(version.version), url=f"http://{host}:{port}/invocations",
                  body=example_body(mlflow_client, version.run_id), command=command, environment=environment)


def check_port(host: str, port: int) -> None:
    """A port the server can bind, or one line saying why not (the server's own failure is a page of uvicorn)."""
    if not 0 < port < 65536:
        raise UserError(f"--port {port}: expected a port number from 1 to 65535")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as err:
            raise UserError(f"cannot serve on {host}:{port}: {err.strerror or err}; pass --port to pick another "
                            "port") from None


def example_body(mlflow_client: object, run_id: str | None) -> str:
    """An /invocations body for the version, from the objective its run selected; '' when its run is unreadable."""
    config = run_config(mlflow_client, run_id)
    try:
        return json.dumps(objective_of(config, "").serving_body()) if config else ""
    except RegistryError:
        return ""
