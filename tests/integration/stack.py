"""Real servers and a team's git repository on loopback, for the tests of the team setup.

Each server is a real process (or, for S3, moto's real HTTP server in a thread) on 127.0.0.1 with
a free port; its output goes to a log file that a failing test prints.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@example.com", "GIT_COMMITTER_NAME": "ci",
                "GIT_COMMITTER_EMAIL": "ci@example.com"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {seconds}s")


class Processes:
    """Processes started for a test, each with its log; all stopped at the end, newest first."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, command: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
        log = (self.root / f"{name}.log").open("w")
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        self.started.append((name, process))
        return process

    def logs(self, tail: int = 60) -> str:
        parts = []
        for name, _ in self.started:
            lines = (self.root / f"{name}.log").read_text(errors="replace").splitlines()
            parts.append(f"--- {name} ---\n" + "\n".join(lines[-tail:]))
        return "\n".join(parts)

    def stop_all(self) -> None:
        """Each process was started in a session of its own: its whole group goes, children included."""
        for _, process in reversed(self.started):
            signal_group(process, signal.SIGTERM)
        for _, process in reversed(self.started):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                signal_group(process, signal.SIGKILL)


def signal_group(process: subprocess.Popen, signum: int) -> None:
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def prefect_server_env(root: Path) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect-server"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    return env


def start_prefect(processes: Processes, env: dict[str, str]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    process = processes.start("prefect-server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                                 "--port", str(port)], env)
    return f"http://127.0.0.1:{port}/api", process


def start_mlflow(processes: Processes, env: dict[str, str], backend: str,
                 artifacts: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    env = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner and its consumer processes
    process = processes.start("mlflow-server", [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                                                str(port), "--backend-store-uri", backend,
                                                "--artifacts-destination", artifacts, "--workers", "1"], env)
    return f"http://127.0.0.1:{port}", process


def postgres(root: Path) -> Any:
    """PostgreSQL from the pgserver wheel, with an empty `mlflow` database; as root it runs the server as its own
    `pgserver` user. It stops, and its folder goes, when the process ends (or at the end of a `with` block)."""
    import pgserver

    server = pgserver.get_server(root / "pg", cleanup_mode="delete")
    server.psql("CREATE DATABASE mlflow;")
    return server


def postgres_backend(server: Any) -> str:
    """The `mlflow` database as an MLflow backend store URI, in the form compose gives MLflow: a bare postgresql://,
    which SQLAlchemy 2.1 connects through psycopg 3 (the team extra)."""
    return server.get_uri("mlflow")


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout}\n{result.stderr}"
    return result


def project_files() -> list[str]:
    """The project as it stands in this checkout: tracked files and new ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    return [name for name in listed if (REPO / name).is_file()]


def fresh_clone(target: Path) -> Path:
    """The project as a new user's clone has it: this checkout's files (no dvc.lock, no workspace) committed in a
    fresh git repository at `target`."""
    for name in project_files():
        if name != "dvc.lock" and not name.startswith(".llmops/"):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)
    git_env = {**os.environ, **GIT_IDENTITY}
    run(["git", "init", "-q"], target, git_env)
    run(["git", "add", "-A"], target, git_env)
    run(["git", "commit", "-qm", "clone"], target, git_env)
    return target


# the CLI of the clone a command runs in (python -m puts the working directory first on the path)
CLONE_CLI = [sys.executable, "-m", "llmops.cli.app"]


@dataclass
class PoolStack:
    """A Prefect server (its scheduler off unless asked), a fresh clone of the project at `root/project`, and the
    environments of a user sending runs from it (`sender_env`) and of process workers running what it sends
    (`worker_env`): each with homes of its own, all with one MLflow store (a sent stage checks that it sees the
    sender's run)."""

    root: Path
    processes: Processes
    api: str
    project: Path
    base: dict[str, str]
    sender_env: dict[str, str]

    def worker_env(self, **settings: str) -> dict[str, str]:
        """A worker's environment: the clone's repository and branch to run, polling every second, and `settings`."""
        branch = run(["git", "rev-parse", "--abbrev-ref", "HEAD"], self.project, self.base).stdout.strip()
        home = self.root / "worker"
        return {**self.base, "LLMOPS_HOME": str(home), "PREFECT_HOME": str(home / "prefect"),
                "LLMOPS_GIT_REPO": self.project.as_uri(), "LLMOPS_GIT_BRANCH": branch,
                "PREFECT_WORKER_QUERY_SECONDS": "1", **settings}

    def start_worker(self, pool: str, *options: str, **settings: str) -> subprocess.Popen:
        """A process worker on `pool` (its log: `worker-<pool>`), with `options` for `prefect worker start`."""
        return self.processes.start(f"worker-{pool}", [str(BIN / "prefect"), "worker", "start", "--pool", pool,
                                                       "--type", "process", *options],
                                    self.worker_env(**settings), cwd=self.root)


@contextmanager
def pool_stack(root: Path, **server_settings: str) -> Iterator[PoolStack]:
    """A PoolStack in `root`, its server answering; a failure prints every process's log; all stop at the end.
    `server_settings` go to the server's environment (a test of schedules turns its scheduler on)."""
    processes = Processes(root)
    try:
        api, server = start_prefect(processes, {**prefect_server_env(root),
                                                "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
                                                **server_settings})
        for folder in ("project", "sender", "worker"):
            (root / folder).mkdir()
        project = fresh_clone(root / "project")
        base = {key: value for key, value in os.environ.items()
                if key not in ("PYTHONPATH", "PREFECT_API_URL", "PREFECT_HOME", "LLMOPS_HOME")}
        base.update({"PREFECT_API_URL": api, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
                     "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
        sender_env = {**base, "LLMOPS_HOME": str(root / "sender"), "PREFECT_HOME": str(root / "sender" / "prefect")}
        wait_for(f"{api}/health", server)
        yield PoolStack(root, processes, api, project, base, sender_env)
    except BaseException:
        print(processes.logs())
        raise
    finally:
        processes.stop_all()


def team_repository(root: Path, env: dict[str, str], write_data, dvc_remote: str,
                    edit=lambda seed: None) -> Path:
    """A bare `origin.git` holding this checkout's code, with data of its own pinned by DVC and pushed to
    `dvc_remote`: what the team's workers clone. `edit(seed)` changes the seed before its first commit."""
    seed = root / "seed"
    for name in project_files():
        target = seed / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    shutil.rmtree(seed / ".llmops", ignore_errors=True)
    git_env = {**env, **GIT_IDENTITY}
    run(["git", "init", "-q", "-b", "main"], seed, git_env)
    (seed / "data").mkdir(exist_ok=True)
    write_data(seed / "data" / "instructions.jsonl")
    run([str(BIN / "dvc"), "remote", "add", "-d", "team", dvc_remote], seed, git_env)
    run([str(BIN / "dvc"), "add", "-q", "data"], seed, git_env)
    run([str(BIN / "dvc"), "push", "-q"], seed, git_env)
    edit(seed)
    run(["git", "add", "-A"], seed, git_env)
    run(["git", "commit", "-qm", "the team's project"], seed, git_env)
    origin = root / "origin.git"
    run(["git", "clone", "-q", "--bare", str(seed), str(origin)], root, git_env)
    return origin


@contextmanager
def moto_s3(*buckets: str) -> Iterator[str]:
    """An S3 endpoint on loopback (moto's server), with these buckets."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                              region_name="us-east-1")
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()
