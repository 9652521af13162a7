"""Process settings for a run: state under the workspace, quiet libraries, no telemetry.

Called by the CLI before Prefect or MLflow are imported; values already set by the user win.
"""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import warnings
from pathlib import Path

from llmops.config.schema import PipelineConfig
from llmops.store import settings
from llmops.store.workspace import exclusive, home

# set for every run, in the CLI's process and in a worker's: MLflow writes a run's URL to stdout when the run
# ends, with the tracking URI's password in it
MLFLOW_DEFAULTS = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


def configure_environment(verbose: bool = False) -> Path:
    workspace = home()
    workspace.mkdir(parents=True, exist_ok=True)
    defaults = {
        # the embedded default: Prefect's ephemeral API on a SQLite file in the workspace
        "PREFECT_HOME": str(workspace / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # a busy machine (or another run starting its own API first) can take this long
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        # stage logs reach the Prefect UI too
        "PREFECT_LOGGING_EXTRA_LOGGERS": "llmops",
        # the CLI prints its own progress; Prefect's console lines (and tracebacks) stay in the UI
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "INFO" if verbose else "CRITICAL",
        **MLFLOW_DEFAULTS,
        # a tracking server that stops answering is retried with backoff (0, 2, 4, 8, 16 s), then the run stops:
        # MLflow's own defaults wait minutes
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "5",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
        "MLFLOW_LOGGING_LEVEL": "INFO" if verbose else "WARNING",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "true" if verbose else "false",
        "DO_NOT_TRACK": "1",
        "GIT_PYTHON_REFRESH": "quiet",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "info" if verbose else "error",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "0" if verbose else "1",
        # huggingface_hub sets its own loggers' level when imported: only its variable keeps a card's notes quiet
        "HF_HUB_VERBOSITY": "info" if verbose else "error",
        "DVC_NO_ANALYTICS": "1",
        # Ray Data's execution plans and Ray's start-up lines (pipeline/engine.py applies it to both)
        "RAY_DATA_LOG_LEVEL": "INFO" if verbose else "ERROR",
    }
    if not glob.glob("/dev/nvidia[0-9]*"):
        # no NVIDIA device: DeepSpeed would probe for one and warn on every import
        defaults["DS_ACCELERATOR"] = "cpu"
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    # libraries that set their own loggers when imported (DVC) are quieted where they are used, by this
    os.environ["LLMOPS_VERBOSE"] = "1" if verbose else "0"
    if not verbose:
        warnings.filterwarnings("ignore")
        for noisy in ("mlflow", "great_expectations", "datasets", "dvc", "alembic", "httpx", "huggingface_hub"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    return workspace


def start_embedded_api() -> None:
    """Start Prefect's embedded API server in a session of its own, one process at a time.

    Ctrl-C in a terminal signals the whole foreground process group: the server would die first, and the run
    would then spend minutes retrying to report its end to it. In its own session it outlives the run's
    interrupt, records the flow run as crashed, and is stopped when the command exits. Runs sharing a workspace
    share its SQLite database: started together, their servers would migrate it at once and could pick the same
    port, hence the lock.
    """
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        return  # a Prefect server is configured
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if server.running:
        return
    run_uvicorn = server._run_uvicorn_command

    def detached() -> subprocess.Popen:
        real = subprocess.Popen
        subprocess.Popen = lambda *args, **kwargs: real(  # type: ignore[misc]
            *args, start_new_session=True, preexec_fn=die_with_parent, **kwargs)
        try:
            return run_uvicorn()
        finally:
            subprocess.Popen = real  # type: ignore[misc]

    server._run_uvicorn_command = detached  # type: ignore[method-assign]
    prefect_home = Path(os.environ["PREFECT_HOME"])
    prefect_home.mkdir(parents=True, exist_ok=True)
    with exclusive(prefect_home / "ephemeral-server.lock"):
        server.start()


def die_with_parent() -> None:
    """In the server's process, before it starts: end it when the command that started it dies, even by SIGKILL
    (Linux; elsewhere a killed command leaves its server to the next run's port search)."""
    import signal
    import sys

    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def prefect_api_url() -> str | None:
    """The Prefect server this process talks to (PREFECT_API_URL, or the active profile's); None: the embedded
    ephemeral API."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None


def announce(config: PipelineConfig) -> None:
    """Say where a run goes (credentials masked), and stop it now if a stage cannot be sent where it should go."""
    from llmops.flows.remote import check_dispatch

    for name, value in MLFLOW_DEFAULTS.items():
        os.environ.setdefault(name, value)
    api = prefect_api_url()
    where = {**settings.describe(config.tracking, config.workspace.remote),
             "Prefect API": settings.mask(api) if api else "ephemeral"}
    logging.getLogger("llmops.run").info(" · ".join(f"{name}: {value}" for name, value in where.items()))
    check_dispatch(config, api)
