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
the noise. Alias moves, by the gate or by hand (promote, rollback), are appended to a JSON history
on the registered model.
"""

from __future__ import annotations

import getpass
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from llmops.core import metrics, tracking, workspace
from llmops.core.config import PipelineConfig, TrackingConfig
from llmops.evaluation import evaluate
from llmops.evaluation.evaluate import EvaluateFigures, EvaluateRecord, Scored
from llmops.models import modeling
from llmops.objectives import dpo
from llmops.registry import registered_base
from llmops.training.train import TrainRecord

log = logging.getLogger("llmops.gate")

CHAMPION, CHALLENGER = "champion", "challenger"
HISTORY_TAG = "alias_history"
# the history is one registered-model tag; the oldest moves give way past this many
HISTORY_LIMIT = 300
FROZEN_MD5, FROZEN_URI, FROZEN_SOURCE, FROZEN_EXAMPLES = ("frozen_eval.md5", "frozen_eval.uri", "frozen_eval.source",
                                                          "frozen_eval.examples")
FROZEN_FOLDER = "frozen_eval"


class RegistryError(ValueError):
    """A registry request that cannot be met (unknown model, version or alias; nothing to roll back to)."""


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


def first_champion(figures: EvaluateFigures) -> Verdict:
    primary = figures.primary_metric
    gain = figures.gain_over_baseline[primary]
    noisy = not gain["low"] > 0
    trained, start = figures.metrics["trained"][primary], figures.metrics[figures.baseline][primary]
    reason = (f"no champion yet; it beats the {figures.baseline} model on {primary} ({fmt(trained)} vs {fmt(start)}, "
              f"{noise_note(gain)})")
    return Verdict(alias=CHAMPION, reason=reason + ("; the gain is within the noise" if noisy else ""),
                   within_noise=noisy)


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
    gains = {name: metrics.gain(name, candidate.parts[name], champion.parts[name]) for name in candidate.parts
             if name in champion.parts}
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
        return first_champion(figures), {}
    rows = list(workspace.read_jsonl(frozen.path))
    scored = {"candidate": candidate_scores(config, trained, evaluated, frozen, rows),
              "champion": score_version(config, f"models:/{settings.model_name}/{champion.version}", rows)}
    comparison = compare_on_frozen(scored["candidate"], scored["champion"], str(champion.version), frozen,
                                   dict(settings.guards))
    return decide(figures.primary_metric, comparison, settings.min_improvement), scored


def candidate_scores(config: PipelineConfig, trained: TrainRecord, evaluated: EvaluateRecord, frozen: FrozenSet,
                     rows: list[dict[str, Any]]) -> Scored:
    """The evaluate stage's scores when the frozen set is the set it scored; else the trained model scored now."""
    if frozen.md5 == evaluated.figures.heldout_md5:
        samples = workspace.read_jsonl(evaluated.dir / evaluate.SAMPLES)
        outputs = [sample.get("trained_output", "") for sample in samples]
        return Scored(evaluate.load_scores(evaluated.dir, "trained"), outputs)
    from transformers import AutoTokenizer

    model_dir = trained.dir / "model"
    model = modeling.place(modeling.load_trained(model_dir, config.data.kind)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return evaluate.score(model, tokenizer, rows, config.data, config.evaluate, config.tokenize.max_length,
                          starting_model(config))


def score_version(config: PipelineConfig, model_uri: str, rows: list[dict[str, Any]]) -> Scored:
    """A registered version, loaded from the registry and scored like the candidate: the champion is re-scored,
    never taken at its recorded word."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        components = mlflow.transformers.load_model(model_uri, return_type="components")
    except (MlflowException, OSError) as err:  # a base model moved away, an artifact store out of reach
        raise RegistryError(f"cannot load {model_uri} to re-score it on the frozen set: {err}") from None
    model = modeling.place(components["model"]).eval()
    return evaluate.score(model, components["tokenizer"], rows, config.data, config.evaluate,
                          config.tokenize.max_length, starting_model(config))


def starting_model(config: PipelineConfig) -> dpo.Reference | None:
    """Preference pairs: the model the reward margin is measured against, the configured start; else none."""
    if config.data.kind != "preference":
        return None
    from transformers import AutoTokenizer

    start = registered_base.resolved_model(config.model, config.tracking)
    tokenizer = AutoTokenizer.from_pretrained(start.name_or_path)
    model = modeling.place(modeling.build_model(start, tokenizer, config.train.seed, config.data.kind)).eval()
    return dpo.Reference(model, config.train.preference_beta)


def current_champion(mlflow_client: Any, name: str) -> Any | None:
    return holder(mlflow_client, name, CHAMPION)


def holder(mlflow_client: Any, name: str, alias: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def model_tags(mlflow_client: Any, name: str) -> dict[str, str]:
    """The registered model's tags; none when it is not registered yet."""
    from mlflow.exceptions import MlflowException

    try:
        return dict(mlflow_client.get_registered_model(name).tags or {})
    except MlflowException:
        return {}


def frozen_set(config: PipelineConfig, mlflow_client: Any, evaluated: EvaluateRecord) -> FrozenSet:
    """The set the candidate and the champion are compared on: data.eval_sources when configured, else the set the
    name pinned at its first registration, else (first registration) this run's held-out rows, pinned after."""
    figures = evaluated.figures
    tags = model_tags(mlflow_client, config.registry.model_name)
    if config.data.eval_sources or FROZEN_MD5 not in tags:
        source = "data.eval_sources" if config.data.eval_sources else "held-out rows of the first registration"
        return FrozenSet(path=evaluated.dir / evaluate.HELDOUT, md5=figures.heldout_md5, examples=figures.examples,
                         source=source, pinned=tags.get(FROZEN_MD5) == figures.heldout_md5)
    path = download_pinned(tags[FROZEN_URI], tags[FROZEN_MD5])
    return FrozenSet(path=path, md5=tags[FROZEN_MD5], examples=int(tags.get(FROZEN_EXAMPLES, 0)),
                     source=tags.get(FROZEN_SOURCE, "pinned"), pinned=True)


def download_pinned(uri: str, md5: str) -> Path:
    """The pinned set, fetched once into the workspace and checked against its md5."""
    import mlflow

    folder = workspace.home() / "frozen_eval" / md5
    target = folder / uri.rpartition("/")[2]
    if not target.is_file():
        target = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(folder)))
    if evaluate.md5_of(target) != md5:
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


