"""The data report and dataset card: what went into training, in figures and in words.

Per run: rows per source, kept / quarantined / duplicate / contaminated counts, the token-length
distribution, the truncation rate at the configured max length, an estimate of the padding that
unpacked batches would carry, and a length histogram. The dataset card (Markdown) is saved with
the processed data and attached to the registered model version.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from llmops.config.schema import PipelineConfig
from llmops.data.dedup import DedupRecord
from llmops.data.ingest import IngestRecord
from llmops.data.profile import PROFILE, profile_inputs
from llmops.data.tokenize import TokenizeRecord
from llmops.data.validate import ValidateRecord
from llmops.io.figures import Figures
from llmops.io.files import load_dataset_dir
from llmops.io.rejects import CodeName
from llmops.objectives import record_kind
from llmops.pipeline.stages import StageContext
from llmops.store.artifacts import StageRecord

CARD = "dataset_card.md"


class LengthFigures(Figures):
    mean: float
    p50: float
    p95: float
    max: float


class ReportFigures(Figures):
    rows_per_source: dict[str, int]
    rows_read: int
    rows_quarantined: int
    # rows per reject code (the validate stage logs these as metrics)
    quarantine_codes: dict[CodeName, int]
    duplicates: int
    near_duplicates: int
    # exact duplicates whose label disagreed with the copy kept (None in reports made before they were counted)
    conflicts: int | None = None
    contaminated: int
    train_rows: int
    eval_rows: int
    # what training sees: source weights repeat rows; rows whose answer was truncated away are dropped
    train_samples: int
    dropped_after_truncation: int
    train_tokens: int
    token_length: LengthFigures
    truncation_rate: float
    max_length: int
    padding_waste: float


ReportRecord = StageRecord[ReportFigures]


def describe(config: PipelineConfig, ingested: IngestRecord, validated: ValidateRecord, deduped: DedupRecord,
             tokenized: TokenizeRecord, context: StageContext) -> ReportFigures:
    lengths, folder = token_lengths(tokenized.dir / "train"), context.folder
    report = figures(config, ingested, validated, deduped, tokenized, lengths)
    (folder / "report.json").write_text(report.model_dump_json(indent=2))
    plot_lengths(lengths["raw_length"], config.tokenize.max_length, folder / "token_lengths.png")
    (folder / CARD).write_text(card(config, report))
    profile = profile_inputs(record_kind(config.data), deduped.dir / "train", deduped.dir / "eval")
    (folder / PROFILE).write_text(json.dumps(profile, sort_keys=True))
    return report


def not_the_plot(relative: str) -> bool:
    """The histogram's bytes carry the plotting library's metadata: the figures define the content."""
    return relative != "token_lengths.png"


def token_lengths(dataset_dir: Path) -> dict[str, list[int]]:
    """Each training sample's length before (`raw_length`) and after (`length`) truncation."""
    table = load_dataset_dir(dataset_dir).select_columns(["raw_length", "length"]).to_dict()
    return {"raw_length": table["raw_length"], "length": table["length"]}


def figures(config: PipelineConfig, ingested: IngestRecord, validated: ValidateRecord, deduped: DedupRecord,
            tokenized: TokenizeRecord, lengths: dict[str, list[int]]) -> ReportFigures:
    split = tokenized.figures
    return ReportFigures(
        rows_per_source=ingested.figures.rows_per_source, rows_read=ingested.figures.rows_read,
        rows_quarantined=validated.figures.rows_quarantined, quarantine_codes=validated.figures.codes,
        duplicates=deduped.figures.duplicates, near_duplicates=deduped.figures.near_duplicates,
        conflicts=deduped.figures.conflicts,
        contaminated=deduped.figures.contaminated, train_rows=deduped.figures.train_rows,
        eval_rows=deduped.figures.eval_rows, train_samples=split.train.rows,
        dropped_after_truncation=split.train.dropped_no_target + split.eval.dropped_no_target,
        train_tokens=split.train.tokens, token_length=distribution(lengths["raw_length"]),
        truncation_rate=split.train.truncation_rate, max_length=config.tokenize.max_length,
        padding_waste=padding_waste(lengths["length"], config.train.batch_size))


