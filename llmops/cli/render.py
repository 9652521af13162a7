"""What the command prints: the end of a run, metrics against the baseline and the champion, a version's details."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from llmops.cli.io import console
from llmops.config.schema import PipelineConfig
from llmops.flows.api import prefect_api_url
from llmops.registry import accounting
from llmops.store.settings import is_local_store, mask
from llmops.store.workspace import home
from llmops.tracking.cost import RUN_COLUMNS, CostFigures
from llmops.tracking.log import tracking_uri


def print_summary(config: PipelineConfig, summary: dict[str, Any]) -> None:
    registration = summary["registration"]
    stages = Table(title="stages", show_header=False)
    for stage, status in summary["stages"].items():
        stages.add_row(stage, f"[green]{status}[/]" if status == "computed" else f"[cyan]{status}[/]")
    console.print(stages)
    console.print(metrics_table(registration))
    if registration.get("benchmarks"):
        console.print(benchmarks_table(registration["benchmarks"], registration["baseline"]))
    if registration.get("comparison"):
        console.print(comparison_table(registration["comparison"], registration["primary_metric"]))
    alias = registration["alias"] or "no alias"
    note = " (already registered: same weights)" if registration["reused"] else ""
    reason = registration["reason"].removeprefix(f"{alias}: ")  # the gate's reason for no alias starts with it
    console.print(f"registered [bold]{registration['model_name']}[/] version [bold]{registration['version']}[/]"
                  f" → [bold]{alias}[/]{note}: {reason}", highlight=False, soft_wrap=True)
    if registration.get("cost"):
        console.print(f"cost: {accounting.line(CostFigures.model_validate(registration['cost']))}", highlight=False,
                      soft_wrap=True, markup=False)
    print_pointers(config, summary, registration)


def print_pointers(config: PipelineConfig, summary: dict[str, Any], registration: dict[str, Any]) -> None:
    """Where to look closer: the tracking UI, the Prefect UI, the version's details."""
    uri, api = tracking_uri(config.tracking), prefect_api_url()
    console.print("look closer:", highlight=False)
    mlflow_hint = (f"mlflow ui --host 127.0.0.1 --backend-store-uri {uri}" if is_local_store(uri)
                   else f"MLflow at {mask(uri)}")
    console.print(f"  {mlflow_hint}  (run {summary['mlflow_run_id']})", highlight=False, soft_wrap=True)
    prefect_hint = (f"Prefect at {mask(api)}" if api
                    else f"PREFECT_HOME={home() / 'prefect'} prefect server start --host 127.0.0.1")
    console.print(f"  {prefect_hint}", highlight=False, soft_wrap=True)
    console.print(f"  llmops models show {registration['model_name']}/{registration['version']}", highlight=False,
                  soft_wrap=True)


def with_interval(value: float, interval: dict[str, float] | None) -> str:
    if not interval:
        return f"{value:.4g}"
    return f"{value:.4g} [{interval['low']:.4g}, {interval['high']:.4g}]"


