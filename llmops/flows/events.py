"""The Prefect events llmops emits: `llmops.data.updated` when a dataset version is pinned or stored, and
`llmops.model.drifted` when `llmops monitor` finds a version's served inputs drifted from its training data.

The resource is the dataset (`llmops.dataset.<path>`); its labels carry the md5 and whether the
version is on the DVC remote yet, so that a deployment trigger can start a retraining for each new
version a worker can actually pull (`for_each` the md5, only `stored` ones). The payload carries the
md5, the .dvc file and the git commit. Events need a Prefect server: with the embedded ephemeral
API there is nothing to react to them, so none is sent.
"""

from __future__ import annotations

import asyncio
from typing import Any

from llmops.data.lineage import git_state
from llmops.data.versions import PinnedData
from llmops.flows.api import prefect_api_url
from llmops.io.files import project_root

DATA_UPDATED = "llmops.data.updated"
RESOURCE_PREFIX = "llmops.dataset."
# `llmops monitor` found a version's served requests drifted from its training data
MODEL_DRIFTED = "llmops.model.drifted"
MODEL_PREFIX = "llmops.model."
# an unreachable server costs a couple of short retries, not the client's default ten
CONNECT_ATTEMPTS = 2


def data_updated(data: PinnedData, action: str, commit: str, dirty: bool) -> Any:
    """The event for one dataset version; `action` is `add` (pinned here) or `push` (stored on the DVC remote)."""
    from prefect.events import Event

    stored = action == "push"
    return Event(
        event=DATA_UPDATED,
        resource={"prefect.resource.id": f"{RESOURCE_PREFIX}{data.path}", "prefect.resource.name": data.path,
                  "llmops.dataset.md5": data.md5, "llmops.dataset.stored": str(stored).lower()},
        payload={"md5": data.md5, "dvc_file": data.dvc_file, "path": data.path, "action": action,
                 "stored": stored, "git_commit": commit, "git_dirty": dirty})


def announce_data(datasets: list[PinnedData], action: str) -> list[Any] | None:
    """Send `llmops.data.updated` for each dataset version; None (nothing sent) without a Prefect server."""
    if prefect_api_url() is None or not datasets:
        return None
    commit, dirty = git_state(project_root())
    events = [data_updated(data, action, commit, dirty) for data in datasets]
    asyncio.run(send(events))
    return events


def model_drifted(name: str, version: str, drift: dict[str, Any]) -> Any:
    """The event for one drifted version: the resource is the registered model, the payload the drifted checks."""
    from prefect.events import Event

    checks = {check: {"p_value": tested["p_value"], "statistic": tested["statistic"]}
              for check, tested in drift.get("checks", {}).items() if tested.get("drifted")}
    return Event(event=MODEL_DRIFTED,
                 resource={"prefect.resource.id": f"{MODEL_PREFIX}{name}", "prefect.resource.name": name,
                           "llmops.model.version": version},
                 payload={"version": version, "requests": drift.get("requests", 0), "checks": checks})


def announce_drift(name: str, drifted: dict[str, dict[str, Any]]) -> list[Any] | None:
    """Send `llmops.model.drifted` for each drifted version; None (nothing sent) without a Prefect server."""
    if prefect_api_url() is None or not drifted:
        return None
    events = [model_drifted(name, version, drift) for version, drift in drifted.items()]
    asyncio.run(send(events))
    return events


async def send(events: list[Any]) -> None:
    from prefect.events.clients import get_events_client

    async with get_events_client(reconnection_attempts=CONNECT_ATTEMPTS) as client:
        for event in events:
            await client.emit(event)
