"""Monitoring's figures, drift tests and export on served requests made here: a shift in length, words or script is
flagged and the same distribution is not; rated requests become rows of the pipeline's kinds, minus rows the version
trained on and questions of the frozen evaluation set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmops.cli.app import run
from llmops.config.monitor import MonitorConfig
from llmops.config.schema import DataConfig
from llmops.data.profile import fingerprint, profile_inputs
from llmops.data.synthetic import instruction_records
from llmops.monitoring.drift import drift
from llmops.monitoring.export import export_rows
from llmops.monitoring.figures import feedback_over_time, traffic
from llmops.monitoring.traces import Assessed, MonitorError, ServedRequest
from llmops.objectives import record_kind
from tests.helpers import write_rows_table

INSTRUCTION = record_kind(DataConfig(kind="instruction"))
VERSION = "m/3"
SETTINGS = MonitorConfig()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The inputs profile of 1,300 training rows (200 held out), and rows the profile has not seen."""
    rows = instruction_records(1800, seed=3)
    folder = tmp_path_factory.mktemp("splits")
    write_rows_table(rows[:1300], folder / "train")
    write_rows_table(rows[1300:1500], folder / "eval")
    return profile_inputs(INSTRUCTION, folder / "train", folder / "eval"), rows


def asked(content: str, at_ms: int = 0, ok: bool = True, latency: float = 20.0, **rated: Any) -> ServedRequest:
    return ServedRequest(trace_id=f"tr-{abs(hash((content, at_ms)))}", version=VERSION, at_ms=at_ms, ok=ok,
                         endpoint="chat.completions", inputs={"messages": [{"role": "user", "content": content}]},
                         outputs={"output": "an answer"}, latency_ms=latency, prompt_tokens=10, completion_tokens=4,
                         truncated=content.startswith("long"),
                         assessments=tuple(Assessed(name, value, at_ms + 1) for name, value in rated.items()))


def question(row: dict[str, Any]) -> str:
    return f"{row['instruction']}\n{row['input']}" if row["input"] else row["instruction"]


def test_the_profile_holds_lengths_words_scripts_and_every_training_record(data: tuple) -> None:
    profile, rows = data
    assert profile["kind"] == "instruction" and profile["rows"] == 1300
    assert len(profile["lengths"]) == 1300 and profile["scripts"] == {"LATIN": 1300}
    assert fingerprint(rows[0], INSTRUCTION) in set(profile["fingerprints"])
    assert fingerprint(rows[1700], INSTRUCTION) not in set(profile["fingerprints"]) or rows[1700] in rows[:1300]
    held = profile["held_out_words"]
    assert held["total"] > 0 and 0 <= held["rare"] < held["total"]


def test_requests_like_the_training_data_do_not_drift(data: tuple) -> None:
    profile, rows = data
    served = [asked(question(row)) for row in rows[1500:1700]]
    found = drift(profile, served, SETTINGS)
    assert found["judged"] and not found["drifted"], found
    assert set(found["checks"]) == {"prompt_length", "rare_words", "scripts"}
    assert found["checks"]["prompt_length"]["p_value"] > SETTINGS.drift_p_value


def test_longer_prompts_in_another_script_with_unseen_words_drift(data: tuple) -> None:
    profile, _ = data
    served = [asked(f"Переведи, пожалуйста, этот длинный абзац номер {n} о реке и мосте на английский язык.")
              for n in range(60)]
    found = drift(profile, served, SETTINGS)
    assert found["drifted"]
    assert {check for check, tested in found["checks"].items() if tested["drifted"]} == {
        "prompt_length", "rare_words", "scripts"}
    assert found["checks"]["rare_words"]["served_rate"] > found["checks"]["rare_words"]["reference_rate"]


def test_too_few_requests_or_no_profile_are_not_judged(data: tuple) -> None:
    profile, rows = data
    assert drift(profile, [asked(question(rows[0]))], SETTINGS) == {
        "judged": False, "drifted": False, "reason": "1 requests, under monitor.min_requests (30)"}
    assert drift(None, [], SETTINGS)["judged"] is False


