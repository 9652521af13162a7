"""Process settings for a run: state under the workspace, quiet libraries, no telemetry.

Called by the CLI before Prefect or MLflow are imported; values already set by the user win. The
Prefect API a run talks to, and its announcement, are flows/api.py's.
"""

from __future__ import annotations

import glob
import logging
import os
import warnings
from pathlib import Path

from llmops.store import settings
from llmops.store.workspace import home


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
        **settings.MLFLOW_DEFAULTS,
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
