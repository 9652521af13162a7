"""The registry gate: which alias a new version earns, and every alias move with when and why.

Two checks, in order. The trained model's primary metric must beat its starting point (the
untrained or base model, scored by the evaluate stage on the same held-out rows) by more than
`register.min_gain_over_baseline`; a model that does not gets no alias, first version or not.
Then the candidate and the current champion are both scored now, with the same code and settings,
on the model name's frozen evaluation set: `data.eval_sources` when configured, otherwise the
held-out rows pinned at the name's first registration (an artifact of that run, its md5 a tag of
the registered model). Promotion needs a primary-metric gain of at least `register.min_improvement`
(a tie never promotes) and no guard metric worse than its tolerance; otherwise the candidate
becomes `challenger`. A gain whose paired 95% bootstrap interval reaches zero is reported as within
the noise. Alias moves, by the gate or by hand (promote, rollback), are recorded on the registered
model, a tag per move (llmops/registry/aliases.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from llmops.config.schema import PipelineConfig
from llmops.evaluation import benchmarks
from llmops.evaluation.evaluate import (
    HELDOUT,
    EvaluateFigures,
    EvaluateRecord,
    load_scores,
    md5_of,
    scoring_context,
)
from llmops.io.files import read_jsonl
from llmops.models import modeling
from llmops.objectives import selected
from llmops.objectives.metrics import Scored, gain
from llmops.registry import bases
from llmops.registry.aliases import move_alias
from llmops.registry.benchmarked import benchmark_version
from llmops.registry.loading import load_components
from llmops.registry.references import CHALLENGER, CHAMPION, RegistryError, current_champion, model_tags
from llmops.store.workspace import home
from llmops.training.session import TrainRecord

log = logging.getLogger("llmops.gate")

FROZEN_MD5, FROZEN_URI, FROZEN_SOURCE, FROZEN_EXAMPLES = ("frozen_eval.md5", "frozen_eval.uri", "frozen_eval.source",
                                                          "frozen_eval.examples")
FROZEN_FOLDER = "frozen_eval"


class FrozenSet(BaseModel):
    path: Path
    md5: str
    examples: int
    source: str
    # whether the registered model already names this set as its own
    pinned: bool


class Comparison(BaseModel):
    """The candidate and the champion, both scored now on the frozen set."""

    # a metric with nothing to measure is NaN, stored as NaN (not null) so that it reads back as a float
    model_config = ConfigDict(ser_json_inf_nan="constants")

    champion_version: str
    frozen_md5: str
    examples: int
    candidate: dict[str, float]
    champion: dict[str, float]
    # metric -> {"gain", "low", "high"}: candidate minus champion, positive when better, paired bootstrap
    gains: dict[str, dict[str, float]]
    guard_failures: list[str]
    # "candidate" / "champion" -> guarded lm-eval task -> its main metric's score (evaluation/benchmarks.py)
    benchmarks: dict[str, dict[str, dict[str, Any]]] = {}


class Verdict(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="constants")

    alias: str | None
    reason: str
    # the one line a run ends with when the model does not beat its starting point
    message: str | None = None
    # the deciding gain's 95% interval reaches zero
    within_noise: bool = False
    comparison: Comparison | None = None


def fmt(value: float) -> str:
    return f"{value:.4g}"


def noise_note(gain: dict[str, float]) -> str:
    return f"+{fmt(gain['gain'])}, 95% CI [{fmt(gain['low'])}, {fmt(gain['high'])}]"


def check_baseline(figures: EvaluateFigures, min_gain: float) -> Verdict | None:
    """None when the trained model beats its starting point by the margin; else the verdict of no alias."""
    primary, baseline = figures.primary_metric, figures.baseline
    gain = figures.gain_over_baseline[primary]
    if gain["gain"] > 0 and gain["gain"] >= min_gain:  # NaN fails both
        return None
    trained, start = figures.metrics["trained"][primary], figures.metrics[baseline][primary]
    margin = f" by more than register.min_gain_over_baseline {min_gain:g}" if min_gain else ""
    return Verdict(alias=None, message=f"trained model does not beat its baseline on {primary} ({fmt(trained)} vs "
                                       f"{fmt(start)})",
                   reason=f"no alias: it does not beat the {baseline} model on {primary}{margin}")


def first_champion(figures: EvaluateFigures, guards: dict[str, float]) -> Verdict:
    """Champion, unless a guarded benchmark drops against the starting point by more than its guard allows."""
    primary = figures.primary_metric
    gain = figures.gain_over_baseline[primary]
    noisy = not gain["low"] > 0
    trained, start = figures.metrics["trained"][primary], figures.metrics[figures.baseline][primary]
    reason = (f"no champion yet; it beats the {figures.baseline} model on {primary} ({fmt(trained)} vs {fmt(start)}, "
              f"{noise_note(gain)})")
    failures = benchmark_failures(figures.benchmarks.get("trained", {}), figures.benchmarks.get(figures.baseline, {}),
                                  guards, f"the {figures.baseline} model")
    if failures:
        return Verdict(alias=CHALLENGER, reason=f"{reason}, but a guard fails: {'; '.join(failures)}")
    return Verdict(alias=CHAMPION, reason=reason + ("; the gain is within the noise" if noisy else ""),
                   within_noise=noisy)


def benchmark_failures(candidate: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]],
                       guards: dict[str, float], against: str) -> list[str]:
    """Each guarded benchmark the candidate loses by more than its max_drop, with both scores and intervals."""
    failures = []
    for task, max_drop in guards.items():
        drop = benchmarks.drop_of(candidate[task], reference[task])
        if not drop <= max_drop:  # NaN fails
            failures.append(f"benchmark {task}: {benchmarks.shown(candidate[task])} against {against}'s "
                            f"{benchmarks.shown(reference[task])}, a drop of {fmt(drop)} > max_drop {max_drop:g}")
    return failures


def decide(primary: str, comparison: Comparison, min_improvement: float) -> Verdict:
    """Champion when the primary metric gains at least `min_improvement` (and something) with no guard failing."""
    gain = comparison.gains[primary]
    versus = (f"{primary} {fmt(comparison.candidate[primary])} vs {fmt(comparison.champion[primary])} on the frozen "
              f"set")
    champion = f"champion version {comparison.champion_version}"
    if not (gain["gain"] > 0 and gain["gain"] >= min_improvement):
        needs = f" (needs +{min_improvement:g})" if min_improvement else ""
        return Verdict(alias=CHALLENGER, reason=f"does not beat {champion}: {versus}{needs}", comparison=comparison)
    if comparison.guard_failures:
        return Verdict(alias=CHALLENGER, reason=f"beats {champion} on {versus}, but a guard fails: "
                                                f"{'; '.join(comparison.guard_failures)}", comparison=comparison)
    noisy = not gain["low"] > 0
    reason = f"beats {champion}: {versus} ({noise_note(gain)})" + ("; the gain is within the noise" if noisy else "")
    return Verdict(alias=CHAMPION, reason=reason, within_noise=noisy, comparison=comparison)


def compare_on_frozen(candidate: Scored, champion: Scored, champion_version: str, frozen: FrozenSet,
                      guards: dict[str, float]) -> Comparison:
    gains = {name: gain(candidate.metrics[name], candidate.parts[name], champion.parts[name])
             for name in candidate.parts if name in champion.parts}
    candidate_values, champion_values = candidate.values(), champion.values()
    failures = [f"{name} {fmt(candidate_values[name])} vs {fmt(champion_values[name])} is worse by "
                f"{fmt(-gains[name]['gain'])} > tolerance {tolerance:g}"
                for name, tolerance in guards.items() if -gains[name]["gain"] > tolerance]
    return Comparison(champion_version=champion_version, frozen_md5=frozen.md5, examples=frozen.examples,
                      candidate=candidate_values, champion=champion_values, gains=gains, guard_failures=failures)


def judge(config: PipelineConfig, mlflow_client: Any, trained: TrainRecord, evaluated: EvaluateRecord,
          frozen: FrozenSet) -> tuple[Verdict, dict[str, Scored]]:
    """The verdict on the candidate, and both models' scores on the frozen set when it came to that."""
    figures, settings = evaluated.figures, config.registry
    refused = check_baseline(figures, settings.min_gain_over_baseline)
    if refused is not None:
        return refused, {}
    champion = current_champion(mlflow_client, settings.model_name)
    if champion is None:
        return first_champion(figures, settings.benchmark_guards()), {}
    rows = list(read_jsonl(frozen.path))
    uri = f"models:/{settings.model_name}/{champion.version}"
    scored = {"candidate": candidate_scores(config, trained, evaluated, frozen, rows),
              "champion": score_version(config, uri, rows)}
    comparison = compare_on_frozen(scored["candidate"], scored["champion"], str(champion.version), frozen,
                                   settings.metric_guards())
    comparison = with_benchmarks(comparison, config, figures, uri)
    return decide(figures.primary_metric, comparison, settings.min_improvement), scored