def metrics_table(registration: dict[str, Any]) -> Table:
    """Trained vs its starting point, each with its 95% interval, and the paired gain; the primary metric's
    choice and reason in the caption."""
    primary, baseline = registration["primary_metric"], registration["baseline"]
    table = Table(title=f"held-out metrics ({registration['examples']} examples, 95% bootstrap intervals)",
                  caption=f"primary metric {primary}: {registration['primary_reason']}", caption_justify="left")
    for column in ("metric", "trained", baseline, "gain"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    intervals, gains = registration["intervals"], registration["gain_over_baseline"]
    for metric, value in registration["metrics"]["trained"].items():
        gain = gains.get(metric)
        table.add_row(metric + (" (primary)" if metric == primary else ""),
                      with_interval(value, intervals.get("trained", {}).get(metric)),
                      with_interval(registration["metrics"][baseline][metric], intervals.get(baseline, {}).get(metric)),
                      with_interval(gain["gain"], gain) if gain else "")
    return table


def benchmarks_table(scores: dict[str, Any], baseline: str) -> Table:
    """lm-eval tasks on the trained model and its starting point: each task's main metric, 95% interval."""
    table = Table(title="benchmarks (lm-eval, 95% intervals)")
    for column in ("task", "metric", "trained", baseline):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    for task, score in scores["trained"].items():
        table.add_row(task, score["metric"], with_interval(score["score"], score),
                      with_interval(scores[baseline][task]["score"], scores[baseline][task]))
    return table


def comparison_table(comparison: dict[str, Any], primary: str) -> Table:
    table = Table(title=f"against champion version {comparison['champion_version']} on the frozen set "
                        f"({comparison['examples']} examples, md5 {comparison['frozen_md5'][:8]})")
    for column in ("metric", "this version", "champion", "gain"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for metric, gain in comparison["gains"].items():
        table.add_row(metric + (" (primary)" if metric == primary else ""), f"{comparison['candidate'][metric]:.4g}",
                      f"{comparison['champion'][metric]:.4g}", with_interval(gain["gain"], gain))
    return table


def versions_table(versions: list[dict[str, Any]]) -> Table:
    table = Table(title="registered models")
    for column in ("version", "aliases", "primary metric: trained vs baseline", "commit", "data md5", "flow run"):
        table.add_column(column, overflow="fold")
    for v in versions:
        tags = v["tags"]
        table.add_row(f"{v['name']}/{v['version']}", ", ".join(v["aliases"]),
                      f"{v['primary_metric']} {v['trained']} vs {v['baseline']}", tags.get("git_commit", "")[:8],
                      tags.get("dvc_data_md5", "")[:8], tags.get("prefect_flow_run_id", "")[:8])
    return table


def runs_table(experiment: str, runs: list[dict[str, Any]]) -> Table:
    """The runs, with what each computed (device-hours), saved by reuse, trained on (useful tokens) and cost (with
    cost.device_hour set): the figures to compare runs by."""
    table = Table(title=f"runs · experiment {experiment}")
    for column in ("run", "name", "status", "started", "minutes", *RUN_COLUMNS, "resumes", "resumed by", "closed by"):
        table.add_column(column, overflow="fold")
    for entry in runs:
        spent = [figure(entry.get("cost", {}).get(name), name) for name in RUN_COLUMNS.values()]
        table.add_row(*(str(entry[k] or "") for k in ("run", "name", "status", "started", "minutes")), *spent,
                      *(str(entry[k] or "") for k in ("resumes", "resumed_by", "closed_by")))
    return table


def figure(value: float | None, name: str) -> str:
    """A cost figure of `llmops runs`; empty when the run has none (it registered nothing, or has no price)."""
    if value is None:
        return ""
    if name == "useful_tokens":
        return accounting.amount(int(value))
    return accounting.money(value) if name == "computed_cost" else accounting.hours(value)


def print_version(details: dict[str, Any]) -> None:
    table = Table(title=f"{details['name']} version {details['version']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    skip = {"name", "version", "config", "alias_history", "packages", "metrics", "frozen_comparison", "cost"}
    for key, value in details.items():
        if key not in skip and value not in (None, "", []):
            table.add_row(key, ", ".join(value) if isinstance(value, list) else str(value))
    for group in ("packages", "metrics", "frozen_comparison", "cost"):
        for key, value in sorted(details.get(group, {}).items()):
            table.add_row(f"{group}.{key}", str(value))
    console.print(table)
    if details["alias_history"]:
        moves = Table(title="alias moves")
        for column in ("at", "alias", "version", "previous", "action", "by", "reason"):
            moves.add_column(column, overflow="fold")
        for move in details["alias_history"]:
            moves.add_row(*(str(move.get(column) or "") for column in ("at", "alias", "version", "previous", "action",
                                                                      "by", "reason")))
        console.print(moves)
    if details["config"]:
        console.print("[bold]resolved config[/]")
        console.print(details["config"], highlight=False, markup=False)


def plan_table(config: str, rows: list[tuple[str, str, str]]) -> Table:
    table = Table(title=f"plan · {config}")
    for column in ("stage", "key", "would be"):
        table.add_column(column)
    for name, key, status in rows:
        table.add_row(name, key, f"[cyan]{status}[/]" if status == "reused" else f"[green]{status}[/]")
    return table


def monitor_tables(report: dict[str, Any]) -> list[Table]:
    """The monitor's window: a row per version and one for all, then the feedback over time."""
    traffic = Table(title=f"{report['model']}: requests {report['since']} to {report['until']}")
    for column in ("version", "requests", "errors", "p50 ms", "p95 ms", "p99 ms", "tokens in/out", "truncated",
                   "rated", "mean score", "drift"):
        traffic.add_column(column, justify="left" if column in ("version", "drift") else "right")
    for version, figures in [*report["versions"].items(), ("all", report)]:
        latency = figures["latency_ms"]
        feedback = figures["feedback"]
        rated = sum(feedback[given] for given in ("score", "label", "correction", "preferred"))
        traffic.add_row(version, str(figures["requests"]), str(figures["errors"]),
                        *(f"{latency[q]:.0f}" if latency[q] is not None else "-" for q in ("p50", "p95", "p99")),
                        f"{figures['tokens']['prompt']}/{figures['tokens']['completion']}",
                        f"{figures['truncated_share']:.1%}", str(rated),
                        f"{feedback['mean_score']:.2f}" if feedback["mean_score"] is not None else "-",
                        drift_cell(figures.get("drift")))
    over_time = Table(title=f"feedback per {report['bucket_seconds'] // 60} min")
    for column in ("version", "from", "scores", "mean score", "labels", "corrections", "preferred"):
        over_time.add_column(column)
    for version, buckets in report["feedback_over_time"].items():
        for start, counts in buckets.items():
            over_time.add_row(version, start, str(counts["score"]),
                              f"{counts['mean_score']:.2f}" if counts["mean_score"] is not None else "-",
                              str(counts["label"]), str(counts["correction"]), str(counts["preferred"]))
    return [traffic, over_time]


def drift_cell(drift: dict[str, Any] | None) -> str:
    if drift is None:
        return ""
    if not drift["judged"]:
        return f"not judged: {drift['reason']}"
    return "[red]drifted[/]" if drift["drifted"] else "none"
