"""The Prefect API a run talks to: Prefect's embedded server started for it, or the server configured; and the
line that says where a run goes, before it starts.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from llmops.config.schema import PipelineConfig
from llmops.store import settings
from llmops.store.workspace import exclusive


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

    for name, value in settings.MLFLOW_DEFAULTS.items():
        os.environ.setdefault(name, value)
    api = prefect_api_url()
    where = {**settings.describe(config.tracking, config.workspace.remote),
             "Prefect API": settings.mask(api) if api else "ephemeral"}
    logging.getLogger("llmops.run").info(" · ".join(f"{name}: {value}" for name, value in where.items()))
    check_dispatch(config, api)