def with_benchmarks(comparison: Comparison, config: PipelineConfig, figures: EvaluateFigures, uri: str) -> Comparison:
    """The guarded benchmarks, run on the champion now (never taken at its recorded word), against the candidate's
    scores from the evaluate stage."""
    guards = config.registry.benchmark_guards()
    if not guards:
        return comparison
    candidate = {task: figures.benchmarks["trained"][task] for task in guards}
    champion = benchmark_version(config, uri, list(guards))
    failures = benchmark_failures(candidate, champion, guards, f"champion version {comparison.champion_version}")
    return comparison.model_copy(update={"guard_failures": [*comparison.guard_failures, *failures],
                                         "benchmarks": {"candidate": candidate, "champion": champion}})


def candidate_scores(config: PipelineConfig, trained: TrainRecord, evaluated: EvaluateRecord, frozen: FrozenSet,
                     rows: list[dict[str, Any]]) -> Scored:
    """The evaluate stage's scores when the frozen set is the set it scored; else the trained model scored now."""
    objective = selected(config.data)
    if frozen.md5 == evaluated.figures.heldout_md5:
        return load_scores(evaluated.dir, "trained", objective.metrics)
    from transformers import AutoTokenizer

    model_dir = trained.dir / "model"
    model = modeling.place(objective.load_trained(model_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return objective.score(model, tokenizer, rows, scoring_context(config, config.tokenize.max_length,
                                                                   starting_model(config)))


def score_version(config: PipelineConfig, model_uri: str, rows: list[dict[str, Any]]) -> Scored:
    """A registered version, loaded from the registry and scored like the candidate: the champion is re-scored,
    never taken at its recorded word."""
    import tempfile

    from mlflow.exceptions import MlflowException

    try:
        with tempfile.TemporaryDirectory() as folder:
            settings = {"data": config.data.model_dump()}
            objective, model, tokenizer, _ = load_components(model_uri, Path(folder), settings)
    except (MlflowException, OSError) as err:  # a base model moved away, an artifact store out of reach
        raise RegistryError(f"cannot load {model_uri} to re-score it on the frozen set: {err}") from None
    context = scoring_context(config, config.tokenize.max_length, starting_model(config))
    return objective.score(modeling.place(model).eval(), tokenizer, rows, context)


def starting_model(config: PipelineConfig) -> Any:
    """What the objective measures a model against besides its metrics (DPO's margins: the configured start, loaded
    again); None for the others, which need none."""
    objective = selected(config.data)
    if not objective.measured_against_start:
        return None
    from transformers import AutoTokenizer

    start = bases.resolved(config).model
    tokenizer = AutoTokenizer.from_pretrained(start.name_or_path)
    model = objective.build_model(start, tokenizer, config.train.seed, config.data.labels)
    return objective.reference(modeling.place(model).eval(), config)


def frozen_set(config: PipelineConfig, mlflow_client: Any, evaluated: EvaluateRecord) -> FrozenSet:
    """The set the candidate and the champion are compared on: data.eval_sources when configured, else the set the
    name pinned at its first registration, else (first registration) this run's held-out rows, pinned after."""
    figures = evaluated.figures
    tags = model_tags(mlflow_client, config.registry.model_name)
    if config.data.eval_sources or FROZEN_MD5 not in tags:
        source = "data.eval_sources" if config.data.eval_sources else "held-out rows of the first registration"
        return FrozenSet(path=evaluated.dir / HELDOUT, md5=figures.heldout_md5, examples=figures.examples,
                         source=source, pinned=tags.get(FROZEN_MD5) == figures.heldout_md5)
    path = download_pinned(tags[FROZEN_URI], tags[FROZEN_MD5])
    return FrozenSet(path=path, md5=tags[FROZEN_MD5], examples=int(tags.get(FROZEN_EXAMPLES, 0)),
                     source=tags.get(FROZEN_SOURCE, "pinned"), pinned=True)


def download_pinned(uri: str, md5: str) -> Path:
    """The pinned set, fetched once into the workspace and checked against its md5."""
    import mlflow

    folder = home() / "frozen_eval" / md5
    target = folder / uri.rpartition("/")[2]
    if not target.is_file():
        target = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(folder)))
    if md5_of(target) != md5:
        target.unlink()
        raise RegistryError(f"the frozen evaluation set at {uri} does not match its pinned md5 {md5}")
    return target


def pin(mlflow_client: Any, name: str, frozen: FrozenSet, run_id: str) -> None:
    """Store the set with this run and name it, with its md5, on the registered model."""
    if frozen.pinned:
        return
    mlflow_client.log_artifact(run_id, str(frozen.path), FROZEN_FOLDER)
    previous = model_tags(mlflow_client, name).get(FROZEN_MD5)
    if previous:
        log.warning("the frozen evaluation set of %s changes from md5 %s to %s (%s)", name, previous, frozen.md5,
                    frozen.source)
    tags = {FROZEN_MD5: frozen.md5, FROZEN_URI: f"runs:/{run_id}/{FROZEN_FOLDER}/{frozen.path.name}",
            FROZEN_SOURCE: frozen.source, FROZEN_EXAMPLES: str(frozen.examples)}
    for key, value in tags.items():
        mlflow_client.set_registered_model_tag(name, key, value)


def apply(mlflow_client: Any, name: str, version: str, verdict: Verdict, run_id: str) -> None:
    if verdict.alias is not None:
        move_alias(mlflow_client, name, verdict.alias, version, "gate", verdict.reason, f"pipeline run {run_id}")
