"""llmops: a dataset in, a trained, evaluated and registered language model out, again whenever the data changes.

The package's layout, declared here once and checked by the test suite: each layer imports only the
layers of a lower rank (packages of one rank do not import each other), and each says whether its
code is part of the stage keys.

- `code`: editing a module of the layer can change an artifact's bytes, so a stage's key hashes the
  modules of these layers that the stage runs (its import closure, walked through these layers only).
- `values`: the config tree; a key holds the values of the fields a stage reads, defaults included,
  so the code that parses them is not hashed.
- `service`: moves, records or schedules bytes without shaping them (where the workspace is, MLflow,
  the worker pool): code of the keyed layers may call it, and the stage keys leave it out. A test
  runs every stage under variations of these services and checks the artifacts are byte-identical.
- `none`: never called by a stage: serving, the registry, Prefect flows, the command line.
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Layer(NamedTuple):
    rank: int
    keys: Literal["code", "values", "service", "none"]
    holds: str


LAYERS: dict[str, Layer] = {
    "io": Layer(0, "code", "user errors, files and their hashes, shards, tables, rejects, a stage's figures"),
    "config": Layer(1, "values", "the one pydantic config tree and how it is read"),
    "store": Layer(2, "service", "the workspace, its artifacts, the shared store and its settings"),
    "tracking": Layer(3, "service", "MLflow runs, logging, cost, sweep trials, a sweep's parent and child runs"),
    "pipeline": Layer(4, "service", "the stage table, its runner, keys, dvc.yaml, the worker pool, a sweep's space and "
                                   "study, whether a run would change nothing"),
    "text": Layer(5, "code", "chat templates, tokenizers, packing, encoding"),
    "models": Layer(5, "code", "building and loading models"),
    "records": Layer(6, "code", "record kinds: fields, column names, checks, content; chat turns"),
    "objectives": Layer(7, "code", "one module per objective behind one interface; scoring; config completion"),
    "data": Layer(8, "code", "ingest, validate, dedup, tokenize, report; readers; data versions and lineage"),
    "training": Layer(9, "code", "the train stage, trainer, callbacks, launchers, checkpoints"),
    "evaluation": Layer(10, "code", "the evaluate stage"),
    "registry": Layer(11, "none", "references, loading, the gate, register, cards, export"),
    "serving": Layer(12, "none", "predict and serve"),
    "monitoring": Layer(12, "none", "served traces: traffic, latency, feedback, drift; rated requests as rows"),
    "flows": Layer(13, "none", "Prefect flows, their tasks, remote stages, the Prefect API, deployments, events; the "
                             "sweep, which sends trials to work pools"),
    "cli": Layer(14, "none", "the llmops command and the process settings it starts with"),
}


def layer_of(module: str) -> str | None:
    """The layer of a module of the package (`llmops.data.ingest` -> `data`); None for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "llmops" else None


def in_keys(module: str) -> bool:
    """Whether a module of the package is hashed into the keys of the stages that run it."""
    name = layer_of(module)
    return name is not None and name in LAYERS and LAYERS[name].keys == "code"
