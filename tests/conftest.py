"""Shared fixtures: a private workspace per test, tiny generated datasets, tiny configs."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _pytest.config import Config

from llmops.cli.environment import configure_environment
from llmops.config.schema import PipelineConfig
from llmops.data.synthetic import instruction_records, text_records
from llmops.io.files import write_jsonl
from llmops.objectives import load_config
from tests.scheduling import DurationStore, known_durations, longest_first, machine_lock

REPO = Path(__file__).resolve().parents[1]
# where MLflow puts a store when it is given no URI, relative to the working directory
STRAY_STORES = (REPO / "mlflow.db", REPO / "mlruns")


def pytest_configure(config: Config) -> None:
    """One Prefect home (and ephemeral API database) for the session, outside the repo's workspace."""
    import tempfile

    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="llmops-prefect-")
    if config.getoption("store_durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(DurationStore(), "duration-store")
    if lock := machine_lock(config):
        config.pluginmanager.register(lock, "machine-lock")
    # Prefect reads its settings when test modules import it, before any fixture runs: the ephemeral API gets the
    # startup time the CLI gives it (a loaded machine needs more than Prefect's default 20 s)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    # several test processes share the cores (pytest -n): one math thread each, in them and in what they start,
    # rather than each one's threads fighting the others'
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


# each test folder is a marker: `pytest -m unit`, `-m "not slow"` (the fast tier) and so on select by folder too
FOLDER_MARKERS = ("unit", "integration", "reliability", "gpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help="write each test's seconds to tests/durations.json, which orders the runs of `pytest -n`")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups it marks
def pytest_collection_modifyitems(config: Config, items: list[pytest.Item]) -> None:
    """Markers follow folders; a test under unit/ is fast by definition; tests marked gpu need CUDA, and without it
    they are skipped, saying so. Under `pytest -n` the longest tests are handed out first."""
    import torch

    for item in items:
        folder = Path(str(item.fspath)).relative_to(REPO / "tests").parts[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, folder))
        if folder == "unit" and "slow" in item.keywords:
            raise pytest.UsageError(f"{item.nodeid} is marked slow: slow tests (training, servers, whole runs) "
                                    "belong in tests/integration or tests/reliability, not tests/unit")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = longest_first(items, known_durations())
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def alone(request: pytest.FixtureRequest) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """`with alone():` no other test runs within (tests/scheduling.py), for what a test times."""
    lock = request.config.pluginmanager.get_plugin("machine-lock")
    return lock.alone if lock else contextlib.nullcontext


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own LLMOPS_HOME; runs from the repo root, as the CLI does."""
    folder = tmp_path / "home"
    monkeypatch.setenv("LLMOPS_HOME", str(folder))
    # MLflow copies a URI it is given into its environment variables: one test's server must not become the next
    # test's store (set, then delete, so that the teardown deletes whatever the test left)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    forget_mlflow_uris()
    monkeypatch.chdir(REPO)
    configure_environment()
    strays = [path for path in STRAY_STORES if not path.exists()]
    yield folder
    # MLflow called with no URI writes a store into the working directory (the repo): a test, or the code it
    # drives, that does so is at fault, and the store must not outlive it
    left = [path for path in strays if path.exists()]
    for path in left:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert not left, f"MLflow was used with no tracking URI and wrote {', '.join(map(str, left))}"


def forget_mlflow_uris() -> None:
    """MLflow also keeps the last URIs set in module globals, which a client built without them falls back to."""
    import sys

    if "mlflow" in sys.modules:
        from mlflow.tracking._model_registry import utils as registry_utils
        from mlflow.tracking._tracking_service import utils as tracking_utils

        tracking_utils._tracking_uri = None
        registry_utils._registry_uri = None


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One workspace (and MLflow registry) for a module's registered models, shared by its tests."""
    return tmp_path_factory.mktemp("predict") / "home"


@pytest.fixture
def in_registry(registry: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLMOPS_HOME", str(registry))
    return registry


@pytest.fixture
def instruction_file(tmp_path: Path) -> Path:
    path = tmp_path / "instructions.jsonl"
    write_jsonl(path, instruction_records(rows=1500, seed=7))
    return path


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, text_records(rows=1500, seed=7))
    return path


def tiny_config(name: str, data_path: Path, *overrides: str) -> PipelineConfig:
    return load_config(REPO / "configs" / name, [f"data.path={data_path}", *overrides])


@pytest.fixture
def sft_config(instruction_file: Path) -> PipelineConfig:
    return tiny_config("tiny_sft_cpu.yaml", instruction_file)


@pytest.fixture
def pretrain_config(text_file: Path) -> PipelineConfig:
    return tiny_config("tiny_pretrain_cpu.yaml", text_file)


@pytest.fixture(autouse=True, scope="session")
def stop_ephemeral_prefect() -> Iterator[None]:
    """Stop the ephemeral Prefect API while the test session's output streams are still open."""
    yield
    import logging

    from prefect.server.api.server import SubprocessASGIServer

    for name in ("prefect.flow_runs", "prefect.task_runs", "llmops"):
        for handler in logging.getLogger(name).handlers:
            handler.flush()
    for server in list(SubprocessASGIServer._instances.values()):
        server.stop()


@pytest.fixture(scope="session")
def pretrained_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny causal LM pretrained here on plain text, saved like a hub checkpoint: the base for fine-tuning. Built
    once a session: under `pytest -n` the first worker that needs it trains it, the others wait and read the same
    folder (training it once per worker cost each a minute of the shared cores)."""
    from filelock import FileLock

    # the workers of one `pytest -n` session share the parent of their temporary folders (and only they do)
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    target = shared / "pretrained-base" / "base-model"
    with FileLock(str(shared / "pretrained-base.lock")):
        if not (target / "config.json").is_file():
            train_base(target)
    return target


def train_base(target: Path) -> None:
    """Pretrain the base on a corpus of plain text and instructions, and save it (whole) at `target`."""
    from tests.helpers import data_stages, stage

    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / "copying", ignore_errors=True)  # left by a worker that failed while copying
    corpus = root / "corpus.jsonl"
    write_jsonl(corpus, text_records(rows=1500, seed=5) + [
        {"text": f"{r['instruction']} {r['input']} {r['output']}"} for r in instruction_records(1500, seed=5)])
    previous = os.environ.get("LLMOPS_HOME")
    os.environ["LLMOPS_HOME"] = str(root / "home")
    try:
        config = load_config(REPO / "configs" / "tiny_pretrain_cpu.yaml", [f"data.path={corpus}",
                                                                             "model.architecture=llama"])
        _, tokenized = data_stages(config)
        trained = stage("train", config, tokenized)
        # copied to a scratch name first: a worker that finds the folder finds it whole
        shutil.copytree(trained.dir / "model", root / "copying")
        (root / "copying").rename(target)
    finally:
        if previous is None:
            os.environ.pop("LLMOPS_HOME", None)
        else:
            os.environ["LLMOPS_HOME"] = previous
