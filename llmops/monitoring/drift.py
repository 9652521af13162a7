"""Drift: a version's served requests against what it was trained on (its run's inputs profile, data/profile.py).

Each check is a test of scipy's, judged against `monitor.drift_p_value`:
- the length of what was asked (characters): the two-sample Kolmogorov-Smirnov test;
- the share of words rare or unseen in training, against the held-out split's share: chi-squared on the 2x2 table;
- the scripts inputs are written in (Latin, Cyrillic, CJK...): chi-squared on the table of counts;
- for classifiers, the labels predicted against the training labels: chi-squared on the table of counts.
A version with fewer served requests than `monitor.min_requests` is not judged. Redacted traces keep no words:
their text checks are skipped and say so.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from llmops.config.monitor import MonitorConfig
from llmops.config.schema import DataConfig
from llmops.data.profile import PROFILE, rare_words, script_of
from llmops.io.errors import ConfigError
from llmops.monitoring.traces import MonitorError, ServedRequest
from llmops.objectives import record_kind
from llmops.records.base import RecordKind

# where the pipeline run logged the report stage's files (the version's run)
PROFILE_ARTIFACT = f"data/{PROFILE}"


def reference_profile(mlflow_client: Any, label: str) -> dict[str, Any] | None:
    """The inputs profile of the run that made version `label` (NAME/N); None when it has none (a version registered
    before profiles were kept, or by hand)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    name, _, number = label.rpartition("/")
    try:
        run_id = mlflow_client.get_model_version(name, number).run_id
        return json.loads(mlflow.artifacts.load_text(f"runs:/{run_id}/{PROFILE_ARTIFACT}")) if run_id else None
    except (MlflowException, OSError, ValueError):
        return None


def drift(profile: dict[str, Any] | None, requests: list[ServedRequest], settings: MonitorConfig) -> dict[str, Any]:
    """Each check's statistic, p-value and verdict, with `drifted` true when any check passed its threshold."""
    if profile is None:
        return {"judged": False, "reason": "the version's run kept no inputs profile", "drifted": False}
    if len(requests) < settings.min_requests:
        return {
            "judged": False,
            "drifted": False,
            "reason": f"{len(requests)} requests, under monitor.min_requests ({settings.min_requests})",
        }
    kind = kind_of(profile)
    checks: dict[str, dict[str, Any]] = {}
    texts = [asked_text(kind, request) for request in requests if not request.redacted]
    if texts:
        checks["prompt_length"] = length_shift(profile["lengths"], [len(text) for text in texts])
        checks["rare_words"] = rare_word_shift(profile, texts)
        checks["scripts"] = count_shift(profile["scripts"], Counter(script_of(text) for text in texts))
    predicted = Counter(label for request in requests for label in predicted_labels(request))
    if profile.get("labels") and predicted:
        checks["labels"] = count_shift(profile["labels"], predicted)
    for check in checks.values():
        check["drifted"] = bool(check["p_value"] < settings.drift_p_value)
    skipped = "redacted traces keep no text: only the label check ran" if len(texts) < len(requests) else None
    return {
        "judged": True,
        "requests": len(requests),
        "checks": checks,
        "drifted": any(check["drifted"] for check in checks.values()),
        **({"note": skipped} if skipped else {}),
    }


def kind_of(profile: dict[str, Any]) -> RecordKind:
    try:
        return record_kind(DataConfig(kind=profile["kind"]))
    except ConfigError as err:
        raise MonitorError(f"inputs profile: {err}") from None


def asked_text(kind: RecordKind, request: ServedRequest) -> str:
    """What the request asked, as the kind reads it (a chat request's turns, or each predicted row's inputs)."""
    rows = request.inputs.get("rows")
    if isinstance(rows, list):
        return "\n".join(kind.asked(row) for row in rows if isinstance(row, dict))
    return kind.asked(request.inputs)


def predicted_labels(request: ServedRequest) -> list[str]:
    results = request.outputs.get("results")
    return (
        [str(result["label"]) for result in results if isinstance(result, dict) and "label" in result]
        if isinstance(results, list)
        else []
    )


def length_shift(reference: list[int], served: list[int]) -> dict[str, Any]:
    from scipy.stats import ks_2samp

    tested = ks_2samp(reference, served)
    return {
        "test": "ks_2samp",
        "statistic": round(float(tested.statistic), 4),
        "p_value": float(tested.pvalue),
        "served_median": float(sorted(served)[len(served) // 2]),
        "reference_median": float(reference[len(reference) // 2]) if reference else None,
    }


def rare_word_shift(profile: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    rare, total = rare_words(texts, profile["words"])
    held = profile["held_out_words"]
    result = count_shift(
        {"rare": held["rare"], "common": held["total"] - held["rare"]}, Counter({"rare": rare, "common": total - rare})
    )
    return {
        **result,
        "served_rate": round(rare / total, 4) if total else None,
        "reference_rate": round(held["rare"] / held["total"], 4) if held["total"] else None,
    }


def count_shift(reference: dict[str, int], served: Counter[str]) -> dict[str, Any]:
    """Chi-squared test of homogeneity of two tables of counts over the same categories."""
    from scipy.stats import chi2_contingency

    categories = sorted(set(reference) | set(served))
    table = [[reference.get(name, 0) for name in categories], [served.get(name, 0) for name in categories]]
    present = [column for column in zip(*table, strict=True) if sum(column)]
    if len(present) < 2 or not all(sum(row) for row in table):
        return {"test": "chi2_contingency", "statistic": 0.0, "p_value": 1.0, "served": dict(served)}
    tested = chi2_contingency([list(row) for row in zip(*present, strict=True)])
    return {
        "test": "chi2_contingency",
        "statistic": round(float(tested.statistic), 4),
        "p_value": float(tested.pvalue),
        "served": dict(served),
    }
