"""The owner of a run's ``output_dir``, :class:`RunManager`. The driver calls ``RunManager.open(config)`` (checked,
locked, inspected, planned: :func:`plan_run`, which writes nothing), ``run.record(schedule, data_files)`` and
``run.train(trainer)``; the rules are the table of ``docs/run_safety.md``."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..arguments import ConfigError, RunConfig
from ..fingerprints import model_folder
from ..io import COMPLETE_MARKER
from ..model_files import _adapter_problem
from . import inputs, lock
from .checks import check_apart, check_disk_space, check_writable, estimate_disk
from .folder import (
    FINAL_SAVE_RECORD,
    RUN_CONFIG_NAME,
    RunFolder,
    checkpoint_problem,
    listed,
    read_json,
    remove_path,
    step_of,
)
from .inputs import config_differences, end_values
from .saves import finalize_from_checkpoint, remove_stale_staging, save_final

logger = logging.getLogger("llm2vec")


def steps_per_epoch(config: RunConfig, num_examples: int) -> int:
    args = config.training
    batches = math.ceil(num_examples / (args.per_device_train_batch_size * args.world_size))
    return max(1, math.ceil(batches / args.gradient_accumulation_steps))


def planned_end_step(values: dict[str, Any], per_epoch: int) -> int:
    """``max_steps`` if positive, else ``num_train_epochs`` passes; capped by any other positive length field."""
    max_steps = values.get("max_steps", -1)
    end = max_steps if max_steps and max_steps > 0 else math.ceil(values["num_train_epochs"] * per_epoch)
    caps = [v for k, v in values.items() if k not in ("max_steps", "num_train_epochs") and type(v) is int and v > 0]
    return min([end, *caps])


def plan_run(config: RunConfig) -> RunManager:
    """What this run does with its ``output_dir``, deciding and writing nothing else; or :class:`ConfigError`."""
    args, stage = config.training, config.stage.stage
    folder, where = RunFolder.inspect(args.output_dir), f"output_dir {args.output_dir}"
    resume, overwrite = args.resume_from_checkpoint, config.stage.overwrite_output_dir
    resume = None if resume in (None, False, "false", "False", "") else resume in (True, "true", "True") or str(resume)
    new, saved = config.resolved(), folder.saved_config()
    diffs = config_differences(saved, new) if saved else []
    differs = f"its {RUN_CONFIG_NAME} " + (
        f"differs from this config in: {'; '.join(diffs)}" if diffs else "equals this config" if saved else "is missing"
    )
    plan = RunManager(config, folder)
    foreign = folder.foreign_files()
    if foreign and not overwrite:
        raise ConfigError(
            f"{where} holds files this run did not write ({listed(foreign)}); move them, or pass "
            "--overwrite_output_dir true to write beside them"
        )
    clashing = folder.would_write_over(foreign)
    if clashing:
        raise ConfigError(
            f"{where} holds {listed(clashing)}, which no run wrote there but which this run would write over"
        )
    if foreign:
        logger.warning("writing into %s beside files the run did not write (kept): %s", where, ", ".join(foreign))

    if resume is None:
        if folder.holds_run and not overwrite:
            raise ConfigError(
                f"{where} already holds {folder.describe()}; {differs}. Pass --resume_from_checkpoint true to continue "
                "it or --overwrite_output_dir true to replace it"
            )
        plan.clear = folder.holds_run
        return _settled(plan)
    if (saved or {}).get("stage", stage) != stage:
        raise ConfigError(f"{where} holds {folder.describe()}, but this is a Stage {stage} config")
    if resume is True:
        return _settled(_plan_resume(plan, config, where, overwrite, saved, new, diffs, differs))

    # an explicit checkpoint folder
    if problem := checkpoint_problem(resume, contents=True):
        newest = RunFolder.inspect(Path(resume).parent).newest
        raise ConfigError(
            f"resume_from_checkpoint {resume}: {problem}; it is incomplete or changed"
            + (f"; newest complete: {newest.path}" if newest else "")
        )
    _check_stage(resume, config)
    plan.resume_from, step = resume, step_of(resume)
    inside = Path(resume).resolve().parent == Path(args.output_dir).resolve()
    later = [c for c in folder.checkpoints if not inside or c.step > step]
    if folder.finished or later or (not inside and folder.model_files):
        if not overwrite:
            what = f"checkpoints beyond step {step} ({', '.join(c.path.name for c in later)})"
            what = folder.describe() if folder.finished or not inside else what
            raise ConfigError(f"{where} holds {what}; pass --overwrite_output_dir true to replace them")
        plan.clear, plan.keep_up_to = True, step if inside else None
    return _settled(plan)


def _plan_resume(plan, config, where, overwrite, saved, new, diffs, differs) -> RunManager:
    """``--resume_from_checkpoint true``: nothing to do (a finished run of the same length), or the newest checkpoint
    whose files hash as saved."""
    folder, stage = plan.folder, config.stage.stage
    if overwrite:
        raise ConfigError("pass only one of --resume_from_checkpoint true and --overwrite_output_dir true")
    for c in folder.checkpoints:
        if c.problem:
            logger.warning("%s is incomplete (%s): skipped", c.path, c.problem)
    if folder.finished:
        step = folder.marker.get("global_step")
        new_end = end_values(new, stage)
        if end_values(saved or {}, stage) == new_end:
            plan.finished_message = (
                f"{where} holds a finished Stage {stage} run (step {step}) of the same training length"
                + (f" ({differs})" if diffs else "")
                + ": nothing to do"
            )
            return plan
        if folder.newest is None:
            raise ConfigError(f"{where} holds a finished Stage {stage} run (step {step}) but no complete checkpoint")
        plan.continue_past = step if isinstance(step, int) else None
    elif folder.newest is None:
        held = f" ({folder.describe()})" if folder.holds_run else ""
        raise ConfigError(f"resume_from_checkpoint is true but {folder.path} holds no complete checkpoint{held}")
    for checkpoint in reversed(folder.complete):
        problem = checkpoint_problem(checkpoint.path, contents=True)
        if problem is None:
            _check_stage(checkpoint.path, config)
            plan.resume_from = str(checkpoint.path)
            return plan
        logger.warning("%s: %s; skipped", checkpoint.path, problem)
    raise ConfigError(f"{where}: no checkpoint holds what it held when saved")


def _check_stage(checkpoint: str | Path, config: RunConfig) -> None:
    """Refuse a checkpoint of the other stage (its run config's, else its weights': an adapter is Stage II's) and an
    adapter whose tensors are not those its config implies on the base."""
    checkpoint, stage = Path(checkpoint), config.stage.stage
    adapter = (checkpoint / "adapter_model.safetensors").is_file()
    full = any((checkpoint / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json"))
    saved = (read_json(checkpoint / RUN_CONFIG_NAME) or {}).get("stage") or ("II" if adapter else "I" if full else None)
    if saved and str(saved) != stage:
        raise ConfigError(
            f"resume_from_checkpoint {checkpoint}: a Stage {saved} checkpoint, but this is a Stage {stage} config; "
            f"resume it with run_stage_{saved}.py"
        )
    base = model_folder(config.model.model_name_or_path)
    if adapter and base is not None and (problem := _adapter_problem(checkpoint, base, config.model.trust_remote_code)):
        raise ConfigError(f"resume_from_checkpoint {checkpoint}: {problem}")


def _settled(plan: RunManager) -> RunManager:
    from accelerate import PartialState

    PartialState().wait_for_everyone()
    return plan


@dataclass
class RunManager:
    """What a run does with its ``output_dir``: made by :meth:`open`, then :meth:`record` and :meth:`train`."""

    config: RunConfig
    folder: RunFolder
    resume_from: str | None = None
    finished_message: str | None = None  # set when there is nothing to do
    continue_past: int | None = None  # continuing a finished run: the step it ended at
    clear: bool = False  # --overwrite_output_dir: delete the old run (after the disk check)
    keep_up_to: int | None = None  # ... but keep the checkpoints up to this step (the one resumed from)

    @classmethod
    @contextlib.contextmanager
    def open(cls, config: RunConfig) -> Iterator[RunManager]:
        """Check ``output_dir``, hold its lock while the block runs, and plan the run in it (:func:`plan_run`)."""
        args = config.training
        check_apart(args.output_dir, inputs.run_inputs(config))
        check_writable(args.output_dir)
        with lock.hold(args.output_dir, is_main=args.process_index == 0):
            run = plan_run(config)
            if run.finished:
                logger.info(run.finished_message)
            yield run

    @property
    def finished(self) -> bool:
        return self.finished_message is not None

    def record(self, schedule, data_files: list[str]) -> dict[str, Any]:
        """The run config saved with every save; refuses a resume whose schedule or inputs changed."""
        from ..schedule import check_resume

        config, checkpoint = self.config, self.resume_from
        check_resume(checkpoint, schedule, extending=self.continue_past is not None)
        found, geometry = inputs.fingerprints(config, data_files), inputs.batch_geometry(config)
        saved = read_json(Path(checkpoint) / RUN_CONFIG_NAME) if checkpoint else None
        accept, step = config.stage.accept_changed_inputs, step_of(checkpoint) if checkpoint else 0
        resumed = inputs.check_resume_inputs(checkpoint, saved, found, geometry, accept, step, config.resolved())
        extra = {"lr_schedule": schedule.as_dict(), "inputs": found, "batch_geometry": geometry}
        return {**config.resolved(), **extra, "resumed_with_changes": resumed}

    def train(self, trainer) -> None:
        """Check where training ends and the disk space, delete what an overwrite replaces, train, save the final
        model (from the resumed checkpoint when it is at the end step)."""
        args, stage, folder = self.config.training, self.config.stage.stage, self.folder
        per_epoch = steps_per_epoch(self.config, len(trainer.train_dataset))
        values = end_values(self.config.resolved(), stage)
        end, ends_at = planned_end_step(values, per_epoch), ", ".join(f"{k} {v}" for k, v in values.items())
        start = step_of(self.resume_from) if self.resume_from else 0
        if self.continue_past is not None and end <= self.continue_past:
            raise ConfigError(
                f"output_dir {args.output_dir} holds a finished Stage {stage} run that ended at step "
                f"{self.continue_past}; this config ends at step {end} ({ends_at})"
            )
        if self.resume_from is not None and start > end:
            raise ConfigError(
                f"resume_from_checkpoint {self.resume_from}: step {start} is past the end of this config ({end})"
            )
        clear = (
            [folder.path / COMPLETE_MARKER, *folder.model_files, folder.path / FINAL_SAVE_RECORD] if self.clear else []
        )
        clear += [
            c.path for c in folder.checkpoints if self.clear and (self.keep_up_to is None or c.step > self.keep_up_to)
        ]
        clear = [p for p in dict.fromkeys(clear) if p.exists()]
        check_disk_space(args.output_dir, estimate_disk(args, trainer.model, start, end, per_epoch), freed=clear)
        if args.should_save:
            if clear:
                names = ", ".join(p.name for p in clear)
                logger.warning("overwrite_output_dir: removing the previous run's %s from %s", names, args.output_dir)
            for path in clear:
                remove_path(path)
            remove_stale_staging(args.output_dir)
        _settled(self)
        if self.resume_from is not None and start == end:
            finalize_from_checkpoint(trainer, self.resume_from)
        else:
            trainer.train(resume_from_checkpoint=self.resume_from)
            save_final(trainer)
