"""The cost arithmetic against figures computed by hand, and where a build's cost is kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmops.config.files import parse_config
from llmops.data.dedup import DedupFigures, DedupRecord
from llmops.data.tokenize import SplitFigures, TokenizeFigures, TokenizeRecord
from llmops.data.validate import ValidateFigures, ValidateRecord
from llmops.io.errors import ConfigError
from llmops.io.figures import Compute, Figures
from llmops.registry import accounting
from llmops.store import artifacts
from llmops.store.artifacts import StageRecord
from llmops.tracking.cost import LostTokens, estimated_tokens, padding_tokens, price_per_hour, stage_cost, total
from llmops.training.session import TrainFigures, TrainRecord

PRICES = {"H100": 2.5, "A100": 1.2, "cpu": 0.05}
H100 = "NVIDIA H100 80GB HBM3"


def test_a_price_is_found_by_part_of_the_device_name_the_longest_part_winning() -> None:
    assert price_per_hour(PRICES, H100) == 2.5
    assert price_per_hour(PRICES, "cpu") == 0.05
    assert price_per_hour({"L4": 0.8, "L40S": 1.9}, "NVIDIA L40S") == 1.9
    assert price_per_hour({"L4": 0.8, "L40S": 1.9}, "NVIDIA L4") == 0.8
    assert price_per_hour({"L4": 0.8, "L40S": 1.9}, "NVIDIA L40") is None  # whole names: an L40 is no L4
    assert price_per_hour({"h100": 3.0}, H100) == 3.0
    assert price_per_hour(PRICES, "NVIDIA L4") is None
    assert price_per_hour({}, "cpu") is None


def test_a_stage_costs_its_wall_time_times_its_devices() -> None:
    spent = stage_cost(Compute(device=H100, devices=4, seconds=1800), reused=False, prices=PRICES)
    assert (spent.device_hours, spent.price) == (2.0, 5.0)
    assert stage_cost(Compute(seconds=72), reused=True, prices={}).model_dump() == {
        "device": "cpu", "devices": 1, "seconds": 72.0, "device_hours": 0.02, "reused": True, "price": None}


def test_the_run_sums_computed_and_reused_stages_apart() -> None:
    stages = {"ingest": stage_cost(Compute(seconds=72), False, PRICES),
              "tokenize": stage_cost(Compute(seconds=360), True, PRICES),
              "train": stage_cost(Compute(device=H100, devices=4, seconds=1800), False, PRICES)}
    lost = LostTokens(quarantined_est=1, duplicates_est=2, contaminated_est=0, truncated=3, padding=4)
    figures = total(stages, 2_000_000, lost, PRICES)
    assert figures.computed_device_hours == pytest.approx(2.02)
    assert figures.reused_device_hours == pytest.approx(0.1)
    assert figures.computed_cost == pytest.approx(5.001)  # 2 h at 2.5 + 0.02 h at 0.05
    assert figures.saved_cost == pytest.approx(0.005)  # 0.1 h at 0.05
    assert figures.cost_per_million_useful_tokens == pytest.approx(2.5005)
    assert figures.unpriced == [] and figures.priced
    logged = figures.loggable()
    assert logged["stages.train.device_hours"] == 2.0 and logged["stages.train.devices"] == 4
    assert logged["lost.padding"] == 4 and logged["useful_tokens"] == 2_000_000
    assert "stages.train.reused" not in logged and "computed_cost" in logged


def test_without_prices_only_hours_and_a_missing_price_gives_no_partial_sum() -> None:
    lost = LostTokens(quarantined_est=0, duplicates_est=0, contaminated_est=0, truncated=0, padding=0)
    unpriced = {"train": stage_cost(Compute(device=H100, seconds=3600), False, {})}
    figures = total(unpriced, 10, lost, {})
    assert (figures.computed_device_hours, figures.computed_cost, figures.unpriced) == (1.0, None, [])
    assert "computed_cost" not in figures.loggable() and not figures.priced
    partly = {"ingest": stage_cost(Compute(seconds=3600), False, {"A100": 1.2}),
              "train": stage_cost(Compute(device=H100, seconds=3600), False, {"A100": 1.2})}
    figures = total(partly, 10, lost, {"A100": 1.2})
    assert figures.computed_cost is None and figures.cost_per_million_useful_tokens is None
    assert figures.unpriced == [H100, "cpu"]


def test_token_estimates_and_padding() -> None:
    assert estimated_tokens(rows=10, tokens_per_row=30.0, share=0.9, epochs=2.0) == 540
    assert padding_tokens(750, 0.25) == 250
    assert padding_tokens(750, 0.0) == 0


def split(rows: int, tokens: int, truncated_tokens: int | None) -> SplitFigures:
    return SplitFigures(rows=rows, tokens=tokens, target_tokens=tokens // 2, truncated=3,
                        truncated_tokens=truncated_tokens, truncation_rate=0.01, dropped_no_target=10, max_length=48)


# every stage's build: 36 s on the CPU, 0.01 device-hours
BUILD = Compute(seconds=36)


def records(compute: Compute | None = BUILD) -> list[StageRecord]:
    """A run's records with round figures: 1,000 unique rows, 900 of them training rows written 1,350 times."""
    validate = ValidateFigures(rows_read=1095, rows_kept=1045, rows_quarantined=50, bad_fraction=0.05, codes={},
                               sources_not_read_to_the_end=0, unread_sources=[])
    dedup = DedupFigures(rows_in=1045, duplicates=30, near_duplicates=10, contaminated=5, train_rows=900,
                         eval_rows=100, train_rows_weighted=1350, rows_out=1000, duplicate_rate=0.038)
    tokenize = TokenizeFigures(vocab_size=320, tokenizer_source="trained-here", max_length=48,
                               train=split(1340, 40_200, 500), eval=split(100, 3000, 0))
    train = TrainFigures(steps=10, epochs=3.0, train_loss=1.0, first_logged_loss=None, last_logged_loss=None,
                         best_eval_loss=None, tokens=120_600, seconds=30.0, tokens_per_s=4020.0, parameters=1,
                         trainable_parameters=1, packed=False, padding_fraction=0.1, peak_memory_mb=1.0,
                         strategy="none", world_size=1, resumed_from_step=0, flops_per_token=1.0,
                         tflops_per_device=0.0, mfu=None)
    made = [ValidateRecord(stage="validate", key="v", hash="v", figures=validate, compute=compute),
            DedupRecord(stage="dedup", key="d", hash="d", figures=dedup, compute=compute),
            TokenizeRecord(stage="tokenize", key="t", hash="t", figures=tokenize, compute=compute),
            TrainRecord(stage="train", key="tr", hash="tr", figures=train, compute=compute)]
    others = [StageRecord[Rows](stage=name, key=name, hash=name, figures=Rows(rows=1), compute=compute)
              for name in ("ingest", "report", "evaluate")]
    return made + others


