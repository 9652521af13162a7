"""Training that dies and resumes: SIGKILL mid-accumulation, a kill while a checkpoint is written, a resume on
another machine from a checkpoint store, and 2-process DDP. Each run is a real process, killed for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from llmops.data.synthetic import instruction_records
from llmops.io.files import write_jsonl

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# a small training: 2 micro-batches per step, a checkpoint every 5 steps, a little more than 2 epochs
SETTINGS = ["train.max_steps=24", "train.grad_accum=2", "train.batch_size=8", "train.save_steps=5",
            "train.logging_steps=4", "train.save_total_limit=3", "tokenize.max_length=48",
            "evaluate.primary_metric=completion_loss"]

# runs the stages up to train, the way the flow does, and prints the train record
DRIVER = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO)
    from llmops.cli.environment import configure_environment
    configure_environment()
    from llmops.pipeline.runner import build_stage
    from llmops.objectives import load_config
    config = load_config("configs/tiny_sft_cpu.yaml", json.loads(sys.argv[1]))
    ingested = build_stage("ingest", config)
    deduped = build_stage("dedup", config, build_stage("validate", config, ingested))
    record = build_stage("train", config, build_stage("tokenize", config, deduped))
    print("RECORD " + record.model_dump_json())
""")

# loaded by every process of a run (workers too): kills one process with SIGKILL at a chosen point
KILLER = textwrap.dedent("""
    import os, signal
    point = os.environ.get("KILL_AT", "")
    if point:
        where, step, rank = point.split(":")
        if int(os.environ.get("RANK", "0")) == int(rank):
            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)
            if where == "substep":
                from llmops.training import callbacks
                original = callbacks.LedgerCallback.on_substep_end
                def on_substep_end(self, args, state, control, **kwargs):
                    if state.global_step == int(step):
                        die()
                    return original(self, args, state, control, **kwargs)
                callbacks.LedgerCallback.on_substep_end = on_substep_end
            if where == "save":
                from llmops.training import checkpoints
                original_manifest = checkpoints.write_manifest
                def write_manifest(folder):
                    if folder.name == f"checkpoint-{step}":
                        die()
                    return original_manifest(folder)
                checkpoints.write_manifest = write_manifest
""")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("faults")
    write_jsonl(folder / "d.jsonl", instruction_records(rows=240, seed=21))
    (folder / "hooks").mkdir()
    (folder / "hooks" / "sitecustomize.py").write_text(KILLER)
    return folder


