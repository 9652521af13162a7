"""A non-finite gradient norm, seen at its step: skipped within train.nonfinite.max_skips, else the end of the
training in one line naming the step and the last checkpoint, which is kept. A real Trainer loop on a two-weight
model whose loss turns NaN at chosen steps."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from llmops.config.nonfinite import NonfiniteConfig
from llmops.config.schema import TrainConfig
from llmops.training.nonfinite import DeviceTally, DivergedError, NonfiniteGuard, divergence


class Tiny(torch.nn.Module):
    """A linear fit whose loss is NaN at the given (1-based) forward passes: one per step here."""

    def __init__(self, poisoned: set[int]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([0.5, -0.5]))
        self.poisoned, self.calls = poisoned, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        loss = ((x @ self.weight - y) ** 2).mean()
        return {"loss": loss * float("nan") if self.calls in self.poisoned else loss}


class Probe(TrainerCallback):
    """The weights and the optimizer's first moment after every step, and the figures sent to the tracking."""

    def __init__(self) -> None:
        self.weights: dict[int, torch.Tensor] = {}
        self.moments: dict[int, torch.Tensor] = {}
        self.logged: list[dict[str, Any]] = []

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        self.model = model
        self.weights[state.global_step] = model.weight.detach().clone()
        moment = optimizer.state[model.weight].get("exp_avg")  # none before the first update
        self.moments[state.global_step] = torch.zeros(2) if moment is None else moment.clone()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.logged.append(dict(logs or {}))


# fused AdamW skips on the device, read where figures are read; plain AdamW is stopped by the host at each step
OPTIMIZERS = pytest.mark.parametrize("optimizer", ["adamw_torch_fused", "adamw_torch"])


def train(
    folder: Path,
    policy: NonfiniteConfig,
    poisoned: set[int],
    steps: int = 6,
    rate: float = 0.05,
    schedule: str = "linear",
    optimizer: str = "adamw_torch_fused",
    every: int = 1,
    probe: Probe | None = None,
) -> tuple[Probe, Trainer]:
    # every row the same: each step's loss is the weights', whichever rows it draws
    rows = [{"x": torch.tensor([1.0, 1.0]), "y": torch.tensor(3.0)} for _ in range(16)]
    arguments = TrainingArguments(
        output_dir=str(folder),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=rate,
        lr_scheduler_type=schedule,
        logging_steps=every,
        save_steps=2 * every,
        optim=optimizer,
        save_total_limit=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_nan_inf_filter=False,
    )
    guard, probe = NonfiniteGuard(policy, run=None), probe or Probe()
    trainer = Trainer(model=Tiny(poisoned), args=arguments, train_dataset=rows, callbacks=[guard, probe])
    guard.attach(trainer)
    trainer.train()
    return probe, trainer


@OPTIMIZERS
def test_a_nan_step_is_skipped_weights_and_optimizer_state_untouched_and_counted(
    tmp_path: Path, optimizer: str
) -> None:
    probe, _ = train(tmp_path, NonfiniteConfig(action="skip", max_skips=2), poisoned={3}, optimizer=optimizer)
    assert torch.equal(probe.weights[3], probe.weights[2])  # the update of step 3 was dropped
    assert torch.equal(probe.moments[3], probe.moments[2])  # and AdamW's moments did not move either
    assert not torch.equal(probe.weights[4], probe.weights[3])  # training went on
    assert all(torch.isfinite(w).all() for w in probe.weights.values())
    counts = [entry["nonfinite_steps"] for entry in probe.logged if "loss" in entry]
    assert counts == [0, 0, 1, 1, 1, 1]


@OPTIMIZERS
def test_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path: Path, optimizer: str) -> None:
    with pytest.raises(DivergedError) as stopped:
        train(tmp_path, NonfiniteConfig(action="stop"), poisoned={5}, optimizer=optimizer)
    message = str(stopped.value)
    assert "\n" not in message
    assert "training stopped at step 5: the gradient norm is nan (train.nonfinite.action is stop)" in message
    kept = tmp_path / "checkpoint-4"
    assert f"the last good checkpoint, kept, is {kept}" in message
    assert kept.is_dir() and sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]


@OPTIMIZERS
def test_one_skip_more_than_allowed_stops(tmp_path: Path, optimizer: str) -> None:
    with pytest.raises(
        DivergedError,
        match=r"at step 4: the gradient norm is nan \(2 such steps, more than "
        r"train.nonfinite.max_skips 1\); the last good checkpoint, kept, is "
        r".*checkpoint-2;",
    ):
        train(tmp_path, NonfiniteConfig(action="skip", max_skips=1), poisoned={1, 4}, optimizer=optimizer)
    assert (tmp_path / "checkpoint-2").is_dir()