class Rows(Figures):
    rows: int


def test_lost_tokens_by_cause_as_training_would_have_seen_them() -> None:
    made = {record.stage: record for record in records()}
    lost = accounting.lost_tokens(made["validate"], made["dedup"], made["tokenize"], made["train"])
    # a kept training row holds 40,200 / 1,340 = 30 tokens; 1,350 training rows are written per 1,000 kept rows;
    # 3 epochs
    assert lost.quarantined_est == 6075  # 50 rows x 30 x 1.35 x 3
    assert lost.duplicates_est == 4860  # 30 + 10 rows x 30 x 1.35 x 3
    assert lost.contaminated_est == 675  # 5 rows x 30 x 1.5 (a training row is written 1,350 / 900 times) x 3
    assert lost.truncated == 1500  # 500 x 3
    assert lost.padding == 13_400  # 120,600 real tokens were 90% of the slots


def test_the_run_cost_from_its_records_and_its_line() -> None:
    config = parse_config({"cost": {"device_hour": {"cpu": 0.05}}})
    made = records()
    made[2] = made[2].model_copy(update={"reused": True})  # tokenize
    figures = accounting.run_cost(config, made)
    assert figures is not None
    assert figures.useful_tokens == 120_600
    assert figures.computed_device_hours == pytest.approx(6 * 0.01) and figures.reused_device_hours == 0.01
    assert figures.computed_cost == pytest.approx(0.003) and figures.saved_cost == pytest.approx(0.0005)
    assert figures.cost_per_million_useful_tokens == pytest.approx(0.003 / 0.1206)
    assert accounting.line(figures) == (
        "0.06 device-hours computed (cpu), 0.01 reused (saved); 121k useful tokens (lost: 6.1k quarantined est., "
        "4.9k duplicates est., 675 contaminated est., 1.5k truncated, 13k padding); price 0.003 (saved 0.0005), "
        "0.0249 per 1M useful tokens")
    unpriced = accounting.run_cost(parse_config({}), made)
    assert unpriced is not None and accounting.line(unpriced).endswith("13k padding)")
    assert accounting.version_tags(figures)["cost.computed_device_hours"] == "0.06"
    assert accounting.version_tags(figures)["cost.devices"] == "cpu"


def test_records_without_build_figures_give_no_cost() -> None:
    assert accounting.run_cost(parse_config({}), records(compute=None)) is None
    assert accounting.run_cost(parse_config({}), records()[:3]) is None


def test_token_amounts_read_at_a_glance() -> None:
    assert [accounting.amount(n) for n in (950, 3100, 12_000, 40_000, 1_200_000, 3_400_000_000)] == \
        ["950", "3.1k", "12k", "40k", "1.2M", "3.4B"]


def test_a_negative_price_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"cost\.device_hour\.cpu: input should be greater than or equal to 0"):
        parse_config({"cost": {"device_hour": {"cpu": -1}}})


def test_prices_change_no_config_hash() -> None:
    priced = parse_config({"cost": {"device_hour": PRICES}})
    assert priced.digest() == parse_config({}).digest() and "cost" not in priced.recipe()


def test_a_build_keeps_its_wall_time_and_devices_and_a_reuse_hands_them_back(home: Path) -> None:
    held = Compute(device=H100, devices=2)

    def build(folder: Path) -> Rows:
        (folder / "rows.txt").write_text("1\n")
        return Rows(rows=1)

    built = artifacts.build_artifact(StageRecord[Rows], "up", "k1", build, held=held)
    assert not built.reused and built.compute.device == H100 and built.compute.devices == 2
    assert built.compute.seconds >= 0
    again = artifacts.build_artifact(StageRecord[Rows], "up", "k1", build)
    assert again.reused and again.compute == built.compute


def test_a_record_made_before_builds_were_timed_still_reads() -> None:
    stored = {"stage": "up", "key": "k", "hash": "h", "upstream": {}, "figures": {"rows": 1}}
    record = StageRecord[Rows].model_validate_json(json.dumps(stored))
    assert record.compute is None and record.figures.rows == 1
