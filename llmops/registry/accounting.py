"""A run's cost from its stage records, logged on its MLflow run, tagged on the version, and said in one line.

The stage runner accounts the run just before the register stage, from the records of every stage
before it (each artifact's record keeps what building it took, store/artifacts.py), logs the figures
on the run and hands them to register, which puts them on the version, its card and its record.
The arithmetic is tracking/cost.py's.
"""

from __future__ import annotations

import logging
from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.data.dedup import DedupRecord
from llmops.data.tokenize import TokenizeRecord
from llmops.data.validate import ValidateRecord
from llmops.pipeline.stages import STAGES
from llmops.tracking import cost
from llmops.tracking import log as tracking
from llmops.tracking.cost import CostFigures, LostTokens
from llmops.tracking.log import RunHandle
from llmops.training.session import TrainRecord

log = logging.getLogger("llmops.cost")
TAG_PREFIX = "cost."


def run_cost(config: PipelineConfig, records: list[Any]) -> CostFigures | None:
    """The run's figures from the records of its stages (the ones built here, the ones reused); None, with a
    warning, when a stage with an artifact is missing or its record does not say what building it took."""
    by_stage = {record.stage: record for record in records}
    wanted = [spec.name for spec in STAGES if spec.artifact]
    missing = [name for name in wanted if getattr(by_stage.get(name), "compute", None) is None]
    if missing:
        log.warning("no cost figures: no build record of %s", ", ".join(missing))
        return None
    prices = config.cost.device_hour
    stages = {name: cost.stage_cost(by_stage[name].compute, by_stage[name].reused, prices) for name in wanted}
    trained: TrainRecord = by_stage["train"]
    return cost.total(stages, trained.figures.tokens, lost_tokens(by_stage["validate"], by_stage["dedup"],
                                                                    by_stage["tokenize"], trained), prices)


def logged_run_cost(config: PipelineConfig, records: list[Any], run: RunHandle | None) -> CostFigures | None:
    """What the run's stages so far cost (the register stage puts it on the version), logged on the run."""
    spent = run_cost(config, records)
    if spent is not None and run is not None:
        log_cost(run, spent)
    return spent


def lost_tokens(validated: ValidateRecord, deduped: DedupRecord, tokenized: TokenizeRecord,
                trained: TrainRecord) -> LostTokens:
    """Each cause's tokens as training would have seen them: per pass over the data, times the epochs trained."""
    dedup, split, epochs = deduped.figures, tokenized.figures.train, trained.figures.epochs
    per_row = split.tokens / split.rows if split.rows else 0.0
    # a removed row goes to training as often as a kept one: the training rows written (source weights repeat
    # them) per row kept; a contaminated row was a training row, repeated as training rows are
    share = dedup.train_rows_weighted / dedup.rows_out if dedup.rows_out else 0.0
    repeats = dedup.train_rows_weighted / dedup.train_rows if dedup.train_rows else 0.0
    duplicates = dedup.duplicates + dedup.near_duplicates
    return LostTokens(
        quarantined_est=cost.estimated_tokens(validated.figures.rows_quarantined, per_row, share, epochs),
        duplicates_est=cost.estimated_tokens(duplicates, per_row, share, epochs),
        contaminated_est=cost.estimated_tokens(dedup.contaminated, per_row, repeats, epochs),
        truncated=None if split.truncated_tokens is None else round(split.truncated_tokens * epochs),
        padding=cost.padding_tokens(trained.figures.tokens, trained.figures.padding_fraction))


def log_cost(run: RunHandle, figures: CostFigures) -> None:
    """The figures as metrics `cost/<figure>` on the run, and what they are in words as tags."""
    tracking.log_metrics(run.tracking, run.run_id, {tracking.metric_name("cost", k): v
                                                    for k, v in figures.loggable().items()})
    tracking.set_tags(run.tracking, run.run_id, {"cost.devices": devices(figures), "cost.summary": line(figures)})


def version_tags(figures: CostFigures | None) -> dict[str, str]:
    """The figures as the version's tags `cost.<figure>` (what `llmops models show` prints)."""
    if figures is None:
        return {}
    numbers = {TAG_PREFIX + name: f"{value:.6g}" for name, value in figures.loggable().items()
               if not name.startswith("stages.")}
    return {**numbers, "cost.devices": devices(figures)}


def devices(figures: CostFigures) -> str:
    """The devices the computed stages ran on, e.g. `cpu, 4× NVIDIA H100 80GB HBM3`; `none` when all was reused."""
    held = sorted({(spent.device, spent.devices) for spent in figures.stages.values() if not spent.reused})
    return ", ".join(device if count == 1 else f"{count}× {device}" for device, count in held) or "none"


def line(figures: CostFigures) -> str:
    """The run's cost in one line: hours computed and reused, useful and lost tokens, and the price if there is one."""
    lost = figures.lost
    causes = [f"{amount(lost.quarantined_est)} quarantined est.", f"{amount(lost.duplicates_est)} duplicates est."]
    if lost.contaminated_est:
        causes.append(f"{amount(lost.contaminated_est)} contaminated est.")
    causes += [f"{amount(lost.truncated) if lost.truncated is not None else '?'} truncated",
               f"{amount(lost.padding)} padding"]
    text = (f"{hours(figures.computed_device_hours)} device-hours computed ({devices(figures)}), "
            f"{hours(figures.reused_device_hours)} reused (saved); {amount(figures.useful_tokens)} useful tokens "
            f"(lost: {', '.join(causes)})")
    return text + price_clause(figures)


def price_clause(figures: CostFigures) -> str:
    if figures.unpriced:
        return f"; no price for {', '.join(figures.unpriced)} in cost.device_hour"
    if figures.computed_cost is None:
        return ""
    per_million = figures.cost_per_million_useful_tokens
    saved = f" (saved {money(figures.saved_cost)})" if figures.saved_cost else ""
    rate = f", {money(per_million)} per 1M useful tokens" if per_million is not None else ""
    return f"; price {money(figures.computed_cost)}{saved}{rate}"


def hours(value: float) -> str:
    return f"{value:.3g}"


def money(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def amount(tokens: int) -> str:
    """A token count a person reads at a glance: 950, 3.1k, 40k, 1.2M, 3.4B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(tokens) >= scale:
            value = tokens / scale
            return f"{value:.2g}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return str(tokens)

