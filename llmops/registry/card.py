"""The model card: what a registered version is, how it was made, how it scores, and how to load it.

Logged with the model (its model_card.md) and set as the version's description (clipped to what the
registry stores; the logged card is whole). Written from the run's own records: the config, the
data report, the training figures, the evaluation against the untrained or base model, the
registry gate's comparison with the champion on the frozen set, and the lineage.
"""

from __future__ import annotations

from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.data.lineage import Lineage
from llmops.data.report import ReportRecord
from llmops.evaluation.benchmarks import shown
from llmops.evaluation.evaluate import SAMPLES, EvaluateFigures, EvaluateRecord
from llmops.io.files import read_jsonl
from llmops.objectives import selected
from llmops.objectives.metrics import MetricTable
from llmops.registry import accounting
from llmops.registry.gate import Comparison, Verdict, fmt
from llmops.tracking import log as tracking
from llmops.tracking.cost import CostFigures
from llmops.training.session import TrainRecord

# the registry's SQL stores keep at most this many characters of a version's description
DESCRIPTION_LIMIT = tracking.DESCRIPTION_LIMIT
SAMPLES_SHOWN = 5


def model_card(config: PipelineConfig, trained: TrainRecord, evaluated: EvaluateRecord, described: ReportRecord,
               lineage: Lineage, verdict: Verdict, run_id: str, cost: CostFigures | None = None) -> str:
    name, objective = config.registry.model_name, selected(config.data)
    summary = objective.summary[0].upper() + objective.summary[1:]
    sections = [f"# {name}\n\n{summary}. Registry decision: "
                f"**{verdict.alias or 'no alias'}**: {verdict.reason.removeprefix('no alias: ')}.",
                model_section(config, trained), data_section(config, described, lineage),
                training_section(config, trained), *([cost_section(cost)] if cost is not None else []),
                evaluation_section(evaluated, objective.metrics), *benchmarks_section(evaluated.figures),
                champion_section(verdict.comparison, evaluated.figures.primary_metric),
                limitations_section(config, evaluated, described, verdict), license_section(config),
                loading_section(config, name, run_id), lineage.card_section().strip(),
                # last: the longest section, the first to go when the registry clips the description
                samples_section(evaluated)]
    return "\n\n".join(sections) + "\n"


def model_section(config: PipelineConfig, trained: TrainRecord) -> str:
    model, figures = config.model, trained.figures
    if model.name_or_path:
        base = f"fine-tuned from `{model.name_or_path}`" + (f" (revision `{model.revision}`)" if model.revision else "")
    else:
        base = (f"trained from scratch: {model.architecture}, hidden size {model.hidden_size}, {model.num_layers} "
                f"layers, {model.num_heads} heads, with a BPE tokenizer trained on the data")
    adapter = "" if model.adapter == "none" else (f"; a {model.adapter.upper()} adapter (r {model.lora.r}, alpha "
                                                  f"{model.lora.alpha}){', merged' if model.lora.merge else ''}")
    return (f"## Model\n\nBase model: {base}{adapter}. Parameters: {figures.parameters:,} "
            f"({figures.trainable_parameters:,} trained).")


def data_section(config: PipelineConfig, described: ReportRecord, lineage: Lineage) -> str:
    report, data = described.figures, config.data
    sources = ", ".join(f"`{s.path or s.name}`" for s in data.sources)
    held_out = ", ".join(f"`{s.path or s.name}`" for s in data.eval_sources) or \
        f"a salted hash split ({data.eval_fraction:.0%})"
    return (f"## Data\n\nKind **{data.kind}**, license **{data.license}**. Sources: {sources}; held out: {held_out}. "
            f"{report.rows_read} rows read, {report.rows_quarantined} quarantined, "
            f"{report.duplicates + report.near_duplicates} duplicates, {report.contaminated} contaminated; "
            f"{report.train_rows} train and {report.eval_rows} eval rows; {report.train_tokens:,} training tokens "
            f"(p95 {report.token_length.p95:.0f} tokens per sample, {report.truncation_rate:.1%} truncated at "
            f"{report.max_length}). DVC md5 `{lineage.data.dvc_md5 or 'untracked'}`, sha256 of the data files "
            f"`{lineage.data_sha256[:16]}`.")


