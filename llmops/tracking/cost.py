"""What a run cost: device-hours per stage, computed or reused, their price, and the training signal they bought.

A stage built in a run costs its build's wall time times the devices it held (Compute,
kept in the artifact's record); a reused artifact costs nothing now, and what building it took is
what the reuse saved. Prices come from `cost.device_hour`, matched by part of the device's name.
The training signal is the useful tokens: the non-padding tokens the training saw, every epoch.
What the data lost on the way (quarantine, duplicates, contamination, truncation, padding) is
counted in the same units, as tokens training would have seen: the rows quarantine and dedup took
are never tokenized, so their tokens are estimated from the mean tokens of a kept training row.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from llmops.io.figures import Compute, Figures

# the figures `llmops runs` lists per run (logged on the run as `cost.<figure>`), by column
RUN_COLUMNS = {"device-hours": "computed_device_hours", "saved": "reused_device_hours",
               "useful tokens": "useful_tokens", "cost": "computed_cost"}


class StageCost(Figures):
    """One stage's build: on what, how long, and whether this run built it or reused it."""

    device: str
    devices: int
    seconds: float
    device_hours: float
    reused: bool
    # the build's price; None without a price for its device
    price: float | None = None


class LostTokens(Figures):
    """Tokens training did not see, by cause, as training would have seen them (times the epochs trained)."""

    # estimates: rows removed before tokenizing, times the mean tokens of a kept training row, times the share of
    # rows that go to training
    quarantined_est: int
    duplicates_est: int
    contaminated_est: int
    # counted: what max_length cut off (and rows it left without a target); None when the tokenize record has no count
    truncated: int | None
    # counted: the padding slots the training's batches carried
    padding: int


class CostFigures(Figures):
    """What a run spent and saved, in device-hours and (with prices) money, and the useful tokens it stands for."""

    computed_device_hours: float
    # what the artifacts this run reused took to build: what the cache saved
    reused_device_hours: float
    stages: dict[str, StageCost]
    useful_tokens: int
    lost: LostTokens
    # with cost.device_hour set: the price of the computed and of the reused device-hours (None when a device has
    # no price), and the run's price per million useful tokens
    computed_cost: float | None = None
    saved_cost: float | None = None
    cost_per_million_useful_tokens: float | None = None
    # devices that ran a stage and have no price in cost.device_hour (while it sets some)
    unpriced: list[str] = []

    def loggable(self) -> dict[str, float]:
        """Every figure by its name, and each stage's as `stages.<stage>.<figure>` (stage names are the table's)."""
        flat = super().loggable()
        for name, spent in self.stages.items():
            flat.update({f"stages.{name}.{figure}": value for figure, value in spent.loggable().items()})
        return flat

    @property
    def priced(self) -> bool:
        return self.computed_cost is not None


def price_per_hour(prices: Mapping[str, float], device: str) -> float | None:
    """The price of `device` from a table keyed by part of a device's name, as throughput.py finds a card's peak
    (H100 prices "NVIDIA H100 80GB HBM3"); the longest key wins (L40S over L4), case aside, and a key names whole
    words only (L4 does not price an L40). None: no key matches."""
    matches = [key for key in prices if names_card(key, device)]
    return prices[max(matches, key=len)] if matches else None


def names_card(key: str, device: str) -> bool:
    """Whether `device` (a card's reported name) holds `key` as whole words, case aside: "H100" is in "NVIDIA
    H100 80GB HBM3" and "NVIDIA A100-SXM4-80GB" is an A100, but "NVIDIA L40" is no L4 and a GH200 no H200."""
    return re.search(rf"(?<![a-z0-9]){re.escape(key.lower())}(?![a-z0-9])", device.lower()) is not None


def stage_cost(compute: Compute, reused: bool, prices: Mapping[str, float]) -> StageCost:
    per_hour = price_per_hour(prices, compute.device)
    return StageCost(device=compute.device, devices=compute.devices, seconds=compute.seconds,
                     device_hours=compute.device_hours, reused=reused,
                     price=None if per_hour is None else compute.device_hours * per_hour)


def estimated_tokens(rows: int, tokens_per_row: float, share: float, epochs: float) -> int:
    """The tokens training would have seen of `rows` removed before tokenizing: each as long as a kept training
    row, a `share` of them bound for training, seen `epochs` times."""
    return round(rows * tokens_per_row * share * epochs)


def padding_tokens(tokens: int, padding_fraction: float) -> int:
    """The padding slots beside `tokens` real ones, when `padding_fraction` of all slots were padding."""
    if not 0 <= padding_fraction < 1:
        return 0
    return round(tokens * padding_fraction / (1 - padding_fraction))


def total(stages: dict[str, StageCost], useful_tokens: int, lost: LostTokens,
          prices: Mapping[str, float]) -> CostFigures:
    """The run's figures from its stages' costs: hours and prices summed by computed and reused."""
    computed = [spent for spent in stages.values() if not spent.reused]
    reused = [spent for spent in stages.values() if spent.reused]
    unpriced = sorted({spent.device for spent in stages.values() if spent.price is None}) if prices else []
    spent = summed_price(computed) if prices else None
    return CostFigures(
        computed_device_hours=sum(s.device_hours for s in computed),
        reused_device_hours=sum(s.device_hours for s in reused), stages=stages, useful_tokens=useful_tokens,
        lost=lost, computed_cost=spent, saved_cost=summed_price(reused) if prices else None,
        cost_per_million_useful_tokens=per_million(spent, useful_tokens), unpriced=unpriced)


def summed_price(stages: list[StageCost]) -> float | None:
    """The stages' prices added up; None when one of them has no price (a partial sum would understate it)."""
    prices = [spent.price for spent in stages]
    return None if any(price is None for price in prices) else sum(price for price in prices if price is not None)


def per_million(price: float | None, tokens: int) -> float | None:
    return None if price is None or tokens <= 0 else price / tokens * 1e6
