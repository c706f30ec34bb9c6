"""A run's learning-rate schedule, planned once (:func:`plan_schedule`): horizon, warm-up, stop and the rate there."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch
from transformers import get_scheduler

from .config_values import ConfigError

logger = logging.getLogger("llm2vec")


@dataclass(frozen=True)
class SchedulePlan:
    """One run's schedule; ``learning_rate_at_stop``: the rate the Trainer logs at ``stop_step`` (or ``None``)."""

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
        fraction, peak = self.as_dict()["fraction_of_peak_at_stop"], self.peak_learning_rate
        return (
            f"learning-rate schedule: {self.scheduler}, warm-up {self.warmup_steps} steps, horizon {self.horizon_steps}"
            f" steps ({self.global_batches_per_epoch} global batches an epoch), peak {peak:g}; training stops at step "
            f"{self.stop_step}" + (f", at {fraction:.1%} of the peak" if fraction is not None else "")
        )


def plan_schedule(args, global_batches: int, stop_after_n_steps: int | None, source: str = "config") -> SchedulePlan:
    """The plan for ``global_batches`` optimizer steps an epoch: the Trainer's horizon (``max_steps``, else
    ``ceil(num_train_epochs x global_batches)``), the stop and the rate of its update (``stop - 1`` steps done); a stop
    beyond the horizon is a :class:`ConfigError`, a run mostly inside its warm-up a warning."""
    horizon = int(args.max_steps) if args.max_steps > 0 else math.ceil(args.num_train_epochs * global_batches)
    stop = horizon if stop_after_n_steps is None else int(stop_after_n_steps)
    if stop > horizon:
        where = f"max_steps {args.max_steps}" if args.max_steps > 0 else f"num_train_epochs {args.num_train_epochs:g}"
        where += "" if args.max_steps > 0 else f" x {global_batches} global batches of the data loaded"
        raise ConfigError(
            f"{source}: stop_after_n_steps {stop} is beyond the end of the learning-rate schedule ({horizon} steps: "
            f"{where}); raise num_train_epochs, drop max_steps or lower stop_after_n_steps"
        )
    warmup = args.get_warmup_steps(horizon)
    scheduler = get_scheduler(  # the Trainer's call; its rate function evaluated at the stop, where it is one
        args.lr_scheduler_type,
        optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate),
        num_warmup_steps=warmup,
        num_training_steps=horizon,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs,
    )
    rate = scheduler.lr_lambdas[0] if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) else None
    # step s (from 0) has rate(s) of the peak: at most at the warm-up's end
    if rate is not None and 2 * warmup > horizon:
        length = f"max_steps {args.max_steps}" if args.max_steps > 0 else f"a schedule of {horizon} steps"
        logger.warning(
            f"{source}: {length} with warmup_steps {args.warmup_steps}: "
            + ("the whole run is warm-up" if warmup >= horizon else "warm-up takes most of the run")
            + f", so the learning rate reaches at most {100 * rate(min(horizon - 1, warmup)):.0f} % of learning_rate "
            f"{args.learning_rate:g}; lower warmup_steps (e.g. --warmup_steps {horizon // 10}) for a short run"
        )
    return SchedulePlan(
        scheduler=str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        horizon_steps=horizon,
        warmup_steps=warmup,
        stop_step=stop,
        global_batches_per_epoch=int(global_batches),
        peak_learning_rate=float(args.learning_rate),
        learning_rate_at_stop=None if rate is None else float(args.learning_rate * rate(stop - 1)),
    )
