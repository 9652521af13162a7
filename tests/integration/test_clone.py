"""The project as a new user gets it: a clone, `llmops data init`, `llmops run`, then DVC."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from llmops.pipeline.stages import NAMES as STAGES
from llmops.pipeline.stages import downstream
from tests.integration.stack import fresh_clone

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def sh(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LLMOPS_HOME"}  # the clone's own .llmops
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    result = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True)
    if check:
        assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    return fresh_clone(tmp_path / "clone")


def use_tiny_default(clone: Path, rows: int) -> None:
    """Make the clone's default job the seconds-long one, on a small dataset pinned by DVC: a short training judged
    on the held-out loss, which any training improves on (what is asserted is the versioning, not the model)."""
    tiny = load_config(clone / "configs" / "tiny_sft_cpu.yaml", [
        "data.path=data/instructions.jsonl", "train.max_steps=40", "evaluate.primary_metric=completion_loss",
        "evaluate.max_examples=20"])
    (clone / "configs" / "default.yaml").write_text(yaml.safe_dump(tiny.as_dict(), sort_keys=False))
    write_jsonl(clone / "data" / "instructions.jsonl", instruction_records(rows=rows, seed=11))
    sh("dvc", "add", "-q", "data", cwd=clone)
    sh("git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qam", "tiny default", cwd=clone)


def test_fresh_clone_data_init_run_dvc_status_and_repro(clone: Path) -> None:
    init = sh("llmops", "data", "init", cwd=clone)
    # a fresh clone's remote is made by this first push: that it held nothing yet is no news
    assert "(regenerated);" in " ".join(init.stdout.split())
    assert "up to date" in sh("dvc", "status", "data.dvc", cwd=clone).stdout
    # a remote that exists and lacks the pinned version is said, in the project's words (DVC's own warning is quiet)
    shutil.rmtree(clone / ".llmops" / "dvc" / "remote" / "files")
    shutil.rmtree(clone / ".llmops" / "dvc" / "cache")
    shutil.rmtree(clone / "data")
    lacking = sh("llmops", "data", "init", cwd=clone)
    assert "regenerated: the DVC remote 'local' did not hold the pinned version" in " ".join(lacking.stdout.split())

    use_tiny_default(clone, rows=1200)
    run = sh("llmops", "run", cwd=clone)
    assert "version 1 → champion" in run.stdout and "Traceback" not in run.stdout + run.stderr
    # only the project's own lines: no library's notes about empty files, cards or what it registered
    for noise in ("WARNING:", "is empty", "Repo card", "Successfully registered", "Created version", "cache files"):
        assert noise not in init.stdout + init.stderr + lacking.stdout + lacking.stderr + run.stdout + run.stderr, noise
    # nothing changed: the run says so without starting Prefect or MLflow, and makes no MLflow run
    again = sh("llmops", "run", cwd=clone)
    assert "up to date" in again.stdout and "llmops-tiny-sft/1 holds its model; nothing ran" in again.stdout
    assert "version 1 → champion" in again.stdout and "training_pipeline ·" not in again.stdout
    status = sh("dvc", "status", cwd=clone)
    assert "Data and pipelines are up to date" in status.stdout, status.stdout
    records = {p.name: p.read_text() for p in (clone / ".llmops" / "records").iterdir()}
    assert set(records) == {f"{s}.json" for s in STAGES} | {"params.yaml"}

    # editing a module that tokenize imports: DVC sees tokenize and every stage after it as changed, no other
    templates = clone / "llmops" / "text" / "templates.py"
    original = templates.read_text()
    templates.write_text(original + "\n# an edit\n")
    edited = sh("dvc", "status", cwd=clone).stdout
    assert changed_stages(edited) == {"tokenize", *downstream("tokenize")}, edited
    templates.write_text(original)
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=clone).stdout

    repro = sh("dvc", "repro", cwd=clone)
    assert "Data and pipelines are up to date" in repro.stdout + repro.stderr
    forced = sh("dvc", "repro", "--force", cwd=clone)
    for stage in STAGES:
        assert f"Running stage '{stage}'" in forced.stdout + forced.stderr
    # the same stages reuse the same artifacts: every record is unchanged, no version was added
    assert {p.name: p.read_text() for p in (clone / ".llmops" / "records").iterdir()} == records
    listed = json.loads(sh("llmops", "models", "list", "--json", cwd=clone).stdout)
    assert [v["version"] for v in listed] == ["1"]
    # the version's tags lead back to the exact data version and commit it was trained from
    head = sh("git", "rev-parse", "HEAD", cwd=clone).stdout.strip()
    pinned = yaml.safe_load((clone / "data.dvc").read_text())["outs"][0]["md5"]
    assert listed[0]["tags"]["dvc_data_md5"] == pinned and listed[0]["tags"]["git_commit"] == head
    assert listed[0]["tags"]["data_matches_dvc"] == "true" and listed[0]["tags"]["git_dirty"] == "false"
    # MLflow's own conventions: the run's source commit, and its splits as datasets with the DVC md5 as digest
    from mlflow import MlflowClient

    store = f"sqlite:///{clone / '.llmops' / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    pipeline_runs = [found for found in client.search_runs(client.get_experiment_by_name("llmops").experiment_id)
                     if found.data.tags.get("runner") != "stage"]
    assert len(pipeline_runs) == 1, "the up-to-date run started a run of its own"
    run = client.get_run(listed[0]["run_id"])
    assert run.data.tags["mlflow.source.git.commit"] == head
    datasets = {found.dataset.name: found.dataset for found in run.inputs.dataset_inputs}
    assert set(datasets) == {"instructions-train", "instructions-eval"}
    assert {found.digest for found in datasets.values()} == {pinned}
    assert all(found.source_type == "dvc" and json.loads(found.source)[0]["dvc_file"] == "data.dvc"
               for found in datasets.values())

    write_jsonl(clone / "data" / "instructions.jsonl", instruction_records(rows=1300, seed=12))
    assert "modified" in sh("dvc", "status", cwd=clone).stdout
    sh("dvc", "add", "-q", "data", cwd=clone)
    rerun = sh("llmops", "run", cwd=clone)
    assert "version 2 →" in rerun.stdout
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=clone).stdout


def changed_stages(status: str) -> set[str]:
    """The stages `dvc status` lists (a stage name ends a line that starts in the first column)."""
    return {line[:-1] for line in status.splitlines() if line.endswith(":") and not line[0].isspace()}


def test_bad_inputs_end_with_one_clear_line(clone: Path, tmp_path: Path) -> None:
    def error_lines(*args: str) -> list[str]:
        result = sh("llmops", "run", *args, cwd=clone, check=False)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        return [line for line in result.stderr.splitlines() if line.startswith("error:")]

    unknown = error_lines("configs/default.yaml", "train.epoch=2")
    assert len(unknown) == 1 and unknown[0].startswith(
        "error: configs/default.yaml (override train.epoch=2): train.epoch: unknown key; expected one of: epochs, ")
    missing = error_lines("configs/default.yaml", "data.path=nowhere/data.jsonl")
    assert len(missing) == 1 and "data source 'nowhere/data.jsonl': no data file found" in missing[0]
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"instruction": "x", "output": ""}] * 3 + [{"instruction": "x", "output": "y"}])
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    silent = error_lines("configs/default.yaml", f"data.path={bad}", "engine.name=ray",
                         f"engine.address=127.0.0.1:{port}")
    assert silent == [f"error: engine: ray: nothing answers at 127.0.0.1:{port} (Connection refused); start the "
                      "cluster there (ray start --head) or correct engine.address / RAY_ADDRESS"]
    quality = error_lines("configs/default.yaml", f"data.path={bad}")
    assert len(quality) == 1 and "3 of 4 rows failed validation" in quality[0] and "quarantine.jsonl" in quality[0]
    # on a Ray cluster the run starts for itself: the same line (the same artifacts), and no Ray or Prefect log
    on_ray = sh("llmops", "run", "configs/default.yaml", f"data.path={bad}", "engine.name=ray", cwd=clone, check=False)
    shown = on_ray.stdout + on_ray.stderr
    assert on_ray.returncode == 2 and "Traceback" not in shown, shown
    assert [line for line in on_ray.stderr.splitlines() if line.startswith("error:")] == quality
    assert not re.search(r"\b(INFO|WARNING|ERROR) \w+\.py:\d+ -- ", shown), shown  # Ray's and Prefect's log format
