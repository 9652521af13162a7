"""The schedules of prefect.yaml start flow runs on a real Prefect server with its scheduler on: `llmops deploy` from a
fresh clone registers the shipped deployments, the nightly cron of `default` is active as `0 3 * * *` in UTC and the
scheduler lays out its runs at 03:00 UTC; the interval of `on-data-change`, set to a few seconds through the API, has
the scheduler create that deployment's runs by itself, each due one interval after the other, and once one is due and
no worker took it, the server marks it Late (no worker here: nothing runs the flows).
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.integration.stack import CLONE_CLI, pool_stack, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]
INTERVAL = 3  # seconds between the runs of on-data-change on this server
SERVER = {
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "true",
    "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_LOOP_SECONDS": "1",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_AFTER_SECONDS": "1",
}


def deployment(api: str, name: str) -> dict:
    found = httpx.get(f"{api}/deployments/name/{name}", timeout=10)
    assert found.status_code == 200, found.text
    return found.json()


def runs_of(api: str, deployment_id: str) -> list[dict]:
    body = {"deployments": {"id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 200}
    return httpx.post(f"{api}/flow_runs/filter", json=body, timeout=10).json()


def starts(runs: list[dict]) -> list[datetime]:
    return [datetime.fromisoformat(found["expected_start_time"]) for found in runs]


def gaps(times: list[datetime]) -> list[timedelta]:
    return [later - earlier for earlier, later in zip(times, times[1:], strict=False)]


def scheduled_runs(api: str, deployment_id: str, enough, seconds: float = 40) -> list[dict]:
    """The deployment's runs once `enough(runs)` holds; the scheduler is the only thing that creates them here."""
    deadline = time.monotonic() + seconds
    while not enough(found := runs_of(api, deployment_id)):
        assert time.monotonic() < deadline, f"the scheduler did not create the runs within {seconds} s: {found}"
        time.sleep(0.5)
    return found


def test_the_scheduler_starts_the_runs_of_the_shipped_schedules_by_itself(tmp_path: Path) -> None:
    with pool_stack(tmp_path, **SERVER) as stack:
        api = stack.api
        run([*CLONE_CLI, "deploy"], stack.project, stack.sender_env)

        nightly = deployment(api, "training_pipeline/default")
        (cron,) = nightly["schedules"]
        assert cron["active"] and cron["schedule"]["cron"] == "0 3 * * *" and cron["schedule"]["timezone"] == "UTC"
        planned = scheduled_runs(api, nightly["id"], lambda found: len(found) >= 3)
        days = starts(planned)
        assert [(start.hour, start.minute, start.second, start.utcoffset()) for start in days] == [
            (3, 0, 0, timedelta(0))
        ] * len(days), days
        assert gaps(days) == [timedelta(days=1)] * (len(days) - 1)
        assert all(found["auto_scheduled"] and found["state_type"] == "SCHEDULED" for found in planned)

        fallback = deployment(api, "retrain_on_data_change/on-data-change")
        (interval,) = fallback["schedules"]
        assert interval["active"] and interval["schedule"]["interval"] == 900
        changed = httpx.patch(
            f"{api}/deployments/{fallback['id']}/schedules/{interval['id']}",
            timeout=10,
            json={"schedule": {"interval": INTERVAL}},
        )
        assert changed.status_code == 204, changed.text
        changed_at = datetime.now().astimezone()
        # the change deleted the runs the 900 s schedule had laid out: every run now is one of the new schedule's
        spaced = scheduled_runs(api, fallback["id"], lambda found: len(found) >= 3)
        assert gaps(starts(spaced)) == [timedelta(seconds=INTERVAL)] * (len(spaced) - 1)
        assert starts(spaced)[0] - changed_at < timedelta(seconds=INTERVAL + 30)
        assert all(found["auto_scheduled"] for found in spaced)
        late = scheduled_runs(api, fallback["id"], lambda found: any(r["state_name"] == "Late" for r in found))
        (first_late, *_) = [found for found in late if found["state_name"] == "Late"]
        assert first_late["auto_scheduled"] and first_late["state_type"] == "SCHEDULED"
        assert datetime.fromisoformat(first_late["expected_start_time"]) <= datetime.now().astimezone()
        print(
            f"\n{len(days)} nightly runs at 03:00 UTC; {len(spaced)} runs {INTERVAL} s apart, the first Late "
            f"{(datetime.now().astimezone() - changed_at).total_seconds():.1f} s after the change"
        )
