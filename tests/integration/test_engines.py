"""The ingest, validate, dedup and tokenize stages on each engine, one corpus: a local process pool and a real Ray
cluster of two nodes (two raylets on this machine) make the same artifacts, byte for byte, under the same keys; a Ray
worker killed mid-stage is run again, and no row is lost or doubled."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmops.config.engine import EngineConfig
from llmops.config.schema import PipelineConfig
from llmops.data import ingest
from llmops.data.readers import DataSourceError
from llmops.pipeline.engine import Engine
from tests.helpers import output_bytes, stage
from tests.unit.test_dedup_shards import OUTPUTS, corpus

pytestmark = pytest.mark.slow

INGESTED = ("records", "rejected.jsonl")
# ingest's own work, kept before a test swaps in the one that kills its worker
INGEST_SHARD = ingest.ingest_shard


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """One cluster for the module: a head node and a second node, one CPU each."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster.address
    finally:
        ray.shutdown()
        try:
            cluster.shutdown()
        except ValueError:  # the driver was connected again after the shutdown (seen once on a loaded machine):
            cluster.shutdown()  # Ray disconnected it before refusing, so the head node now goes


def configured(source: Path, engine: dict) -> PipelineConfig:
    return PipelineConfig(data={"kind": "text", "path": str(source), "eval_fraction": 0.2},
                          tokenize={"vocab_size": 300, "max_length": 32}, engine=engine)


def validated(config: PipelineConfig) -> tuple[Any, Any, dict[str, bytes]]:
    """The ingest and validate records, and the files of both that hold rows."""
    ingested = stage("ingest", config)
    checked = stage("validate", config, ingested)
    assert not ingested.reused and not checked.reused
    files = output_bytes(ingested.dir, *INGESTED)
    files.update(output_bytes(checked.dir, "valid", "quarantine.jsonl"))
    return ingested, checked, files


def deduped(source: Path, engine: dict) -> tuple[Any, ...]:
    config = configured(source, engine)
    ingested, checked, files = validated(config)
    record = stage("dedup", config, checked)
    tokenized = stage("tokenize", config, record)
    assert not record.reused and not tokenized.reused
    files.update(output_bytes(record.dir, *OUTPUTS))
    return (ingested.key, ingested.hash, checked.key, checked.hash, record.key, record.hash, tokenized.key,
            tokenized.hash, files)


def write_source(path: Path) -> None:
    """The corpus as JSON lines, with rows validation quarantines (empty, too long) and lines ingest cannot read
    (broken JSON, bad UTF-8), some ended by CRLF, and blank lines between: line numbers must survive the cuts."""
    lines = [json.dumps({"text": text}).encode() for text in corpus(300, seed=3)]
    for position in range(0, 300, 37):
        lines[position] = json.dumps({"text": "" if position % 2 else "x" * 30_000}).encode()
    for position in range(5, 300, 41):
        lines[position] = b'{"text": "broken' if position % 2 else b'{"text": "bad \xff"}'
    path.write_bytes(b"".join(line + (b"\r\n" if number % 7 == 0 else b"\n\n" if number % 11 == 0 else b"\n")
                              for number, line in enumerate(lines)))


def test_every_engine_makes_the_same_artifacts(ray_cluster: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "docs.jsonl"
    write_source(source)
    made = []
    # many shards in this process, on a pool of two, and on the two nodes of the Ray cluster (a set shard size
    # parts ingest's records: the engines are compared at the same one; other sizes give the same records, as
    # test_ingest_shards checks)
    engines = ({"workers": 1, "shard_bytes": 4096}, {"workers": 2, "shard_bytes": 4096},
               {"name": "ray", "address": ray_cluster, "shard_bytes": 4096})
    for number, engine in enumerate(engines):
        monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / f"home-{number}"))  # a fresh workspace: nothing reused
        made.append(deduped(source, engine))
    assert made[0] == made[1] == made[2]
    assert made[0][-1]["clusters.jsonl"].count(b"\n") > 30
    assert made[0][-1]["rejected.jsonl"].count(b"\n") == 8
    assert made[0][-1]["quarantine.jsonl"].count(b"\n") == 8 + 9


def ingest_shard_killed_once(job: ingest.IngestJob) -> dict[str, Any]:
    """ingest's work, but the first shard past the file's start to finish while the marker file is there kills its
    own worker (after writing its files, before its result is out), removing the marker first: the retry must
    replace what the dead one wrote."""
    result = INGEST_SHARD(job)
    marker = job.files[0].parent / "kill-once"
    if job.span is not None and job.span[0] > 0 and marker.exists():
        marker.unlink()
        os.kill(os.getpid(), signal.SIGKILL)
    return result


def test_a_ray_worker_killed_mid_stage_is_run_again_without_a_row_lost_or_doubled(
        ray_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "docs.jsonl"
    write_source(source)
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "home-local"))
    local_ingest, local_validate, local = validated(configured(source, {"workers": 1, "shard_bytes": 4096}))
    (tmp_path / "kill-once").touch()
    monkeypatch.setattr(ingest, "ingest_shard", ingest_shard_killed_once)
    monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / "home-ray"))
    on_ray, checked, files = validated(configured(source, {"name": "ray", "address": ray_cluster,
                                                           "shard_bytes": 4096}))
    assert not (tmp_path / "kill-once").exists()  # a worker died
    assert files == local
    assert (on_ray.key, on_ray.hash, checked.key, checked.hash) == (local_ingest.key, local_ingest.hash,
                                                                    local_validate.key, local_validate.hash)
    assert on_ray.figures.rows_read == local_ingest.figures.rows_read == 300
    assert on_ray.figures.shards == local_ingest.figures.shards > 2



def refused(job: int) -> int:
    if job == 3:
        raise DataSourceError("data source 'x': no data file found")
    return job


def test_a_user_error_in_a_ray_job_comes_back_as_itself(ray_cluster: str) -> None:
    """Ray Data keeps only the traceback of a job's error; a user error must still reach the CLI as one line."""
    with Engine(EngineConfig(name="ray", address=ray_cluster)) as engine:
        assert engine.map("test", refused, [0, 1, 2]) == [0, 1, 2]
        with pytest.raises(DataSourceError, match="^data source 'x': no data file found$"):
            engine.map("test", refused, list(range(6)))
