"""A launched training process (`python -m llmops.training.worker SPEC`): one rank of a DDP, FSDP or DeepSpeed run.

It reads the spec the train stage wrote, trains its rank, and on failure leaves the error where the
launcher reads it; its traceback goes to its output, which the launcher keeps in the workers' log.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from llmops.config.schema import PipelineConfig
from llmops.data.tokenize import TokenizeRecord
from llmops.io.errors import UserError
from llmops.training import launch
from llmops.training.launch import TrainingInterrupted
from llmops.training.session import Session
from llmops.training.trainer import fit


def worker_main(spec_path: str) -> int:
    """Read the spec, train this rank; 0 when it finished or stopped cleanly, 1 when it failed."""
    from accelerate import PartialState

    spec = json.loads(Path(spec_path).read_text())
    config = PipelineConfig.model_validate(spec["config"])
    tokenized = TokenizeRecord.model_validate(spec["tokenized"])
    session = Session.model_validate(spec["session"])
    rank = int(os.environ.get("RANK", "0"))
    show_progress(rank)
    try:
        fit(config, tokenized, session)
    except TrainingInterrupted:
        return 0
    except BaseException as err:
        report_failure(Path(session.folder) / "logs", rank, err)
        return 1
    finally:
        if PartialState().use_distributed:
            import torch

            torch.distributed.destroy_process_group()
    return 0


def show_progress(rank: int) -> None:
    """A worker's log lines go to its output, marked so that the launcher passes them on to the stage log."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"{launch.PROGRESS_MARK}[rank {rank}] %(message)s"))
    logger = logging.getLogger("llmops")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)


def report_failure(logs: Path, rank: int, err: BaseException) -> None:
    traceback.print_exc()
    logs.mkdir(parents=True, exist_ok=True)
    message = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
    (logs / f"error-rank-{rank}.json").write_text(json.dumps({"rank": rank, "time": time.time(),
                                                              "message": " ".join(message.split())[:1000]}))


if __name__ == "__main__":
    from llmops.training import worker as module  # run the imported module, not this __main__ copy: one set of globals

    sys.exit(module.worker_main(sys.argv[1]))
