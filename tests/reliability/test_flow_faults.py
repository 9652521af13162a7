"""The whole flow under faults, on the malformed instruction file that once crashed a run.

Two `llmops run` processes start at once on one workspace and that file: both succeed, each stage is computed
by one and reused by the other, one version is registered, and the quarantine holds exactly the bad rows with
their line numbers and codes. Then, on the artifacts they left: a flipped byte is caught and rebuilt; the
tracking server going away at the register step is retried, or ends the run in one line with nothing
registered; a run with credentials in its tracking URI writes them nowhere; a pickled base model is refused.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow import MlflowClient
from typer.testing import CliRunner

from llmops.cli.app import app
from llmops.data.synthetic import instruction_records
from llmops.io.files import read_jsonl
from llmops.registry import register as register_module
from tests.reliability.servers import BIN, LoopbackProxy, start_mlflow

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_sft_cpu.yaml")
STAGES = ("ingest", "validate", "dedup", "tokenize", "report", "train", "evaluate")
runner = CliRunner()

# the seven kinds of bad rows, at these lines, among 300 good ones
BAD_ROWS = {
    41: (b'{"instruction": "Write this number in words.", "input": "12", "output": "twel', "json_broken"),
    87: (b'{"instruction": "caf\xe9 au lait", "input": "", "output": "coffee"}', "utf8_invalid"),
    123: (b'{"instruction": "ring the bell \x07 now", "input": "", "output": "done"}', "control_char"),
    160: (b'["Write this number in words.", "12", "twelve"]', "not_object"),
    201: (b"null", "not_object"),
    245: (b'{"instruction": "big", "input": "", "output": "' + b"a" * (50 << 20) + b'"}', "too_large"),
    290: (b'{"instruction": "nul", "input": "a\\u0000b", "output": "x"}', "nul_byte"),
}


def messy_file(path: Path) -> Path:
    import json

    good = iter(json.dumps(row).encode() for row in instruction_records(rows=300, seed=11))
    lines = [BAD_ROWS[number][0] if number in BAD_ROWS else next(good) for number in range(1, 308)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def overrides(data: Path, model_name: str = "messy") -> list[str]:
    # four steps lower the loss on the answers, not yet exact matches: the gate judges by the loss
    return [f"data.path={data}", "train.max_steps=4", "train.batch_size=16", "evaluate.max_examples=8",
            "evaluate.primary_metric=completion_loss", f"register.model_name={model_name}"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_twice_at_once(tmp_path_factory.mktemp("two-runs"))


def run_twice_at_once(root: Path) -> dict[str, Any]:
    """Two `llmops run` at once on one workspace, with the embedded stores (SQLite MLflow, ephemeral Prefect)."""
    data = messy_file(root / "messy.jsonl")
    env = {**os.environ, "LLMOPS_HOME": str(root / "home"), "PREFECT_HOME": str(root / "home" / "prefect"),
           "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    env.pop("MLFLOW_TRACKING_URI", None)
    command = [str(BIN / "llmops"), "run", CONFIG, *overrides(data)]
    processes = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=600)[0] for process in processes]
    return {"home": root / "home", "data": data, "outputs": outputs,
            "codes": [process.returncode for process in processes],
            "tracking": f"sqlite:///{root / 'home' / 'mlflow' / 'mlflow.db'}"}


def test_two_runs_at_once_compute_each_stage_once_and_register_once(workspace: dict[str, Any]) -> None:
    assert workspace["codes"] == [0, 0], "\n\n".join(workspace["outputs"])
    client = MlflowClient(tracking_uri=workspace["tracking"], registry_uri=workspace["tracking"])
    runs = client.search_runs([client.get_experiment_by_name("llmops").experiment_id])
    assert len(runs) == 2 and {run.info.status for run in runs} == {"FINISHED"}
    for stage in (*STAGES, "register"):
        assert sorted(run.data.tags[f"stage.{stage}"] for run in runs) == ["computed", "reused"], stage
    versions = client.search_model_versions("name = 'messy'")
    assert [str(v.version) for v in versions] == ["1"]
    assert all("registered messy version 1 → champion" in output for output in workspace["outputs"])


def test_the_malformed_file_quarantines_exactly_its_bad_rows_and_still_registers(workspace: dict[str, Any]) -> None:
    assert workspace["codes"] == [0, 0]
    (quarantine,) = (workspace["home"] / "artifacts" / "validate").glob("*/quarantine.jsonl")
    entries = list(read_jsonl(quarantine))
    assert {entry["line"]: entry["code"] for entry in entries} == {line: code for line, (_, code) in BAD_ROWS.items()}
    assert all(entry["source"] == str(workspace["data"]) and entry["message"] for entry in entries)
    big = next(entry for entry in entries if entry["line"] == 245)
    assert big["message"] == f"record is {len(BAD_ROWS[245][0]):,} bytes, over data.max_record_bytes (1,000,000)"
    client = MlflowClient(tracking_uri=workspace["tracking"], registry_uri=workspace["tracking"])
    computed = next(run for run in client.search_runs([client.get_experiment_by_name("llmops").experiment_id])
                    if run.data.tags["stage.validate"] == "computed")
    metrics = computed.data.metrics
    assert metrics["validate/rows_read"] == 307 and metrics["validate/rows_quarantined"] == 7
    assert metrics["validate/codes.not_object"] == 2 and metrics["ingest/reject_codes.too_large"] == 1
    assert str(client.get_model_version_by_alias("messy", "champion").version) == "1"
    # only safetensors were written: in the trained artifact and in the registered model
    model_files = [*(workspace["home"] / "artifacts" / "train").glob("*/model/*"),
                   *(workspace["home"] / "mlflow" / "artifacts").rglob("*")]
    assert any(path.name == "model.safetensors" for path in model_files)
    assert not [path for path in model_files if path.suffix in (".bin", ".pt", ".pth", ".pkl", ".ckpt")]


def error_lines(output: str) -> list[str]:
    """The CLI's error lines (a library's background thread may print on the same console line before one)."""
    return [line[line.index("error: "):] for line in output.splitlines() if "error: " in line]


@pytest.fixture
def in_workspace(workspace: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run in this process on the workspace the two runs left (its artifacts are reused)."""
    monkeypatch.setenv("LLMOPS_HOME", str(workspace["home"]))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # set by a run: undone afterwards
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    return workspace


