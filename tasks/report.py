"""The data report and dataset card: what went into training, in figures and in words.

Per run: rows per source, kept / quarantined / duplicate / contaminated counts, the token-length
distribution, the truncation rate at the configured max length, an estimate of the padding that
unpacked batches would carry, and a length histogram. The dataset card (Markdown) is saved with
the processed data and attached to the registered model version.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flows.config import PipelineConfig
from tasks import tracking, workspace
from tasks.tracking import RunHandle
from tasks.workspace import StageRecord

CARD = "dataset_card.md"


def describe(config: PipelineConfig, ingested: StageRecord, validated: StageRecord, deduped: StageRecord,
             tokenized: StageRecord) -> StageRecord:
    dvc = {k: ingested.stats.get(k) for k in ("dvc_file", "dvc_md5", "matches_dvc")}
    relevant = {"data": config.data.model_dump(mode="json"), "batch_size": config.train.batch_size,
                "max_length": config.tokenize.max_length}
    key = workspace.stage_key("report", relevant, [ingested, validated, deduped, tokenized],
                              workspace.code_version(sys.modules[__name__]), dvc=dvc)

    def build(folder: Path) -> tuple[str, dict[str, Any]]:
        lengths = token_lengths(tokenized.dir / "train")
        report = figures(config, ingested, validated, deduped, tokenized, lengths)
        report["dvc"] = dvc
        (folder / "report.json").write_text(json.dumps(report, indent=2))
        plot_lengths(lengths["raw_length"], config.tokenize.max_length, folder / "token_lengths.png")
        (folder / CARD).write_text(card(config, report))
        return workspace.hash_file(folder / "report.json"), report

    return workspace.build_artifact("report", key, build)


def token_lengths(dataset_dir: Path) -> dict[str, list[int]]:
    """Each training sample's length before (`raw_length`) and after (`length`) truncation."""
    from datasets import load_from_disk

    table = load_from_disk(str(dataset_dir)).select_columns(["raw_length", "length"]).to_dict()
    return {"raw_length": table["raw_length"], "length": table["length"]}


def figures(config: PipelineConfig, ingested: StageRecord, validated: StageRecord, deduped: StageRecord,
            tokenized: StageRecord, lengths: dict[str, list[int]]) -> dict[str, Any]:
    raw, kept = lengths["raw_length"], lengths["length"]
    return {
        "rows_per_source": ingested.stats["rows_per_source"],
        "rows_read": ingested.stats["rows_read"],
        "rows_quarantined": validated.stats["rows_quarantined"],
        "quarantine_reasons": validated.stats["reasons"],
        "duplicates": deduped.stats["duplicates"],
        "near_duplicates": deduped.stats["near_duplicates"],
        "contaminated": deduped.stats["contaminated"],
        "train_rows": deduped.stats["train_rows"],
        "eval_rows": deduped.stats["eval_rows"],
        # what training sees: source weights repeat rows; rows whose answer was truncated away are dropped
        "train_samples": tokenized.stats["train_rows"],
        "dropped_after_truncation": sum(tokenized.stats[f"{split}_dropped_no_target"] for split in ("train", "eval")),
        "train_tokens": tokenized.stats["train_tokens"],
        "token_length": distribution(raw),
        "truncation_rate": tokenized.stats["train_truncation_rate"],
        "max_length": config.tokenize.max_length,
        "padding_waste": padding_waste(kept, config.train.batch_size),
    }


def distribution(lengths: list[int]) -> dict[str, float]:
    if not lengths:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    ordered = sorted(lengths)

    def quantile(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {"mean": round(sum(ordered) / len(ordered), 2), "p50": quantile(0.5), "p95": quantile(0.95),
            "max": float(ordered[-1])}


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


def card(config: PipelineConfig, report: dict[str, Any]) -> str:
    """A dataset card in Markdown: sources, version, license, counts and known issues."""
    data = config.data
    sources = "\n".join(f"- `{s.path or s.name}` ({split}, weight {s.weight})" for split, group in
                        (("train", data.sources), ("held out", data.eval_sources)) for s in group)
    per_source = "\n".join(f"| `{name}` | {rows} |" for name, rows in report["rows_per_source"].items())
    lengths = report["token_length"]
    dvc = report["dvc"]
    return f"""# Dataset card

Record kind: **{data.kind}** · license: **{data.license}** · DVC: `{dvc.get('dvc_file') or 'not tracked'}`
md5 `{dvc.get('dvc_md5') or 'n/a'}`{'' if dvc.get('matches_dvc') is not False else ' (the files differ from the pin)'}

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
        reasons = ", ".join(f"{r} ({n})" for r, n in list(report["quarantine_reasons"].items())[:5])
        issues.append(f"{report['rows_quarantined']} rows were quarantined: {reasons}.")
    if report["dropped_after_truncation"]:
        issues.append(f"{report['dropped_after_truncation']} rows were not trained on: truncation at max_length "
                      f"{report['max_length']} left no answer tokens.")
    if report["truncation_rate"]:
        issues.append(f"{report['truncation_rate']:.1%} of training samples are longer than max_length "
                      f"{report['max_length']} and were truncated.")
    removed = report["duplicates"] + report["near_duplicates"]
    if removed:
        issues.append(f"{removed} duplicate rows were removed ({report['near_duplicates']} near duplicates).")
    if report["contaminated"]:
        issues.append(f"{report['contaminated']} training rows repeated evaluation rows and were removed.")
    if report["padding_waste"] > 0.3:
        issues.append(f"Unpacked batches would be {report['padding_waste']:.0%} padding; keep packing on.")
    return "\n".join(f"- {issue}" for issue in issues) or "- None found by the pipeline's checks."


@task(name="report", cache_policy=NO_CACHE)
def report_task(config: PipelineConfig, ingested: StageRecord, validated: StageRecord, deduped: StageRecord,
                tokenized: StageRecord, run: RunHandle) -> StageRecord:
    record = tracking.tracked(run, lambda: describe(config, ingested, validated, deduped, tokenized))
    for name in (CARD, "report.json", "token_lengths.png"):
        tracking.log_file(run, record.dir / name, "data")
    return record