def test_on_the_device_the_count_is_read_only_where_figures_are_and_the_stop_names_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    original = DeviceTally.read

    def counted(tally: DeviceTally) -> tuple[int, int, float]:
        reads.append(1)
        return original(tally)

    monkeypatch.setattr(DeviceTally, "read", counted)
    probe = Probe()
    with pytest.raises(DivergedError) as stopped:
        # logs every 3 steps, checkpoints every 6: the NaN of step 8 is read at step 9's log
        train(tmp_path, NonfiniteConfig(action="stop"), poisoned={8}, steps=12, every=3, probe=probe)
    assert str(stopped.value).startswith("training stopped at step 8: the gradient norm is nan")
    assert f"the last good checkpoint, kept, is {tmp_path / 'checkpoint-6'};" in str(stopped.value)
    assert len(reads) == 4  # steps 1 (the first loss), 3, 6 and 9: not one per step
    # from step 8 on no update landed: the weights the training stopped with are step 7's
    assert torch.equal(probe.weights[8], probe.weights[7]) and torch.equal(probe.model.weight, probe.weights[7])
    assert not torch.equal(probe.weights[7], probe.weights[6])


def test_a_finite_training_takes_every_step(tmp_path: Path) -> None:
    probe, trainer = train(tmp_path, NonfiniteConfig(action="stop"), poisoned=set())
    assert trainer.state.global_step == 6
    assert all(not torch.equal(probe.weights[s], probe.weights[s - 1]) for s in range(2, 7))


def test_the_policy_is_part_of_the_train_section() -> None:
    assert TrainConfig().nonfinite == NonfiniteConfig(action="skip", max_skips=5)
    with pytest.raises(ValueError, match="extra"):
        TrainConfig(nonfinite={"action": "skip", "limit": 3})
    with pytest.raises(ValueError):
        TrainConfig(nonfinite={"action": "ignore"})


def test_non_finite_figures_reach_mlflow_as_they_are() -> None:
    from llmops.config.schema import TrackingConfig
    from llmops.tracking import log as tracking
    from llmops.tracking.log import RunHandle
    from llmops.training.callbacks import MetricsCallback

    config = TrackingConfig()
    run_id = tracking.client(config).create_run(tracking.experiment_id(config)).info.run_id
    callback = MetricsCallback(RunHandle(tracking=config, run_id=run_id), prefix="train")
    state = type(
        "State", (), {"is_world_process_zero": True, "num_input_tokens_seen": 0, "global_step": 7, "max_steps": 9}
    )()
    callback.on_log(None, state, None, logs={"loss": float("nan"), "grad_norm": float("inf"), "learning_rate": 0.1})
    metrics = tracking.client(config).get_run(run_id).data.metrics
    # MLflow's SQL store keeps infinity as the largest float
    assert math.isnan(metrics["train/loss"]) and metrics["train/grad_norm"] >= sys.float_info.max
    assert metrics["train/learning_rate"] == 0.1
    assert [m.step for m in tracking.client(config).get_metric_history(run_id, "train/loss")] == [7]


def test_a_stage_figure_that_is_nan_is_logged() -> None:
    from llmops.io.figures import Figures

    class Trained(Figures):
        loss: float
        note: str = "x"
        flag: bool = True

    assert {k: str(v) for k, v in Trained(loss=float("nan")).loggable().items()} == {"loss": "nan"}


def test_a_training_whose_loss_ends_far_above_its_first_step_ends_in_one_line(
    tmp_path: Path,
) -> None:
    with pytest.raises(
        DivergedError, match=r"^training diverged: the loss rose from 9 at step 1 to [\d.e+]+ at step 6;"
    ):
        train(tmp_path, NonfiniteConfig(), poisoned=set(), rate=10.0, schedule="constant")


def test_the_first_step_is_logged_and_a_falling_loss_passes(tmp_path: Path) -> None:
    probe, trainer = train(tmp_path, NonfiniteConfig(), poisoned=set(), rate=0.05, steps=6)
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert history[0]["step"] == 1 and history[0]["loss"] == pytest.approx(9.0)
    assert history[-1]["loss"] < history[0]["loss"]


def test_divergence_reads_the_last_finite_loss_against_the_first_step() -> None:
    def history(*losses: float) -> list[dict[str, Any]]:
        return [{"step": 1 + 5 * i, "loss": loss} for i, loss in enumerate(losses)]

    assert divergence(history(5.0, 4.0, 9.9)) is None
    assert divergence(history(5.0, 11.0)) == "the loss rose from 5 at step 1 to 11 at step 6"
    assert divergence(history(5.0, 11.0, float("nan"))) == "the loss rose from 5 at step 1 to 11 at step 6"
    assert divergence(history(5.0, 4.0, float("nan"))) is None  # a skipped step's NaN in the last window
    assert divergence(history(5.0, float("nan"), float("inf"))) == "the loss is not finite after step 1 (up to step 11)"
    assert divergence([{"step": 40, "loss": 1.0}, {"step": 50, "loss": 9.0}]) is None  # no first step to measure from
    assert divergence(history(5.0)) is None


def test_an_objective_whose_loss_grows_is_not_held_to_the_divergence_check(tmp_path: Path) -> None:
    from llmops.objectives.grpo import GRPO

    rows = [{"x": torch.tensor([1.0, 1.0]), "y": torch.tensor(3.0)} for _ in range(16)]
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=2,
        learning_rate=10.0,
        lr_scheduler_type="constant",
        logging_steps=3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    guard = NonfiniteGuard(NonfiniteConfig(), run=None, loss_falls=GRPO.loss_falls)
    trainer = Trainer(model=Tiny(set()), args=arguments, train_dataset=rows, callbacks=[guard])
    guard.attach(trainer)
    trainer.train()  # the same rise that stops a falling-loss objective (above)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] > 2 * losses[0]