def distribution(lengths: list[int]) -> LengthFigures:
    if not lengths:
        return LengthFigures(mean=0.0, p50=0.0, p95=0.0, max=0.0)
    ordered = sorted(lengths)

    def quantile(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return LengthFigures(mean=round(sum(ordered) / len(ordered), 2), p50=quantile(0.5), p95=quantile(0.95),
                         max=float(ordered[-1]))


def padding_waste(lengths: list[int], batch_size: int, trials: int = 5) -> float:
    """The share of token slots that would be padding in randomly drawn, unpacked batches."""
    if not lengths:
        return 0.0
    rng = random.Random(0)
    wasted = slots = 0
    for _ in range(trials):
        order = lengths[:]
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            slots += max(batch) * len(batch)
            wasted += max(batch) * len(batch) - sum(batch)
    return round(wasted / slots, 4)


def plot_lengths(lengths: list[int], max_length: int, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.5))
    axes.hist(lengths, bins=min(60, max(10, len(set(lengths)))), color="#4c72b0")
    axes.axvline(max_length, color="#c44e52", linestyle="--", label=f"max_length {max_length}")
    axes.set_xlabel("tokens per training sample (before truncation)")
    axes.set_ylabel("samples")
    axes.legend()
    figure.tight_layout()
    figure.savefig(target, dpi=100)
    plt.close(figure)


def card(config: PipelineConfig, figures: ReportFigures) -> str:
    """A dataset card in Markdown: sources, license, counts and known issues (the data version is added at
    registration, from the lineage)."""
    data, report = config.data, figures.model_dump()
    sources = "\n".join(f"- `{s.path or s.name}` ({split}, weight {s.weight})" for split, group in
                        (("train", data.sources), ("held out", data.eval_sources)) for s in group)
    per_source = "\n".join(f"| `{name}` | {rows} |" for name, rows in report["rows_per_source"].items())
    lengths = report["token_length"]
    return f"""# Dataset card

Record kind: **{data.kind}** · license: **{data.license}**

## Sources

{sources}

| source | rows read |
| --- | --- |
{per_source}

## Counts

| rows read | quarantined | exact duplicates | near duplicates | contaminated | train | eval |
| --- | --- | --- | --- | --- | --- | --- |
| {report['rows_read']} | {report['rows_quarantined']} | {report['duplicates']} | {report['near_duplicates']} \
| {report['contaminated']} | {report['train_rows']} | {report['eval_rows']} |

Training sees {report['train_samples']} samples (source weights applied; {report['dropped_after_truncation']} \
rows lost their whole answer to truncation), {report['train_tokens']} tokens. Tokens per sample: mean \
{lengths['mean']}, median {lengths['p50']:.0f}, p95 {lengths['p95']:.0f}, max {lengths['max']:.0f}.

## Known issues

{known_issues(report)}
"""


def known_issues(report: dict[str, Any]) -> str:
    issues = []
    if report["rows_quarantined"]:
        reasons = ", ".join(f"{r} ({n})" for r, n in list(report["quarantine_codes"].items())[:5])
        issues.append(f"{report['rows_quarantined']} rows were quarantined: {reasons}.")
    if report["dropped_after_truncation"]:
        issues.append(f"{report['dropped_after_truncation']} rows were not trained on: truncation at max_length "
                      f"{report['max_length']} left no answer tokens (the tokenize artifact lists them, "
                      "train.dropped.jsonl and eval.dropped.jsonl).")
    if report["truncation_rate"]:
        issues.append(f"{report['truncation_rate']:.1%} of training samples are longer than max_length "
                      f"{report['max_length']} and were truncated.")
    removed = report["duplicates"] + report["near_duplicates"]
    if removed:
        issues.append(f"{removed} duplicate rows were removed ({report['near_duplicates']} near duplicates).")
    if report.get("conflicts"):
        issues.append(f"{report['conflicts']} duplicate rows disagreed with the copy kept on a field their text "
                      "leaves out (a label): the kept copy's was trained on; clusters.jsonl lists each conflict.")
    if report["contaminated"]:
        issues.append(f"{report['contaminated']} training rows repeated evaluation rows and were removed.")
    if report["padding_waste"] > 0.3:
        issues.append(f"Unpacked batches would be {report['padding_waste']:.0%} padding; keep packing on.")
    return "\n".join(f"- {issue}" for issue in issues) or "- None found by the pipeline's checks."
