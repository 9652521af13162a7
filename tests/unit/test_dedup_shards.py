"""Dedup shard by shard: the same bytes whatever the shard size, memory bounded by a shard, no Ray when local."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np

from llmops.config.engine import EngineConfig
from llmops.config.schema import DataConfig, DedupConfig, PipelineConfig
from llmops.data.dedup import KEPT, REMOVED, arrow_columns, write_clusters, write_splits
from llmops.data.duplicates import components, find_duplicates
from llmops.io.shards import byte_ranges, lines_in
from llmops.io.tables import table_index, table_rows, table_schema, table_shards
from llmops.pipeline.engine import Engine
from llmops.records.base import TEXT
from tests.helpers import output_bytes, write_rows_table

OUTPUTS = ("train", "eval", "clusters.jsonl", "contaminated.jsonl")


def corpus(docs: int, seed: int = 0) -> list[str]:
    """Documents of 60 random words; about one in five a copy of an earlier one: exact, or with two words changed."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    texts: list[str] = []
    for _ in range(docs):
        roll = rng.random()
        if texts and roll < 0.07:
            texts.append(rng.choice(texts))
        elif texts and roll < 0.2:
            words = rng.choice(texts).split()
            words[rng.randrange(60)] = "changed"
            words[rng.randrange(60)] = "edited"
            texts.append(" ".join(words))
        else:
            texts.append(" ".join(rng.choice(vocab) for _ in range(60)))
    return texts


def write_valid(path: Path, texts: list[str], eval_every: int = 0, rows_per_group: int = 32) -> Path:
    """Rows as validate writes them, a table of small row groups (so that small shards cut it); with
    `eval_every`, every n-th row comes from a held-out source."""
    rows = []
    for line, text in enumerate(texts, 1):
        split = "eval" if eval_every and line % eval_every == 0 else "train"
        rows.append({"text": text, "_source": f"{split}.jsonl", "_line": line, "_weight": 1.0, "_split": split})
    return write_rows_table(rows, path, rows_per_group)


def splits(tmp_path: Path, name: str, source: Path, data: DataConfig, engine: EngineConfig) -> tuple[dict, dict]:
    folder = tmp_path / name
    folder.mkdir()
    counts = write_splits(DedupConfig(), data, source, folder, engine)
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # the scratch shards are gone
    spread = {key: counts.pop(key) for key in ("shards", "workers", "peak_worker_rss_mb")}
    return output_bytes(folder, *OUTPUTS) | {"counts": counts}, spread


def test_outputs_are_the_same_bytes_whatever_the_shard_size(tmp_path: Path) -> None:
    source = write_valid(tmp_path / "valid", corpus(600), eval_every=7)
    data = DataConfig(kind="text", path="unused.jsonl", eval_sources=[{"path": "eval.jsonl"}])
    whole, one = splits(tmp_path, "whole", source, data, EngineConfig(workers=1))
    for shard_bytes in (4096, 20_000):
        cut, spread = splits(tmp_path, f"cut-{shard_bytes}", source, data,
                             EngineConfig(workers=1, shard_bytes=shard_bytes))
        assert cut == whole
        assert spread["shards"] > one["shards"]
    counts = whole["counts"]
    assert counts["duplicates"] > 20 and counts["near_duplicates"] > 20 and counts["contaminated"] > 5
    assert counts["rows_in"] == 600 == counts["rows_out"] + counts["duplicates"] + counts["near_duplicates"] + \
        counts["contaminated"]


def test_clusters_are_connected_components_whose_first_row_survives() -> None:
    # 5 ~ 9 ~ 3 (a chain) and 20 ~ 40: every row of a component points at its smallest
    nodes, roots = components(np.array([[9, 5], [3, 9], [40, 20]], dtype=np.uint64))
    assert dict(zip(nodes.tolist(), roots.tolist(), strict=True)) == {3: 3, 5: 3, 9: 3, 20: 20, 40: 20}


def test_byte_ranges_cover_the_file_on_line_boundaries(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"".join(b'{"n": %d}\n' % i for i in range(1000)) + b"\n")
    ranges = byte_ranges(path, 1024)
    assert ranges[0][0] == 0 and ranges[-1][1] == path.stat().st_size and len(ranges) > 5
    assert all(end == start for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False))
    lines = [json.loads(line)["n"] for start, end in ranges for _, line in lines_in(path, start, end)]
    assert lines == list(range(1000))


def peak_bytes(tmp_path: Path, docs: int) -> int:
    source = write_valid(tmp_path / f"valid-{docs}", corpus(docs, seed=docs))
    scratch = tmp_path / f"scratch-{docs}"
    scratch.mkdir()
    tracemalloc.start()
    try:
        with Engine(EngineConfig(workers=1)) as engine:
            found = find_duplicates(DedupConfig(), TEXT, False, source, scratch, engine, table_shards(source, 65_536))
        assert len(found) > docs // 10
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_follows_the_shard_not_the_corpus(tmp_path: Path) -> None:
    import rensa  # noqa: F401  (imported before measuring: its import is not the stage's memory)

    peak_bytes(tmp_path, 50)
    small, large = peak_bytes(tmp_path, 400), peak_bytes(tmp_path, 1600)
    # four times the rows (and the duplicates), the same shard size: the peak stays within 1.5x
    assert large < 1.5 * small, (small, large)