def test_a_flipped_byte_in_a_stored_artifact_is_detected_and_rebuilt(in_workspace: dict[str, Any]) -> None:
    (stored,) = [p for p in (in_workspace["home"] / "artifacts" / "dedup").glob("*/train/part-00000.parquet")
                 if ".rejected-" not in p.parent.parent.name]
    content = bytearray(stored.read_bytes())
    content[len(content) // 2] ^= 0x01
    stored.write_bytes(bytes(content))
    result = runner.invoke(app, ["run", CONFIG, *overrides(in_workspace["data"])])
    assert result.exit_code == 0, result.output
    key = stored.parent.parent.name
    assert f"dedup artifact {key} is not reused (1 file(s) differ from the manifest, e.g. " \
           "train/part-00000.parquet): " \
           "rebuilding it" in " ".join(result.output.split())
    assert stored.read_bytes() != bytes(content)  # rebuilt: the flipped byte is gone
    assert list(stored.parent.parent.parent.glob(f"{key}.rejected-*"))  # the damaged copy is kept for a person to see
    assert "already registered: same weights" in result.output and "version 1" in result.output


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("mlflow-server")
    process, port = start_mlflow(root)
    proxy = LoopbackProxy(port)
    yield {"root": root, "port": port, "proxy": proxy}
    proxy.cut()
    process.terminate()
    process.wait(timeout=30)


def cut_at_register(monkeypatch: pytest.MonkeyPatch, proxy: LoopbackProxy, back_after: float | None) -> None:
    """The tracking server becomes unreachable just as the model is logged (and, maybe, comes back)."""
    log_model = register_module.log_model

    def cut_then_log(*args: Any, **kwargs: Any) -> str:
        proxy.cut()
        if back_after is not None:
            proxy.restore_after(back_after)
        return log_model(*args, **kwargs)

    monkeypatch.setattr(register_module, "log_model", cut_then_log)


def test_a_tracking_outage_at_the_register_step_is_retried(in_workspace: dict[str, Any], mlflow_server: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = mlflow_server["proxy"]
    cut_at_register(monkeypatch, proxy, back_after=3)
    result = runner.invoke(app, ["run", CONFIG, *overrides(in_workspace["data"], "retried"),
                                 f"tracking.tracking_uri={proxy.url}"])
    assert result.exit_code == 0, result.output
    client = MlflowClient(tracking_uri=proxy.url, registry_uri=proxy.url)
    assert [str(v.version) for v in client.search_model_versions("name = 'retried'")] == ["1"]
    assert str(client.get_model_version_by_alias("retried", "champion").version) == "1"


def test_a_tracking_server_that_stays_down_ends_the_run_in_one_line_with_nothing_registered(
        in_workspace: dict[str, Any], mlflow_server: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = mlflow_server["proxy"]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # bounded: 0 s, then 2 s between tries
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    cut_at_register(monkeypatch, proxy, back_after=None)
    started = time.monotonic()
    result = runner.invoke(app, ["run", CONFIG, *overrides(in_workspace["data"], "never"),
                                 f"tracking.tracking_uri={proxy.url}"])
    proxy.restore()
    assert result.exit_code == 2, result.output
    error = error_lines(result.output)
    assert len(error) == 1 and f"MLflow tracking server {proxy.url} stopped answering during the run" in error[0], \
        result.output
    assert time.monotonic() - started < 120
    client = MlflowClient(tracking_uri=proxy.url, registry_uri=proxy.url)
    assert client.search_model_versions("name = 'never'") == []


def test_no_secret_is_logged(in_workspace: dict[str, Any], mlflow_server: dict, monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
    """Credentials in MLFLOW_TRACKING_URI and an AWS secret in the environment: after a run, neither is in any
    MLflow param, tag, metric or artifact, any log record of any logger, the console, the workspace or the
    Prefect database; the tracking URI is shown masked."""
    user, password, aws_secret = "ops-user", "pw-7f3a9c1e5b", "aws-2b8d4e6f0a"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://{user}:{password}@127.0.0.1:{mlflow_server['port']}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_secret)
    caplog.set_level(logging.DEBUG)
    result = runner.invoke(app, ["run", CONFIG, *overrides(in_workspace["data"], "secrets"), "--verbose"])
    assert result.exit_code == 0, result.output
    # masked: the password becomes ***, the user name stays (llmops.store.settings.mask)
    assert f"tracking http://{user}:***@127.0.0.1:{mlflow_server['port']}" in result.output
    client = MlflowClient(tracking_uri=f"http://127.0.0.1:{mlflow_server['port']}")
    (run,) = client.search_runs([client.get_experiment_by_name("llmops").experiment_id],
                                "tags.registered_version = 'secrets/1'")
    assert run.data.params["tracking.tracking_uri"] == "None"  # it came from the environment
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # the run's log lines reach the Prefect database before it is searched
    logged = [result.output, *(record.getMessage() for record in caplog.records), repr(run.data)]
    prefect_home = Path(os.environ["PREFECT_HOME"])
    stores = [mlflow_server["root"], in_workspace["home"], prefect_home]
    for secret in (password, aws_secret):
        assert not [text for text in logged if secret in text]
        assert not [path for store in stores for path in store.rglob("*")
                    if path.is_file() and secret.encode() in path.read_bytes()]
    assert any((prefect_home).rglob("*.db")), "the Prefect database was searched"


def test_a_pickled_base_model_is_refused_in_one_line(in_workspace: dict[str, Any], tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    base = tmp_path / "old-base"
    (tokenizer,) = (in_workspace["home"] / "artifacts" / "tokenize").glob("*/tokenizer")
    shutil.copytree(tokenizer, base)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32))
    model.config.save_pretrained(base)
    torch.save(model.state_dict(), base / "pytorch_model.bin")
    result = runner.invoke(app, ["run", CONFIG, *overrides(in_workspace["data"], "pickled"),
                                 f"model.name_or_path={base}"])
    assert result.exit_code == 2, result.output
    (error,) = error_lines(result.output)
    assert "its weights are pickles only (pytorch_model.bin)" in error and "only safetensors are loaded" in error