def test_a_classifiers_predicted_labels_are_tested_against_its_training_labels(tmp_path: Path) -> None:
    kind = record_kind(DataConfig(kind="classification"))
    rows = [{"text": f"review number {n} of the bridge", "label": "good" if n % 2 else "bad"} for n in range(400)]
    write_rows_table(rows, tmp_path / "train")
    profile = profile_inputs(kind, tmp_path / "train", tmp_path / "eval")
    assert profile["labels"] == {"good": 200, "bad": 200}

    def predicted(label: str, n: int) -> ServedRequest:
        return ServedRequest(trace_id=f"tr-{n}", version=VERSION, at_ms=n, ok=True, endpoint="predict",
                             inputs={"rows": [{"text": f"review number {n} of the bridge"}]},
                             outputs={"results": [{"line": 1, "label": label}]})

    balanced = drift(profile, [predicted("good" if n % 2 else "bad", n) for n in range(100)], SETTINGS)
    skewed = drift(profile, [predicted("good", n) for n in range(100)], SETTINGS)
    assert not balanced["checks"]["labels"]["drifted"] and skewed["checks"]["labels"]["drifted"]


def test_traffic_figures_and_feedback_over_time() -> None:
    served = [asked(f"q{n}", at_ms=n * 60_000, latency=float(n + 1), ok=n != 5,
                    **({"score": n % 3} if n < 6 else {})) for n in range(100)]
    figures = traffic(served)
    assert figures["requests"] == 100 and figures["errors"] == 1
    assert figures["latency_ms"] == {"p50": 50.5, "p95": 95.0, "p99": 99.0}
    assert figures["tokens"] == {"prompt": 1000, "completion": 400}
    assert figures["feedback"]["score"] == 6 and figures["feedback"]["mean_score"] == 1.0
    buckets = feedback_over_time(served, 3600)[VERSION]
    assert list(buckets) == ["1970-01-01T00:00:00Z", "1970-01-01T01:00:00Z"]
    assert buckets["1970-01-01T00:00:00Z"]["score"] == 6 and buckets["1970-01-01T01:00:00Z"]["score"] == 0


def test_export_makes_rows_of_each_kind_and_guards_training_and_evaluation_data(data: tuple, tmp_path: Path) -> None:
    profile, rows = data
    trained, frozen, fresh = rows[0], rows[1400], rows[1600:1604]
    served = [
        asked(question(fresh[0]), at_ms=1, correction="the corrected answer"),
        asked(question(fresh[1]), at_ms=2, preferred="a better answer"),
        asked(question(fresh[2]), at_ms=3, score=1),
        asked(question(trained), at_ms=4, correction=trained["output"]),  # what it was trained on
        asked(question(frozen), at_ms=5, correction="leaks the evaluation question"),
        asked(question(fresh[3]), at_ms=6),
    ]
    output = tmp_path / "feedback.jsonl"
    exported = export_rows(served, {VERSION: profile}, [frozen], output)
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert written == [{"instruction": question(fresh[0]), "input": "", "output": "the corrected answer"}]
    pairs = [json.loads(line) for line in (tmp_path / "feedback.preference.jsonl").read_text().splitlines()]
    assert pairs == [{"prompt": [{"role": "user", "content": question(fresh[1])}], "chosen": "a better answer",
                      "rejected": "an answer"}]
    assert dict(exported.dropped) == {"score only": 1, "already trained on": 1,
                                      "asked by the frozen evaluation set (contamination)": 1,
                                      "no feedback on a request of no row shape": 1}
    # a second export adds nothing twice and keeps what the file held
    again = export_rows(served, {VERSION: profile}, [frozen], output)
    assert again.added == {} and again.dropped["already exported"] == 2
    assert [json.loads(line) for line in output.read_text().splitlines()] == written


def test_export_without_a_profile_refuses_rather_than_repeat_training_rows(tmp_path: Path) -> None:
    with pytest.raises(MonitorError, match="inputs profile"):
        export_rows([asked("q", correction="c")], {VERSION: None}, [], tmp_path / "out.jsonl")


@pytest.mark.parametrize("args", [["monitor", "m", "--since", "yesterday"], ["monitor", "export"],
                                  ["monitor", "export", "m"], ["monitor", "a", "b"]])
def test_bad_monitor_arguments_are_one_line_and_exit_2(args: list[str], capsys: pytest.CaptureFixture) -> None:
    assert run(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