def training_section(config: PipelineConfig, trained: TrainRecord) -> str:
    train, figures = config.train, trained.figures
    settings = {"epochs": train.epochs, "max_steps": train.max_steps, "batch size": train.batch_size,
                "grad accumulation": train.grad_accum, "learning rate": train.learning_rate,
                "scheduler": train.lr_scheduler, "warmup ratio": train.warmup_ratio,
                "weight decay": train.weight_decay, "max grad norm": train.max_grad_norm,
                "precision": train.precision, "packing": figures.packed, "max length": config.tokenize.max_length,
                "seed": train.seed}
    rows = "\n".join(f"| {key} | {value} |" for key, value in settings.items())
    loss = (f"Loss {fmt(figures.first_logged_loss)} → {fmt(figures.last_logged_loss)}"
            if figures.first_logged_loss is not None and figures.last_logged_loss is not None
            else f"Training loss {fmt(figures.train_loss)}")
    return (f"## Training\n\n| hyperparameter | value |\n| --- | --- |\n{rows}\n\n{loss} over {figures.steps} steps, "
            f"{figures.tokens:,} tokens in {figures.seconds:.0f} s.")


def cost_section(cost: CostFigures) -> str:
    """What making this version took, stage by stage, and the tokens it learned from and lost (see the README's
    Cost section: the quarantined, duplicate and contaminated tokens are estimates)."""
    rows = "\n".join(f"| {name} | {'reused' if spent.reused else 'computed'} | {spent.device} | {spent.devices} | "
                     f"{spent.seconds:.1f} | {spent.device_hours:.3g} |" for name, spent in cost.stages.items())
    return (f"## Cost\n\n{accounting.line(cost)}.\n\n| stage | in this run | device | devices | seconds | "
            f"device-hours |\n| --- | --- | --- | --- | --- | --- |\n{rows}")


def with_interval(value: float, interval: dict[str, float] | None) -> str:
    if interval is None:
        return fmt(value)
    return f"{fmt(value)} [{fmt(interval['low'])}, {fmt(interval['high'])}]"


def evaluation_section(evaluated: EvaluateRecord, metrics: MetricTable) -> str:
    figures = evaluated.figures
    baseline, primary = figures.baseline, figures.primary_metric
    rows = []
    for name, value in figures.metrics["trained"].items():
        gain = figures.gain_over_baseline[name]
        rows.append(f"| {name}{' (primary)' if name == primary else ''} | "
                    f"{with_interval(value, figures.intervals['trained'].get(name))} | "
                    f"{with_interval(figures.metrics[baseline][name], figures.intervals[baseline].get(name))} | "
                    f"{with_interval(gain['gain'], gain)} |")
    return (f"## Evaluation\n\n{figures.examples} held-out examples (md5 `{figures.heldout_md5}`), 95% bootstrap "
            f"intervals. Primary metric **{primary}**: {figures.primary_reason}.\n\n"
            f"| metric | this version | {baseline} model | gain (positive: better) |\n| --- | --- | --- | --- |\n"
            + "\n".join(rows) + "\n\n" + metric_glossary(list(figures.metrics["trained"]), metrics))


def benchmarks_section(figures: EvaluateFigures) -> list[str]:
    """The lm-eval tasks of evaluate.benchmarks on this version and its starting point (none when none ran)."""
    if not figures.benchmarks:
        return []
    baseline, trained = figures.baseline, figures.benchmarks["trained"]
    rows = [f"| {task} | {score['metric']} | {with_interval(score['score'], score)} | "
            f"{with_interval(figures.benchmarks[baseline][task]['score'], figures.benchmarks[baseline][task])} | "
            f"{score['samples']} |" for task, score in trained.items()]
    return ["## Benchmarks\n\nlm-evaluation-harness tasks, each on its main metric, 95% intervals (± 1.96 standard "
            f"errors).\n\n| task | metric | this version | {baseline} model | documents |\n"
            "| --- | --- | --- | --- | --- |\n"
            + "\n".join(rows)]


