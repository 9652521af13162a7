"""The project as a new user gets it: a clone, `llmops data init`, `llmops run`, then DVC."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.config import load_config
from tasks.synthetic import instruction_records
from tasks.workspace import write_jsonl

pytestmark = pytest.mark.integration
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
    """The working tree's tracked and unignored files, committed in a fresh git repository."""
    target = tmp_path / "clone"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file() and name != "dvc.lock":  # a fresh clone has no lock yet
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)
    sh("git", "init", "-q", cwd=target)
    sh("git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "add", "-A", cwd=target)
    sh("git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "clone", cwd=target)
    return target


def use_tiny_default(clone: Path, rows: int) -> None:
    """Make the clone's default job the seconds-long one, on a small dataset pinned by DVC."""
    tiny = load_config(clone / "configs" / "tiny_sft_cpu.yaml", ["data.path=data/instructions.jsonl"])
    (clone / "configs" / "default.yaml").write_text(yaml.safe_dump(tiny.as_dict(), sort_keys=False))
    write_jsonl(clone / "data" / "instructions.jsonl", instruction_records(rows=rows, seed=11))
    sh("dvc", "add", "-q", "data", cwd=clone)


def test_fresh_clone_data_init_run_dvc_status_and_repro(clone: Path) -> None:
    init = sh("llmops", "data", "init", cwd=clone)
    assert "regenerated" in init.stdout
    assert "up to date" in sh("dvc", "status", "data.dvc", cwd=clone).stdout

    use_tiny_default(clone, rows=1200)
    run = sh("llmops", "run", cwd=clone)
    assert "version 1 → champion" in run.stdout and "Traceback" not in run.stdout + run.stderr
    status = sh("dvc", "status", cwd=clone)
    assert "Data and pipelines are up to date" in status.stdout, status.stdout
    records = {p.name: p.read_text() for p in (clone / ".llmops" / "records").iterdir()}
    assert set(records) == {f"{s}.json" for s in
                            ("ingest", "validate", "dedup", "tokenize", "train", "evaluate", "register")}

    repro = sh("dvc", "repro", cwd=clone)
    assert "Data and pipelines are up to date" in repro.stdout + repro.stderr
    forced = sh("dvc", "repro", "--force", cwd=clone)
    for stage in ("ingest", "validate", "dedup", "tokenize", "train", "evaluate", "register"):
        assert f"Running stage '{stage}'" in forced.stdout + forced.stderr
    # the same stages reuse the same artifacts: every record is unchanged, no version was added
    assert {p.name: p.read_text() for p in (clone / ".llmops" / "records").iterdir()} == records
    listed = sh("llmops", "models", "list", "--json", cwd=clone)
    assert [v["version"] for v in __import__("json").loads(listed.stdout)] == ["1"]

    write_jsonl(clone / "data" / "instructions.jsonl", instruction_records(rows=1300, seed=12))
    assert "modified" in sh("dvc", "status", cwd=clone).stdout
    sh("dvc", "add", "-q", "data", cwd=clone)
    rerun = sh("llmops", "run", cwd=clone)
    assert "version 2 →" in rerun.stdout
    assert "Data and pipelines are up to date" in sh("dvc", "status", cwd=clone).stdout


def test_bad_inputs_end_with_one_clear_line(clone: Path, tmp_path: Path) -> None:
    def error_lines(*args: str) -> list[str]:
        result = sh("llmops", "run", *args, cwd=clone, check=False)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        return [line for line in result.stdout.splitlines() if line.startswith("error:")]

    assert error_lines("configs/default.yaml", "train.epoch=2") == [
        "error: configs/default.yaml (override train.epoch=2): train.epoch: unknown key; expected one of: epochs, "
        "max_steps, batch_size, grad_accum, learning_rate, lr_scheduler, warmup_ratio, weight_decay, "
        "max_grad_norm, precision, gradient_checkpointing, seed, logging_steps, save_steps, save_total_limit"]
    missing = error_lines("configs/default.yaml", "data.path=nowhere/data.jsonl")
    assert len(missing) == 1 and "data.path 'nowhere/data.jsonl': no data file found" in missing[0]
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"instruction": "x", "output": ""}] * 3 + [{"instruction": "x", "output": "y"}])
    quality = error_lines("configs/default.yaml", f"data.path={bad}")
    assert len(quality) == 1 and "3 of 4 rows failed validation" in quality[0] and "quarantine.jsonl" in quality[0]
