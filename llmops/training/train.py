"""Train: the selected objective's model trained on the tokenized cache, in this process or in launched workers.

The model is built from the config with random init, or loaded with `from_pretrained`; full
fine-tuning or a LoRA / QLoRA adapter. One process trains here; DDP, FSDP and DeepSpeed run as worker
processes started by a real launcher (training/launch.py), each running `fit` (training/trainer.py).
Work happens in a resumable folder: a run that dies resumes from its last complete checkpoint (here,
or in the checkpoint store), every sample trained on is written to a ledger per optimizer step, and
the folder is renamed into place only once the final weights are saved, without pickles or paths.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from llmops.config.schema import ModelConfig, PipelineConfig, TrainConfig
from llmops.data.tokenize import TokenizeRecord
from llmops.models import modeling
from llmops.objectives import selected
from llmops.pipeline.stages import StageContext
from llmops.tracking import runs
from llmops.training import checkpoints, launch, ray_train, worker
from llmops.training.launch import LaunchPlan, TrainingInterrupted
from llmops.training.session import FIGURES_FILE, INTERRUPTED_FILE, SPEC_FILE, Session, TrainFigures, TrainRecord
from llmops.training.trainer import fit

log = logging.getLogger("llmops.train")

__all__ = ["TrainFigures", "TrainRecord", "train"]


def train(config: PipelineConfig, tokenized: TokenizeRecord, context: StageContext) -> TrainFigures:
    """Train into the context's folder; its key names the training in the checkpoint store, its run gets the live
    figures."""
    plan = launch.fitted_to_adapter(launch.plan_for(config), config.train,
                                    config.model.adapter)
    return run_training(config, tokenized, Session(folder=str(context.folder), key=context.key, run=context.run,
                                                   plan=plan.__dict__))


def model_files(relative: str) -> bool:
    """The weights and tokenizer define a trained model: the same ones are never registered twice."""
    return relative.startswith("model/")


def input_fingerprints(config: PipelineConfig, root: Path) -> dict[str, Any]:
    """A pretrained base's content, how the training is spread and the attention kernel: all shape the weights; so
    does the content of every reward model GRPO is rewarded by (a registered one is known by its content, as the
    base is)."""
    judges = [modeling.base_fingerprint(ModelConfig(name_or_path=reward.model), root)
              for reward in config.grpo.rewards if reward.model]
    return {"base": modeling.base_fingerprint(config.model, root),
            "launch": launch.fingerprint(launch.fitted_to_adapter(launch.plan_for(config),
                                                                  config.train, config.model.adapter)),
            "attention": selected(config.data).attention(config.model), **({"reward_models": judges} if judges else {})}


def run_training(config: PipelineConfig, tokenized: TokenizeRecord, session: Session) -> TrainFigures:
    """Train in this process or in launched workers, from the last complete checkpoint, then finish the folder."""
    folder, plan = Path(session.folder), LaunchPlan(**session.plan)
    # on Ray, Ray Train hands its workers the run's last checkpoint (ray_train.py)
    resume = None if plan.engine == "ray" else resume_point(config.train, folder, session.key)
    session = session.model_copy(update={"resume_from": str(resume) if resume else None})
    runs.link_resumed_run(folder / "runs.json", session.run)
    (folder / INTERRUPTED_FILE).unlink(missing_ok=True)
    if plan.inline:
        figures = fit(config, tokenized, session)
    elif plan.engine == "ray":
        figures = ray_train.run_on_ray(config, tokenized, session)
    else:
        spec = folder / SPEC_FILE
        spec.write_text(json.dumps({"config": config.as_dict(), "tokenized": tokenized.model_dump(mode="json"),
                                    "session": session.model_dump(mode="json")}))
        # the launched processes run the worker module: imported here, its code is part of this stage's key
        launch.run_workers(plan, config.launch.rendezvous, spec, folder, worker.__name__)
        stopped = folder / INTERRUPTED_FILE
        if stopped.is_file():
            raise TrainingInterrupted(json.loads(stopped.read_text())["message"])
        figures = TrainFigures.model_validate_json((folder / FIGURES_FILE).read_text())
    merge_saved_adapter(config, folder)
    finish(folder, config.train, session.key)
    return figures


def resume_point(config: TrainConfig, folder: Path, key: str) -> Path | None:
    """The newest complete checkpoint here, else in the checkpoint store; the ledger forgets the steps after it."""
    from llmops.training.callbacks import trim_ledger

    local = folder / "checkpoints"
    local.mkdir(parents=True, exist_ok=True)
    found = checkpoints.latest_complete(local)
    if found is not None and config.checkpoint_dir:
        found = checkpoints.completed_from_store(found, config.checkpoint_dir, key)
    if found is not None and not checkpoints.holds_weights(found):
        # a machine other than rank 0's in a multi-node training: rank 0 alone saves the weights, so this machine's
        # checkpoints cannot be resumed from; the ones rank 0 uploaded to the store can
        log.info("%s here holds no weights (rank 0 saves them): resuming from the checkpoint store", found.name)
        shutil.rmtree(local)
        local.mkdir()
        found = None
    if found is None and config.checkpoint_dir:
        found = checkpoints.download_latest(config.checkpoint_dir, key, local)
    (folder / "ledger").mkdir(exist_ok=True)
    trim_ledger(folder / "ledger", checkpoints.step_of(found) if found else 0)
    if found:
        log.info("resuming training from %s", found.name)
    return found


def merge_saved_adapter(config: PipelineConfig, folder: Path) -> None:
    """lora.merge after a sharded training (FSDP, ZeRO-3) or a QLoRA one: the training saved the adapter only; here,
    in one process, it goes onto a fresh whole base loaded unquantized and is merged in (merging shards on one rank
    gives empty weights; merging into a 4-bit base rounds the deltas to 4 bits)."""
    model_dir, adapter_dir = folder / "model", folder / checkpoints.ADAPTER_DIR
    if not (config.model.adapter != "none" and config.model.lora.merge and modeling.is_adapter(adapter_dir)) or any(
            model_dir.glob("*.safetensors")):
        return
    model = selected(config.data).load_adapter(adapter_dir, config.data.labels)
    model.merge_and_unload().save_pretrained(str(model_dir))
    log.info("merged the gathered adapter into a fresh %s", config.model.name_or_path)


def finish(folder: Path, config: TrainConfig, key: str) -> None:
    """Consolidate sharded weights into one file and drop what only a resume needed."""
    kind = checkpoints.consolidate(folder / "model")
    if kind:
        log.info("consolidated the %s shards into model/model.safetensors", kind)
    for transient in ("checkpoints", "set-aside", SPEC_FILE, FIGURES_FILE, "runs.json"):
        target = folder / transient
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
    if config.checkpoint_dir:
        checkpoints.forget(config.checkpoint_dir, key)