def train_in(home: Path, data: Path, *extra: str, kill_at: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMOPS_HOME": str(home), "KILL_AT": kill_at,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(data / "hooks"), os.environ.get("PYTHONPATH")]))}
    overrides = [f"data.path={data / 'd.jsonl'}", *SETTINGS, *extra]
    return subprocess.run([sys.executable, "-c", DRIVER, json.dumps(overrides)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def finished(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RECORD "))
    return json.loads(line.removeprefix("RECORD "))


def weights(home: Path, record: dict) -> dict:
    return load_file(str(home / "artifacts" / "train" / record["key"] / "model" / "model.safetensors"))


def ledger(home: Path, record: dict) -> list[dict]:
    """Every ledger entry of every process: rank, step, epoch (0-based) and the sample ids trained on."""
    folder = home / "artifacts" / "train" / record["key"] / "ledger"
    entries = []
    for path in sorted(folder.glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            # a step that ends at epoch 1.0 belongs to epoch 0
            entries.append({"rank": int(path.stem.removeprefix("rank-")), "step": entry["step"],
                            "epoch": -int(-entry["epoch"] // 1) - 1, "samples": entry["samples"]})
    return entries


def assert_each_sample_once_per_epoch(entries: list[dict], rows: int, repeats_allowed: int = 0) -> None:
    """Every sample in every full epoch; a sample twice only in an epoch's last step, where several processes
    even out their last batches with samples from the epoch's start (at most `repeats_allowed` of them)."""
    last = max(entry["epoch"] for entry in entries)  # cut short by max_steps
    assert last >= 1
    for epoch in range(last + 1):
        steps = [e for e in entries if e["epoch"] == epoch]
        final = max(e["step"] for e in steps)
        seen = [sample for e in steps for sample in e["samples"]]
        repeated = len(seen) - len(set(seen))
        in_final = {sample for e in steps if e["step"] == final for sample in e["samples"]}
        assert repeated <= repeats_allowed, f"epoch {epoch}: {repeated} repeats"
        assert all(seen.count(s) == 1 or s in in_final for s in set(seen)), f"epoch {epoch}"
        if epoch < last:
            assert set(seen) == set(range(rows)), f"epoch {epoch} misses samples"


def train_rows(home: Path) -> int:
    from datasets import load_from_disk

    (tokenized,) = [p for p in (home / "artifacts" / "tokenize").iterdir() if p.is_dir() and "." not in p.name]
    return len(load_from_disk(str(tokenized / "train")))


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    home = tmp_path_factory.mktemp("reference") / "home"
    return home, finished(train_in(home, data))


def test_kills_while_saving_and_mid_accumulation_resume_to_bitwise_equal_weights(data: Path,
                                                                                 reference: tuple[Path, dict],
                                                                                 tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert train_in(home, data, kill_at="save:10:0").returncode == -9
    partial = next((home / "artifacts" / "train").glob("*.partial"))
    assert (partial / "checkpoints" / "checkpoint-10").is_dir()  # written, but never marked complete
    again = train_in(home, data, kill_at="substep:12:0")  # then killed during step 13's first micro-batch
    assert again.returncode == -9
    output = again.stdout + again.stderr
    assert "checkpoint-10 is not used: not complete" in output and "resuming training from checkpoint-5" in output
    resumed = train_in(home, data)
    record = finished(resumed)
    assert "resuming training from checkpoint-10" in resumed.stderr + resumed.stdout
    ref_home, ref = reference
    assert record["key"] == ref["key"] and record["hash"] == ref["hash"]
    mine, theirs = weights(home, record), weights(ref_home, ref)
    assert all(mine[name].equal(theirs[name]) for name in theirs)
    # the figures describe the whole training, not only the steps of the last resume
    for figure in ("steps", "train_loss", "first_logged_loss", "last_logged_loss", "tokens"):
        assert record["figures"][figure] == pytest.approx(ref["figures"][figure], rel=1e-6), figure
    assert record["figures"]["resumed_from_step"] == 10
    assert_each_sample_once_per_epoch(ledger(home, record), train_rows(home))
    # nothing in the finished artifact depends on where the workspace is, and nothing is a pickle
    files = [p for p in (home / "artifacts" / "train" / record["key"]).rglob("*") if p.is_file()]
    assert not [p.name for p in files if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".pickle")]
    assert not [p.name for p in files if str(home.parent).encode() in p.read_bytes()]


def test_another_machine_resumes_from_the_checkpoint_store(data: Path, reference: tuple[Path, dict],
                                                            tmp_path: Path, s3_bucket: str) -> None:
    store = f"train.checkpoint_dir={s3_bucket}/checkpoints"
    first_machine, second_machine = tmp_path / "a" / "home", tmp_path / "b" / "home"
    assert train_in(first_machine, data, store, kill_at="substep:12:0").returncode == -9
    resumed = train_in(second_machine, data, store)
    record = finished(resumed)
    assert "resuming from checkpoint-10 in the checkpoint store" in resumed.stdout + resumed.stderr
    ref_home, ref = reference
    assert record["hash"] == ref["hash"]
    assert all(weights(second_machine, record)[n].equal(t) for n, t in weights(ref_home, ref).items())


def test_two_process_ddp_splits_the_samples_and_resumes_after_a_kill(data: Path, tmp_path: Path) -> None:
    ddp = ("train.processes=2", "train.batch_size=4")
    clean_home, killed_home = tmp_path / "clean" / "home", tmp_path / "killed" / "home"
    clean = finished(train_in(clean_home, data, *ddp))
    assert (clean["figures"]["strategy"], clean["figures"]["world_size"]) == ("ddp", 2)
    entries, rows = ledger(clean_home, clean), train_rows(clean_home)
    assert {e["rank"] for e in entries} == {0, 1}
    first_epoch_end = max(e["step"] for e in entries if e["epoch"] == 0)
    halves = [{s for e in entries if e["rank"] == rank and e["epoch"] == 0 and e["step"] < first_epoch_end
               for s in e["samples"]} for rank in (0, 1)]
    assert not halves[0] & halves[1]  # each rank trains on its own half of the samples
    assert all(0.4 * rows <= len(half) <= 0.6 * rows for half in halves)
    one_step = 2 * 4 * 2 * 3  # processes x batch size x accumulation x samples a packed row may hold
    assert_each_sample_once_per_epoch(entries, rows, repeats_allowed=one_step)

    assert train_in(killed_home, data, *ddp, kill_at="substep:12:1").returncode != 0  # rank 1 dies
    resumed = finished(train_in(killed_home, data, *ddp))
    assert resumed["figures"]["resumed_from_step"] == 10
    mine, theirs = weights(killed_home, resumed), weights(clean_home, clean)
    assert max(float((mine[n] - t).abs().max()) for n, t in theirs.items()) <= 1e-6
    assert_each_sample_once_per_epoch(ledger(killed_home, resumed), train_rows(killed_home), repeats_allowed=48)


def test_a_rank_that_raises_is_named_in_one_line(data: Path, tmp_path: Path) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("RANK") == "1":
            from llmops.training import trainer
            def broken(*args, **kwargs):
                raise ValueError("the data loader on this node is broken")
            trainer.build_trainer = broken
    """))
    env = {**os.environ, "LLMOPS_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(["llmops", "run", "configs/tiny_sft_cpu.yaml", f"data.path={data / 'd.jsonl'}",
                             *SETTINGS, "train.processes=2"], cwd=REPO, env={**env, "PATH": path_with_venv()},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "training failed on rank 1: ValueError: the data loader on this node is broken" in errors[0]
    assert "Traceback" not in result.stdout + result.stderr
    log = next((tmp_path / "home" / "artifacts" / "train").glob("*.partial")) / "logs" / "workers.log"
    assert "Traceback" in log.read_text() and "the data loader on this node is broken" in log.read_text()


def path_with_venv() -> str:
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"


def test_out_of_gpu_memory_is_one_line_naming_what_to_change(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from typer.testing import CliRunner

    from llmops.cli.app import app
    from llmops.training import callbacks

    def out_of_memory(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.11 GiB total)")

    monkeypatch.setattr(callbacks.LedgerCallback, "on_step_end", out_of_memory)
    result = CliRunner().invoke(app, ["run", "configs/tiny_sft_cpu.yaml", f"data.path={data / 'd.jsonl'}", *SETTINGS])
    assert result.exit_code == 2, result.output
    # a progress bar on stderr may end without a newline: the error is found wherever its line starts
    errors = ["error:" + part for part in result.output.split("error:")[1:]]
    errors = [part.splitlines()[0] for part in errors]
    assert len(errors) == 1 and "out of GPU memory while training" in errors[0], result.output
    for setting in ("train.batch_size=8", "train.grad_accum=2", "train.gradient_checkpointing=false"):
        assert setting in errors[0]
    assert "Traceback" not in result.output
