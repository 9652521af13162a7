"""An unchanged run, as `llmops run` tells it before starting anything: the plan is the last run's, every artifact is
in the workspace and its files are as that run left them."""

from __future__ import annotations

import os

from llmops.config.schema import PipelineConfig
from llmops.io.files import project_root
from llmops.pipeline.runner import plan
from llmops.pipeline.stages import stage
from llmops.pipeline.up_to_date import last_run_file, remember_run, unchanged_stages
from llmops.store.artifacts import RECORD_FILE
from llmops.store.workspace import artifact_dir


def test_a_run_is_unchanged_while_its_plan_and_artifacts_are(sft_config: PipelineConfig) -> None:
    summary = {"registration": {"model_name": "m", "version": 1}, "stages": {}}
    assert unchanged_stages(sft_config) is None  # no run yet
    keys = plan(sft_config, project_root())
    records = [artifact_dir(name, key) / RECORD_FILE for name, key in keys.items() if stage(name).artifact]
    for record in records[:-1]:
        record.parent.mkdir(parents=True)
        record.write_text("{}")
    remember_run(sft_config, summary)
    assert unchanged_stages(sft_config) is None  # a stage would be computed
    records[-1].parent.mkdir(parents=True)
    records[-1].write_text("{}")
    remember_run(sft_config, summary)
    assert unchanged_stages(sft_config) == {**summary, "stages": {name: "reused" for name in keys}}
    # another plan, a file changed since, or half a record of the last run: the flow runs
    other = sft_config.model_copy(update={"train": sft_config.train.model_copy(update={"seed": 7})})
    assert unchanged_stages(other) is None
    stat = records[0].stat()
    os.utime(records[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert unchanged_stages(sft_config) is None
    remember_run(sft_config, summary)
    last_run_file().write_text(last_run_file().read_text()[:40])
    assert unchanged_stages(sft_config) is None
