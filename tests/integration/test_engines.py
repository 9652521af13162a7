"""The validate, dedup and tokenize stages on each engine, one corpus: a local process pool and a real Ray cluster of
two nodes (two raylets on this machine) make the same artifacts, byte for byte, under the same keys."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmops.core.config import PipelineConfig
from llmops.core.workspace import write_jsonl
from tests.helpers import stage
from tests.unit.test_dedup_shards import OUTPUTS, corpus

pytestmark = pytest.mark.slow


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
        cluster.shutdown()


def deduped(source: Path, engine: dict) -> tuple[str, str, dict[str, bytes]]:
    config = PipelineConfig(data={"kind": "text", "path": str(source), "eval_fraction": 0.2},
                            tokenize={"vocab_size": 300, "max_length": 32}, engine=engine)
    validated = stage("validate", config, stage("ingest", config))
    record = stage("dedup", config, validated)
    tokenized = stage("tokenize", config, record)
    assert not validated.reused and not record.reused and not tokenized.reused
    files = {name: (record.dir / name).read_bytes() for name in OUTPUTS}
    files["quarantine.jsonl"] = (validated.dir / "quarantine.jsonl").read_bytes()
    return validated.key, validated.hash, record.key, record.hash, tokenized.key, tokenized.hash, files


def test_every_engine_makes_the_same_artifacts(ray_cluster: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "docs.jsonl"
    rows = [{"text": text} for text in corpus(300, seed=3)]
    for position in range(0, 300, 37):  # rows the quarantine takes: empty, and too long
        rows[position] = {"text": "" if position % 2 else "x" * 30_000}
    write_jsonl(source, rows)
    made = []
    # one shard in this process; many on a pool of two; smaller ones still on the two nodes of the Ray cluster
    engines = ({"workers": 1, "shard_bytes": 2**25}, {"workers": 2, "shard_bytes": 8192},
               {"name": "ray", "address": ray_cluster, "shard_bytes": 4096})
    for number, engine in enumerate(engines):
        monkeypatch.setenv("LLMOPS_HOME", str(tmp_path / f"home-{number}"))  # a fresh workspace: nothing reused
        made.append(deduped(source, engine))
    assert made[0] == made[1] == made[2]
    assert made[0][-1]["clusters.jsonl"].count(b"\n") > 30
    assert made[0][-1]["quarantine.jsonl"].count(b"\n") == 9