def champion_section(comparison: Comparison | None, primary: str) -> str:
    if comparison is None:
        return "## Against the champion\n\nNot compared: there was no champion, or this version did not beat its " \
               "baseline."
    rows = [f"| {name}{' (primary)' if name == primary else ''} | {fmt(comparison.candidate[name])} | "
            f"{fmt(comparison.champion[name])} | {with_interval(gain['gain'], gain)} |"
            for name, gain in comparison.gains.items()]
    mine, guarded = comparison.benchmarks.get("candidate", {}), comparison.benchmarks.get("champion", {})
    failures = "".join(f"\n- benchmark {task}: this version {shown(mine[task])}; the champion, run now: {shown(score)}"
                       for task, score in guarded.items())
    failures += "".join(f"\n- guard failed: {failure}" for failure in comparison.guard_failures)
    return (f"## Against the champion\n\nVersion {comparison.champion_version}, re-scored now on the frozen "
            f"evaluation set ({comparison.examples} examples, md5 `{comparison.frozen_md5}`).\n\n"
            f"| metric | this version | champion | gain |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + failures)


def clip(text: Any, limit: int = 160) -> str:
    flat = " ".join(str(text).split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def samples_section(evaluated: EvaluateRecord) -> str:
    path = evaluated.dir / SAMPLES
    rows = list(read_jsonl(path))[:SAMPLES_SHOWN] if path.is_file() else []
    if not rows:
        return "## Held-out samples\n\nNone: plain-text models are scored on likelihood only."
    columns = list(rows[0])
    table = "\n".join("| " + " | ".join(clip(row.get(column, "")) for column in columns) + " |" for row in rows)
    return (f"## Held-out samples\n\n| {' | '.join(columns)} |\n| {' | '.join('---' for _ in columns)} |\n{table}")


def limitations_section(config: PipelineConfig, evaluated: EvaluateRecord, described: ReportRecord,
                        verdict: Verdict) -> str:
    figures = evaluated.figures
    notes = [f"Scored on {figures.examples} held-out examples from the same sources as the training data; it says "
             "nothing about other kinds of input."]
    if not config.model.name_or_path:
        notes.append("A small model trained from scratch: it knows only what its data teaches.")
    notes += selected(config.data).limitations(config, figures.metrics["trained"])
    if verdict.within_noise:
        notes.append("Its gain is within the noise of the evaluation set (the 95% interval reaches zero).")
    if described.figures.truncation_rate > 0:
        notes.append(f"{described.figures.truncation_rate:.1%} of training samples were truncated at "
                     f"{described.figures.max_length} tokens.")
    return "## Limitations\n\n" + "\n".join(f"- {note}" for note in notes)


def license_section(config: PipelineConfig) -> str:
    base = f" The base model's own license applies too (`{config.model.name_or_path}`)." if config.model.name_or_path \
        else ""
    return f"## License\n\nTraining data: {config.data.license}.{base}"


def loading_section(config: PipelineConfig, name: str, run_id: str) -> str:
    use = selected(config.data).usage()
    return (f"## How to load\n\n```python\nimport mlflow\n\nuri = \"models:/{name}@champion\"  # or models:/{name}/"
            f"<version>, or runs:/{run_id}/model\n{use}\n```\n\n`llmops models show {name}/<version>` prints "
            "its lineage, config and package versions.")


def description(card: str, limit: int = DESCRIPTION_LIMIT) -> str:
    """The card as the registry can store it: whole sections, up to the limit, then a pointer to the whole card."""
    if len(card) <= limit:
        return card
    note = "\n\n(Clipped: the whole card is the model_card.md logged with the model.)\n"
    kept = ""
    for section in card.split("\n\n## "):
        candidate = section if not kept else f"{kept}\n\n## {section}"
        if len(candidate) + len(note) > limit:
            break
        kept = candidate
    return (kept or card[: limit - len(note)]) + note


def metric_glossary(names: list[str], metrics: MetricTable) -> str:
    return "\n".join(f"- {name}: {metrics[name].description}" for name in names)