def shard_fates(shards: int, per_shard: int) -> tuple[list, list]:
    """What the split jobs of `shards` shards report: each removed row (order 2k + 1) names its survivor (order 2k),
    the shards given in reverse, so that only sorting puts them in row order; every fifth survivor is in eval."""
    removed, kept = [], []
    for shard in reversed(range(shards)):
        orders = [2 * (shard * per_shard + row) + 1 for row in range(per_shard)]
        removed.append(arrow_columns({"order": orders, "exact": [order % 3 == 0 for order in orders],
                                      "source": ["d.jsonl"] * per_shard, "line": [order + 1 for order in orders],
                                      "split": ["train"] * per_shard, "survivor": [order - 1 for order in orders],
                                      "held": ['["a"]'] * per_shard}, REMOVED))
        kept.append(arrow_columns({"survivor": [order - 1 for order in orders],
                                   "kept_source": ["d.jsonl"] * per_shard, "kept_line": orders,
                                   "kept_in_eval": [order % 5 == 0 for order in orders],
                                   "kept_held": ['["a"]' if order % 7 else '["b"]' for order in orders]}, KEPT))
    return removed, kept


def clusters_peak(folder: Path, removed: list, kept: list) -> int:
    tracemalloc.start()
    try:
        write_clusters(folder, removed, kept, ("label",), Counter())
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_clusters_files_are_written_in_row_order_a_batch_at_a_time(tmp_path: Path) -> None:
    """The driver writes every removed row; it holds them as columns and makes Python values a batch at a time, so
    four times the duplicates do not take four times the memory."""
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir()
    large.mkdir()
    counts: Counter[str] = Counter()
    write_clusters(small, *shard_fates(4, 50), ("label",), counts)
    written = [json.loads(line) for line in (small / "clusters.jsonl").open()]
    tainted = [json.loads(line) for line in (small / "contaminated.jsonl").open()]
    assert len(written) + len(tainted) == 200 and counts["contaminated"] == len(tainted) == 40
    assert [entry["line"] for entry in written] == sorted(entry["line"] for entry in written)
    assert all(entry["kept_line"] == entry["line"] - 1 for entry in written + tainted)
    conflicts = [entry for entry in written + tainted if "conflict" in entry]
    assert conflicts and all(entry["conflict"] == {"label": ["a", "b"]} and entry["kind"] == "duplicate"
                             for entry in conflicts) and counts["conflicts"] == len(conflicts)
    write_clusters(large, [], [], ("label",), counts)  # no shards: an input of no rows
    assert (large / "clusters.jsonl").read_text() == (large / "contaminated.jsonl").read_text() == ""
    few, many = clusters_peak(small, *shard_fates(6, 2_000)), clusters_peak(large, *shard_fates(24, 2_000))
    assert many < 1.5 * few, (few, many)


def test_the_local_engine_imports_no_ray(tmp_path: Path) -> None:
    source = write_valid(tmp_path / "valid", corpus(50))
    script = (
        "import sys; from pathlib import Path\n"
        "from llmops.config.schema import PipelineConfig\n"
        "from llmops.data.dedup import write_splits\n"
        f"config = PipelineConfig(data={{'kind': 'text', 'path': 'x.jsonl'}}, engine={{'workers': 1}})\n"
        f"write_splits(config.dedup, config.data, Path({str(source)!r}), Path({str(tmp_path)!r}), config.engine)\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_engine_is_placement_and_has_a_shorthand() -> None:
    plain = PipelineConfig()
    on_ray = PipelineConfig(engine="ray")
    assert on_ray.engine.name == "ray" and plain.engine.name == "local"
    assert on_ray.digest() == plain.digest()
    assert PipelineConfig(engine={"name": "ray", "address": "auto", "workers": 4}).engine.ray_address() == "auto"


def test_engine_ray_without_ray_installed_is_one_line() -> None:
    """Ray is an optional extra: asking for it where it is not installed says how to get it, as a user error."""
    script = (
        "import sys; sys.modules['ray'] = None\n"
        "from llmops.config.schema import PipelineConfig\n"
        "from llmops.pipeline.engine import Engine\n"
        "from llmops.io.errors import UserError\n"
        "try:\n"
        "    Engine(PipelineConfig(engine='ray').engine)\n"
        "except UserError as err:\n"
        "    print(err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "engine: ray needs Ray: pip install 'llmops[ray]' (or set engine: local)"


def test_the_splits_keep_the_input_columns_and_values(tmp_path: Path) -> None:
    rows = [{"text": text, "_source": "d.jsonl", "_line": line, "_weight": 2.0 if line % 5 == 0 else 1.0,
             "extra": {"a": None, "b": line} if line % 2 else None, "n": line if line % 3 else 1.5}
            for line, text in enumerate(corpus(200), 1)]
    source = write_rows_table(rows, tmp_path / "valid", rows_per_group=16)
    folder = tmp_path / "out"
    folder.mkdir()
    write_splits(DedupConfig(), DataConfig(kind="text", path="unused.jsonl", eval_fraction=0.2), source, folder,
                 EngineConfig(workers=1, shard_bytes=4096))
    for split in ("train", "eval"):
        assert table_schema(folder / split).equals(table_schema(source))
        assert table_index(folder / split)["json_columns"] == table_index(source)["json_columns"] == ["n"]
    written = {row["_line"]: row for row in table_rows(source)}
    train, evaluation = list(table_rows(folder / "train")), list(table_rows(folder / "eval"))
    assert all(row == written[row["_line"]] for row in train + evaluation)
    # a training row of weight 2 is taken twice, next to itself, wherever its row group falls
    lines = [row["_line"] for row in train]
    assert lines == sorted(lines) and 100 < len(set(lines)) + len(evaluation) < 200
    assert all(lines.count(line) == (2 if line % 5 == 0 else 1) for line in lines)
