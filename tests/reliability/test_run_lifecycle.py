"""Runs that die, are interrupted, resume or move: what the records say afterwards, through the real CLI."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SETTINGS = ["train.grad_accum=2", "train.batch_size=8", "train.save_steps=5", "train.logging_steps=4",
            "tokenize.max_length=48", "evaluate.max_examples=8", "evaluate.max_new_tokens=8",
            # a few dozen steps lower the loss on the answers before they make exact matches: the gate judges that
            "evaluate.primary_metric=completion_loss"]
KILLER = textwrap.dedent("""
    import os, signal
    step = os.environ.get("KILL_AT_STEP", "")
    if step:
        from llmops.training import callbacks
        original = callbacks.LedgerCallback.on_substep_end
        def on_substep_end(self, args, state, control, **kwargs):
            if state.global_step == int(step):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, args, state, control, **kwargs)
        callbacks.LedgerCallback.on_substep_end = on_substep_end
""")


@pytest.fixture
def project(tmp_path: Path) -> dict[str, Path]:
    write_jsonl(tmp_path / "d.jsonl", instruction_records(rows=240, seed=31))
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "sitecustomize.py").write_text(KILLER)
    return {"data": tmp_path / "d.jsonl", "home": tmp_path / "home", "prefect": tmp_path / "prefect",
            "hooks": tmp_path / "hooks"}


def environment(project: dict[str, Path], **extra: str) -> dict[str, str]:
    return {**os.environ, "LLMOPS_HOME": str(project["home"]), "PREFECT_HOME": str(project["prefect"]),
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(project["hooks"]), os.environ.get("PYTHONPATH")]))}


def llmops_run(project: dict[str, Path], *extra: str) -> list[str]:
    return ["llmops", "run", "configs/tiny_sft_cpu.yaml", f"data.path={project['data']}", *SETTINGS, *extra]


def mlflow_client(project: dict[str, Path]) -> MlflowClient:
    uri = f"sqlite:///{project['home'] / 'mlflow' / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def runs_by_status(project: dict[str, Path]) -> dict[str, list]:
    client = mlflow_client(project)
    experiment = client.get_experiment_by_name("llmops").experiment_id
    found: dict[str, list] = {}
    for run in client.search_runs([experiment]):
        found.setdefault(run.info.status, []).append(run)
    return found


@pytest.mark.slow
def test_a_killed_run_is_closed_and_linked_to_the_run_that_resumed_it(project: dict[str, Path]) -> None:
    killed = subprocess.run(llmops_run(project, "train.max_steps=24"), cwd=REPO, capture_output=True, text=True,
                            env=environment(project, KILL_AT_STEP="12"), timeout=600)
    assert killed.returncode == -9
    (dead,) = runs_by_status(project)["RUNNING"]  # nothing closed it: the process is gone

    resumed = subprocess.run(llmops_run(project, "train.max_steps=24"), cwd=REPO, capture_output=True, text=True,
                             env=environment(project), timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    by_status = runs_by_status(project)
    assert "RUNNING" not in by_status
    (closed,), (finished,) = by_status["KILLED"], by_status["FINISHED"]
    assert closed.info.run_id == dead.info.run_id
    assert closed.data.tags["llmops.resumed_by"] == finished.info.run_id
    assert finished.data.tags["llmops.resumes"] == closed.info.run_id
    # the resumed run's loss curve covers the whole training, from the first logged step
    steps = [m.step for m in mlflow_client(project).get_metric_history(finished.info.run_id, "train/loss")]
    assert steps[0] == 1 and steps[-1] == 24 and {4, 8} <= set(steps)  # step 1 is always logged (divergence check)
    listed = subprocess.run(["llmops", "runs"], cwd=REPO, capture_output=True, text=True,
                            env=environment(project, COLUMNS="200"))
    rows = [line for line in listed.stdout.splitlines() if dead.info.run_id[:8] in line]
    assert any("KILLED" in row for row in rows) and any("FINISHED" in row for row in rows), listed.stdout


def start_in_its_own_group(project: dict[str, Path], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(llmops_run(project, *extra), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=environment(project), start_new_session=True)


def wait_for_training(project: dict[str, Path], process: subprocess.Popen, steps: int = 3) -> None:
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and process.poll() is None:
        ledgers = list((project["home"] / "artifacts" / "train").glob("*.partial/ledger/rank-0.jsonl")) \
            if (project["home"] / "artifacts" / "train").is_dir() else []
        if ledgers and len(ledgers[0].read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"training did not start: {process.poll()}")


def communicate_or_explain(project: dict[str, Path], process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The process's output once it ends; if it has not within the timeout, fail with every thread's stack and the
    processes still alive (one of them may hold the output pipes open after the command itself ended)."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        alive = leftovers(project)
        if process.poll() is None:
            process.send_signal(signal.SIGUSR1)
            time.sleep(3)
        for pid in [process.pid, *(pid for pid, _ in alive)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"still running after {timeout:.0f}s (exit code {process.returncode}); processes "
                             f"alive: {alive}\n{stdout[-4000:]}\n{stderr[-12000:]}") from None


def flow_run_states(project: dict[str, Path]) -> list[str]:
    with sqlite3.connect(project["prefect"] / "prefect.db") as db:
        return [row[0] for row in db.execute("select state_type from flow_run")]


def leftovers(project: dict[str, Path]) -> list[tuple[int, str]]:
    """Processes still running with this test's workspace in their environment or command line."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            environ = process.info["environ"] or {}
            if environ.get("LLMOPS_HOME") == str(project["home"]) and process.pid != os.getpid():
                found.append((process.pid, " ".join(process.info["cmdline"] or [])))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_run_stops_in_seconds_with_a_checkpoint_and_resumes(project: dict[str, Path],
                                                                          how: str) -> None:
    process = start_in_its_own_group(project, "train.max_steps=60")
    wait_for_training(project, process)
    interrupted_at = time.monotonic()
    if how == "ctrl-c":
        os.killpg(process.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    else:
        process.send_signal(signal.SIGTERM)  # what a scheduler does: the process it started
    stdout, stderr = communicate_or_explain(project, process, timeout=120)
    seconds = time.monotonic() - interrupted_at
    assert process.returncode == 130, stdout + stderr
    assert seconds < 30, f"took {seconds:.0f}s to stop"
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "saved a checkpoint there" in errors[0] and "Run the same command to resume" in \
        errors[0], stderr
    assert "Traceback" not in stdout + stderr
    assert flow_run_states(project) and set(flow_run_states(project)) <= {"CRASHED", "CANCELLED", "FAILED"}
    assert set(runs_by_status(project)) == {"KILLED"}
    time.sleep(1)
    assert leftovers(project) == []
    if how == "sigterm":
        return  # past the signal, both stop the same way: resuming once (after ctrl-c) covers what follows

    resumed = subprocess.run(llmops_run(project, "train.max_steps=60"), cwd=REPO, capture_output=True, text=True,
                             env=environment(project), timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    stopped_at = int(errors[0].split("training stopped at step ")[1].split()[0])
    assert f"resuming training from checkpoint-{stopped_at}" in resumed.stdout


def test_another_sqlite_store_keeps_its_artifacts_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmops.config.schema import TrackingConfig
    from llmops.tracking.log import client, experiment_id

    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    store = tmp_path / "stores" / "other.db"
    store.parent.mkdir()
    config = TrackingConfig(tracking_uri=f"sqlite:///{store}", experiment="moved")
    mlflow = client(config)
    run = mlflow.create_run(experiment_id(config))
    mlflow.log_dict(run.info.run_id, {"a": 1}, "config/resolved.yaml")
    assert not (elsewhere / "mlruns").exists()
    assert (store.parent / "artifacts").is_dir()
    assert list((store.parent / "artifacts").rglob("resolved.yaml"))
    explicit = TrackingConfig(tracking_uri=f"sqlite:///{store}", experiment="placed",
                              artifact_location=(tmp_path / "placed").as_uri())
    assert client(explicit).get_experiment(experiment_id(explicit)).artifact_location == (tmp_path / "placed").as_uri()
    served = TrackingConfig(tracking_uri="http://127.0.0.1:9", experiment="x")
    from llmops.tracking.log import artifact_location

    assert artifact_location(served) is None  # a server uses its own artifact root
