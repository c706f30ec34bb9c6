"""Where the learning-rate schedule ends and where training stops: two numbers, as in the authors' runs."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
from transformers import TrainerCallback, get_scheduler

from .config_values import ConfigError

logger = logging.getLogger("llm2vec")


@dataclass(frozen=True)
class SchedulePlan:
    """The schedule of one run. ``learning_rate_at_stop`` is the rate of the last update, step ``stop_step``
    (what the Trainer logs at that step); ``None`` for schedulers that are not functions of the step."""

    scheduler: str
    horizon_steps: int
    warmup_steps: int
    stop_step: int
    num_train_epochs: float
    global_batches_per_epoch: int
    max_steps: int
    peak_learning_rate: float
    learning_rate_at_stop: float | None

    @property
    def stops_early(self) -> bool:
        return self.stop_step < self.horizon_steps

    def as_dict(self) -> dict:
        out = asdict(self)
        out["fraction_of_peak_at_stop"] = (
            None
            if self.learning_rate_at_stop is None or not self.peak_learning_rate
            else round(self.learning_rate_at_stop / self.peak_learning_rate, 6)
        )
        return out

    def describe(self) -> str:
        source = (
            f"max_steps {self.max_steps}"
            if self.max_steps > 0
            else f"{self.num_train_epochs:g} epoch(s) x {self.global_batches_per_epoch} global batches"
        )
        text = (
            f"learning-rate schedule: {self.scheduler}, warm-up {self.warmup_steps} steps, horizon "
            f"{self.horizon_steps} steps ({source}), peak {self.peak_learning_rate:g}; "
        )
        if self.stops_early:
            text += f"training stops at step {self.stop_step} (stop_after_n_steps)"
        else:
            text += f"training runs to step {self.stop_step}, the end of the schedule"
        if self.learning_rate_at_stop is not None:
            text += f", where the rate is {self.learning_rate_at_stop:.4g} ({self.as_dict()['fraction_of_peak_at_stop']:.1%} of peak)"
        return text


def learning_rate_at(args, horizon: int, step: int) -> float | None:
    """The rate of optimizer step ``step`` (1-based) of a ``horizon``-step schedule for ``args``: transformers'
    scheduler after ``step - 1`` steps, built by the same ``get_scheduler`` call as the Trainer's, on a
    throwaway parameter. (The Trainer logs this rate at that step; linear warm-up starts from 0 at step 1.)"""
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
    """The horizon, the stop and the rate at the stop; a stop beyond the horizon is a :class:`ConfigError`."""
    # the Trainer's number of scheduled steps for ``global_batches`` optimizer steps per epoch
    horizon = int(args.max_steps) if args.max_steps > 0 else math.ceil(args.num_train_epochs * global_batches)
    stop = horizon if stop_after_n_steps is None else int(stop_after_n_steps)
    if stop > horizon:
        where = (
            f"max_steps {args.max_steps}"
            if args.max_steps > 0
            else f"num_train_epochs {args.num_train_epochs:g} x {global_batches} global batches of the data loaded"
        )
        raise ConfigError(
            f"{source}: stop_after_n_steps {stop} is beyond the end of the learning-rate schedule "
            f"({horizon} steps: {where}); raise num_train_epochs, drop max_steps or lower "
            "stop_after_n_steps"
        )
    return SchedulePlan(
        scheduler=str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        horizon_steps=horizon,
        warmup_steps=args.get_warmup_steps(horizon),
        stop_step=stop,
        num_train_epochs=float(args.num_train_epochs),
        global_batches_per_epoch=int(global_batches),
        max_steps=int(args.max_steps),
        peak_learning_rate=float(args.learning_rate),
        learning_rate_at_stop=learning_rate_at(args, horizon, stop),
    )


def check_resume(checkpoint: str | None, plan: SchedulePlan, extending: bool = False) -> None:
    """Resuming must continue the same schedule: the checkpoint's run (its ``run_config.json``) planned the
    same horizon, warm-up, scheduler and peak rate. ``extending`` (continuing a finished run further, which
    the user asked for explicitly) turns a difference into a warning. Where the checkpoint lies against the
    stop is checked by :meth:`llm2vec.run.RunManager.train` (past it: refused; at it: the final model)."""
    if checkpoint is None:
        return
    config_file = os.path.join(checkpoint, "run_config.json")
    if not os.path.isfile(config_file):
        return
    with open(config_file) as f:
        saved = json.load(f).get("lr_schedule")
    if not saved:
        return
    for key in ("horizon_steps", "warmup_steps", "scheduler", "peak_learning_rate"):
        if saved.get(key) != getattr(plan, key):
            change = f"{checkpoint} was trained with {key} {saved.get(key)!r} but this run plans {getattr(plan, key)!r}"
            if extending:
                logger.warning("continuing a finished run with another learning-rate schedule: %s", change)
                continue
            raise ConfigError(
                f"resume_from_checkpoint: {change}; resuming would change the learning-rate schedule. Resume with "
                "the same data, batch, num_train_epochs / max_steps and warm-up, or start a new run"
            )


class StopAfterNSteps(TrainerCallback):
    """Stops training at ``plan.stop_step``, saving a checkpoint there when checkpoints are saved by steps (as the
    Trainer does at the end of its schedule)."""

    def __init__(self, plan: SchedulePlan):
        self.plan = plan

    def on_step_end(self, args, state, control, **kwargs):
        if self.plan.stops_early and state.global_step >= self.plan.stop_step:
            control.should_training_stop = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control


class StopAtTimeBudget(TrainerCallback):
    """Stops training at the first optimizer step that ends ``minutes`` after ``start`` (``time.monotonic()``; default:
    now), with an evaluation and a checkpoint there when the run has them; the stop is logged
    (``{"step", "stopped_by": "stop_after_minutes", "minutes"}``).
    """

    def __init__(self, minutes: float, start: float | None = None):
        self.seconds = 60.0 * minutes
        self.start = time.monotonic() if start is None else start
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        used = time.monotonic() - self.start
        if self.stopped_at is not None or used < self.seconds or state.global_step >= state.max_steps:
            return control
        self.stopped_at = state.global_step
        control.should_training_stop = True
        control.should_evaluate = str(args.eval_strategy) not in ("no", "IntervalStrategy.NO")
        control.should_save = control.should_save or args.save_strategy == "steps"
        minutes = round(used / 60.0, 3)
        state.log_history.append({"step": state.global_step, "stopped_by": "stop_after_minutes", "minutes": minutes})
        logger.info(
            "stopping at step %d of %d: %.2f minutes used of stop_after_minutes %g",
            state.global_step,
            state.max_steps,
            minutes,
            self.seconds / 60.0,
        )
        return control