def history(mlflow_client: Any, name: str) -> list[dict[str, Any]]:
    return json.loads(model_tags(mlflow_client, name).get(HISTORY_TAG, "[]"))


def move_alias(mlflow_client: Any, name: str, alias: str, version: str, action: str, reason: str,
               by: str) -> dict[str, Any]:
    """Point the alias at the version and append the move to the registered model's history."""
    previous = holder(mlflow_client, name, alias)
    mlflow_client.set_registered_model_alias(name, alias, version)
    entry = {"at": datetime.now(UTC).isoformat(timespec="seconds"), "alias": alias, "version": str(version),
             "previous": str(previous.version) if previous is not None else None, "action": action,
             "reason": reason, "by": by}
    moves = [*history(mlflow_client, name), entry][-HISTORY_LIMIT:]
    mlflow_client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(moves))
    log.info("%s of %s: version %s (%s)", alias, name, version, reason)
    return entry


def apply(mlflow_client: Any, name: str, version: str, verdict: Verdict, run_id: str) -> None:
    if verdict.alias is not None:
        move_alias(mlflow_client, name, verdict.alias, version, "gate", verdict.reason, f"pipeline run {run_id}")


def champion_line(moves: list[dict[str, Any]]) -> list[str]:
    """The versions that were champion, in order, with rolled-back ones taken off: a stack replayed from history."""
    line: list[str] = []
    for move in moves:
        if move["alias"] != CHAMPION:
            continue
        if move["action"] == "rollback":
            line = line[:-1]
        if not line or line[-1] != move["version"]:
            line.append(move["version"])
    return line


def user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown user"


def promote(tracking_config: TrackingConfig, name: str, version: str, reason: str = "") -> dict[str, Any]:
    """Make a version champion by hand; it stops being challenger."""
    mlflow_client = tracking.client(tracking_config)
    found = get_version(mlflow_client, name, version)
    current = current_champion(mlflow_client, name)
    if current is not None and str(current.version) == str(found.version):
        raise RegistryError(f"{name} version {version} is already champion")
    if CHALLENGER in (found.aliases or []):
        mlflow_client.delete_registered_model_alias(name, CHALLENGER)
    return move_alias(mlflow_client, name, CHAMPION, str(found.version), "promote", reason or "promoted by hand",
                      f"{user()}: llmops models promote")


def rollback(tracking_config: TrackingConfig, name: str, reason: str = "") -> dict[str, Any]:
    """Give the champion alias back to the version that held it before the current champion."""
    mlflow_client = tracking.client(tracking_config)
    current = current_champion(mlflow_client, name)
    if current is None:
        get_version(mlflow_client, name, None)
        raise RegistryError(f"{name} has no champion to roll back")
    line = champion_line(history(mlflow_client, name))
    if not line or line[-1] != str(current.version):  # moved outside llmops: the current one still counts
        line.append(str(current.version))
    if len(line) < 2:
        raise RegistryError(f"{name}: no earlier champion recorded before version {current.version}")
    why = f"rolled back from version {current.version}" + (f": {reason}" if reason else "")
    return move_alias(mlflow_client, name, CHAMPION, line[-2], "rollback", why, f"{user()}: llmops models rollback")


def exists(mlflow_client: Any, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        mlflow_client.get_registered_model(name)
    except MlflowException:
        return False
    return True


def get_version(mlflow_client: Any, name: str, version: str | None) -> Any:
    """The version of a registered model (None: only check that the model exists)."""
    from mlflow.exceptions import MlflowException

    if not exists(mlflow_client, name):
        raise RegistryError(f"no registered model named {name!r}")
    if version is None:
        return None
    try:
        return mlflow_client.get_model_version(name, str(version))
    except MlflowException:
        raise RegistryError(f"{name} has no version {version}") from None



def resolve(mlflow_client: Any, reference: str) -> Any:
    """NAME@alias, NAME/version, or NAME (its champion, else its newest version) as a model version."""
    if "@" in reference:
        name, _, alias = reference.partition("@")
        get_version(mlflow_client, name, None)
        found = holder(mlflow_client, name, alias)
        if found is None:
            raise RegistryError(f"{name} has no version with alias {alias!r}")
        return mlflow_client.get_model_version(name, str(found.version))
    name, slash, version = reference.rpartition("/")
    if slash and version.isdigit():
        return get_version(mlflow_client, name, version)
    name = reference
    get_version(mlflow_client, name, None)
    found = current_champion(mlflow_client, name) or max(
        mlflow_client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
    return mlflow_client.get_model_version(name, str(found.version))
