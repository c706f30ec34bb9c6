"""A run's learning-rate schedule, planned once before training (:func:`plan_schedule`): its horizon, its warm-up,
the step training stops at and the rate there."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from transformers import get_scheduler

from .config_values import ConfigError


@dataclass(frozen=True)
class SchedulePlan:
    """The schedule of one run. ``learning_rate_at_stop`` is the rate of the last update, step ``stop_step`` (what
    the Trainer logs at that step); ``None`` for schedulers that are not functions of the step."""

    scheduler: str
    horizon_steps: int
    warmup_steps: int
    stop_step: int
    global_batches_per_epoch: int
    peak_learning_rate: float
    learning_rate_at_stop: float | None

    KEPT_ON_RESUME = ("horizon_steps", "warmup_steps", "scheduler", "peak_learning_rate")

    def as_dict(self) -> dict:
        rate, peak = self.learning_rate_at_stop, self.peak_learning_rate
        return {**asdict(self), "fraction_of_peak_at_stop": None if rate is None or not peak else round(rate / peak, 6)}

    def describe(self) -> str:
        text = (
            f"learning-rate schedule: {self.scheduler}, warm-up {self.warmup_steps} steps, horizon {self.horizon_steps} "
            f"steps ({self.global_batches_per_epoch} global batches an epoch), peak {self.peak_learning_rate:g}; "
            f"training stops at step {self.stop_step}"
        )
        fraction = self.as_dict()["fraction_of_peak_at_stop"]
        return text + ("" if fraction is None else f", where the rate is {fraction:.1%} of its peak")


def learning_rate_at(args, horizon: int, step: int) -> float | None:
    """The rate of optimizer step ``step`` (1-based, so ``step - 1`` steps behind it) of a ``horizon``-step schedule
    for ``args``: the rate function of the scheduler that the Trainer's ``get_scheduler`` call builds, evaluated
    there (``None`` for a scheduler that has none, such as ``reduce_lr_on_plateau``)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.get_warmup_steps(horizon),
        num_training_steps=horizon,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs,
    )
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return None
    return float(args.learning_rate * scheduler.lr_lambdas[0](step - 1))


def plan_schedule(args, global_batches: int, stop_after_n_steps: int | None, source: str = "config") -> SchedulePlan:
    """The plan for ``global_batches`` optimizer steps per epoch: the Trainer's horizon (``max_steps``, else
    ``ceil(num_train_epochs x global_batches)``), the stop and the rate there; a stop beyond the horizon is a
    :class:`ConfigError`."""
    horizon = int(args.max_steps) if args.max_steps > 0 else math.ceil(args.num_train_epochs * global_batches)
    stop = horizon if stop_after_n_steps is None else int(stop_after_n_steps)
    if stop > horizon:
        where = f"max_steps {args.max_steps}" if args.max_steps > 0 else f"num_train_epochs {args.num_train_epochs:g}"
        where += "" if args.max_steps > 0 else f" x {global_batches} global batches of the data loaded"
        raise ConfigError(
            f"{source}: stop_after_n_steps {stop} is beyond the end of the learning-rate schedule ({horizon} steps: "
            f"{where}); raise num_train_epochs, drop max_steps or lower stop_after_n_steps"
        )
    return SchedulePlan(
        scheduler=str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        horizon_steps=horizon,
        warmup_steps=args.get_warmup_steps(horizon),
        stop_step=stop,
        global_batches_per_epoch=int(global_batches),
        peak_learning_rate=float(args.learning_rate),
        learning_rate_at_stop=learning_rate_at(args, horizon, stop),
    )
