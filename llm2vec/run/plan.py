"""The owner of a run's ``output_dir``, :class:`RunManager`: one object from before the folder is inspected until
the run ends. The driver calls it three times::

    with RunManager.open(config) as run:       # apart from the inputs, writable, locked, inspected, planned
        if run.finished:                        # the same run finished already: nothing to do
            return None
        run_config = run.record(schedule, data_files)   # refuses a resume whose schedule or inputs changed
        run.train(trainer)                      # end step, disk space, overwrite; train; final model, marker last

The plan (:func:`plan_run`, writing nothing) and its rules:

- A folder holding a run is not started in again: ``--resume_from_checkpoint true`` continues it,
  ``--overwrite_output_dir true`` replaces it; the refusal says how its ``run_config.json`` differs.
- Files the run did not record refuse a start unless ``--overwrite_output_dir true``, which writes beside them and
  never deletes them; one the run would write over is refused whatever the flags.
- A resume takes the newest checkpoint of its own stage whose files hash as its manifest recorded; with
  ``--resume_from_checkpoint true`` a damaged one is skipped with a warning, a named one is refused.
- A finished run resumed with the same training length is left alone; one that trains further continues from its
  newest complete checkpoint; one that ends earlier is refused. A resumed checkpoint past the end is refused, one at
  the end becomes the final model. ``--overwrite_output_dir`` deletes the old run only after the disk space is
  checked (:func:`prepare`). Nothing here knows a stage's model or loss.
"""

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
    """Optimizer steps in one pass over ``num_examples`` (as the Trainer counts them)."""
    args = config.training
    batches = math.ceil(num_examples / (args.per_device_train_batch_size * args.world_size))
    return max(1, math.ceil(batches / args.gradient_accumulation_steps))


def planned_end_step(values: dict[str, Any], per_epoch: int) -> int:
    """The step at which training ends: ``max_steps`` if positive, else ``num_train_epochs`` passes; capped by any
    other training-length field holding a positive step count."""
    max_steps = values.get("max_steps", -1)
    end = max_steps if max_steps and max_steps > 0 else math.ceil(values["num_train_epochs"] * per_epoch)
    caps = [v for k, v in values.items() if k not in ("max_steps", "num_train_epochs") and type(v) is int and v > 0]
    return min([end, *caps])


@dataclass
class RunPlan:
    folder: RunFolder
    resume_from: str | None = None
    finished_message: str | None = None  # set when there is nothing to do
    continue_past: int | None = None  # continuing a finished run: the step it ended at
    clear: bool = False  # --overwrite_output_dir: delete the old run (after the start-up checks)
    keep_up_to: int | None = None  # ... but keep the checkpoints up to this step (the one resumed from)
    finalize_only: bool = False  # the resumed checkpoint is at the end: write the final model from it

    @property
    def finished(self) -> bool:
        return self.finished_message is not None


def plan_run(config: RunConfig) -> RunPlan:
    """Decide, writing nothing, what this run does with its ``output_dir`` (the same on every process); raises
    :class:`ConfigError` when it would replace a run the user did not ask to replace."""
    args, stage = config.training, config.stage.stage
    folder, where = RunFolder.inspect(args.output_dir), f"output_dir {args.output_dir}"
    resume, overwrite = args.resume_from_checkpoint, config.stage.overwrite_output_dir
    resume = None if resume in (None, False, "false", "False", "") else resume in (True, "true", "True") or str(resume)
    new, saved = config.resolved(), folder.saved_config()
    diffs = config_differences(saved, new) if saved else []
    differs = f"its {RUN_CONFIG_NAME} " + (
        f"differs from this config in: {'; '.join(diffs)}" if diffs else "equals this config" if saved else "is missing"
    )
    plan = RunPlan(folder)
    foreign = folder.foreign_files()
    if foreign and not overwrite:
        raise ConfigError(
            f"{where} holds files this run did not write ({listed(foreign)}). Move them away, choose another "
            "--output_dir, or pass --overwrite_output_dir true to write beside them (they are never deleted)"
        )
    clashing = folder.would_write_over(foreign)
    if clashing:
        raise ConfigError(
            f"{where} holds {listed(clashing)}, which no run wrote there but which this run would write over (a run "
            "saves its model, tokenizer, model card and checkpoints under such names); move them away or choose "
            "another --output_dir"
        )
    if foreign:
        kept = ", ".join(foreign)
        logger.warning(
            "overwrite_output_dir: writing into %s beside files the run did not write (kept): %s", where, kept
        )

    if resume is None:
        if folder.holds_run and not overwrite:
            raise ConfigError(
                f"{where} already holds {folder.describe()}; {differs}. To continue it pass --resume_from_checkpoint "
                "true; to replace it pass --overwrite_output_dir true; or choose another --output_dir."
            )
        plan.clear = folder.holds_run
        return _settled(plan)
    if (saved or {}).get("stage", stage) != stage:
        raise ConfigError(
            f"{where} holds {folder.describe()}, but this is a Stage {stage} config: it cannot continue it; choose "
            "another --output_dir"
        )
    if resume is True:
        return _settled(_plan_resume(plan, config, where, overwrite, saved, new, diffs, differs))

    # an explicit checkpoint folder
    problem = checkpoint_problem(resume)
    if problem:
        newest = RunFolder.inspect(Path(resume).parent).newest
        raise ConfigError(
            f"resume_from_checkpoint {resume}: {problem}; this checkpoint is incomplete"
            + (f". The newest complete one in its folder: {newest.path}" if newest else "")
        )
    _check_stage(resume, config)
    problem = checkpoint_problem(resume, contents=True)
    if problem:
        raise ConfigError(
            f"resume_from_checkpoint {resume}: {problem}; the checkpoint was changed or damaged after it was saved. "
            "Resume from another checkpoint, or start anew"
        )
    plan.resume_from, step = resume, step_of(resume)
    inside = Path(resume).resolve().parent == Path(args.output_dir).resolve()
    later = [c for c in folder.checkpoints if not inside or c.step > step]
    if folder.finished or later or (not inside and folder.model_files):
        if not overwrite:
            what = f"checkpoints beyond step {step} ({', '.join(c.path.name for c in later)})"
            what = folder.describe() if folder.finished or not inside else what
            raise ConfigError(
                f"{where} holds {what}; resuming from {resume} would replace them. Pass --overwrite_output_dir true "
                "to do so, or choose another --output_dir."
            )
        plan.clear, plan.keep_up_to = True, step if inside else None
    return _settled(plan)


def _plan_resume(plan, config, where, overwrite, saved, new, diffs, differs) -> RunPlan:
    """``--resume_from_checkpoint true``: nothing to do for a finished run of the same length, else the newest
    checkpoint whose files hold what they held when saved (each newer one skipped with a warning naming the file)."""
    folder, stage = plan.folder, config.stage.stage
    if overwrite:
        raise ConfigError(
            f"{where}: --resume_from_checkpoint true continues the run there and --overwrite_output_dir true "
            "replaces it; pass only one of them"
        )
    for c in folder.checkpoints:
        if c.problem:
            logger.warning("%s is incomplete (%s): skipped", c.path, c.problem)
    if folder.finished:
        step = folder.marker.get("global_step")
        new_end = end_values(new, stage)
        if end_values(saved or {}, stage) == new_end:
            note = f" ({differs}; none of these fields changes where training ends)" if diffs else ""
            plan.finished_message = (
                f"{where} holds a finished Stage {stage} run (step {step}, finished {folder.marker.get('finished', '?')})"
                f" with the same training length ({', '.join(f'{k} {v}' for k, v in new_end.items())}){note}: nothing "
                "to do. To train it again pass --overwrite_output_dir true, or choose another --output_dir."
            )
            return plan
        if folder.newest is None:
            raise ConfigError(
                f"{where} holds a finished Stage {stage} run (step {step}) but no complete checkpoint to continue "
                "from; pass --overwrite_output_dir true to train it anew, or choose another --output_dir"
            )
        plan.continue_past = step if isinstance(step, int) else None
    elif folder.newest is None:
        raise ConfigError(
            f"resume_from_checkpoint is true but {folder.path} holds no complete checkpoint-* folder"
            + (f" ({folder.describe()})" if folder.holds_run else "")
            + "; start without --resume_from_checkpoint"
            + (" and with --overwrite_output_dir true" if folder.holds_run else "")
        )
    for checkpoint in reversed(folder.complete):
        problem = checkpoint_problem(checkpoint.path, contents=True)
        if problem is None:
            _check_stage(checkpoint.path, config)
            plan.resume_from = str(checkpoint.path)
            return plan
        logger.warning("%s: %s; skipped", checkpoint.path, problem)
    raise ConfigError(
        f"{where}: no checkpoint holds what it held when saved (each was skipped above); start anew with "
        "--overwrite_output_dir true"
    )


def _check_stage(checkpoint: str | Path, config: RunConfig) -> None:
    """Refuse a checkpoint of the other stage (its ``run_config.json`` says, else its weights: a LoRA adapter is
    Stage II's, a full model Stage I's), and a Stage II checkpoint whose adapter tensors are not exactly those its
    ``adapter_config.json`` implies on the base (the tensor check of :func:`llm2vec.model_files.check_adapter`)."""
    checkpoint, stage = Path(checkpoint), config.stage.stage
    saved = (read_json(checkpoint / RUN_CONFIG_NAME) or {}).get("stage")
    if not saved and (checkpoint / "adapter_model.safetensors").is_file():
        saved = "II"
    elif not saved and any((checkpoint / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")):
        saved = "I"
    if saved and str(saved) != stage:
        what = "a LoRA adapter of Stage II" if saved == "II" else "a full model of Stage I"
        raise ConfigError(
            f"resume_from_checkpoint {checkpoint}: a Stage {saved} checkpoint ({what}), but this is a Stage {stage} "
            f"config; a run resumes only its own stage. Resume it with run_stage_{saved}.py, or start this "
            f"Stage {stage} run without --resume_from_checkpoint"
            + (" (a Stage I model is Stage II's model_name_or_path)" if saved == "I" else "")
        )
    base = model_folder(config.model.model_name_or_path)  # the base itself is compared as an input (.inputs)
    if (checkpoint / "adapter_model.safetensors").is_file() and base is not None:
        problem = _adapter_problem(checkpoint, base, config.model.trust_remote_code)
        if problem:
            raise ConfigError(f"resume_from_checkpoint {checkpoint}: {problem}. Resume from another checkpoint")


def _settled(plan: RunPlan) -> RunPlan:
    """Every process has inspected the folder before any process changes it."""
    from accelerate import PartialState

    PartialState().wait_for_everyone()
    return plan


def prepare(plan: RunPlan, config: RunConfig, model, num_examples: int) -> RunPlan:
    """Where training ends, the free disk space, then (main process) what ``--overwrite_output_dir`` deletes: the
    marker, the files the run recorded, its checkpoints (beyond the one resumed from), the stale staging folders."""
    args, stage = config.training, config.stage.stage
    per_epoch = steps_per_epoch(config, num_examples)
    values = end_values(config.resolved(), stage)
    end, ends_at = planned_end_step(values, per_epoch), ", ".join(f"{k} {v}" for k, v in values.items())
    start = step_of(plan.resume_from) if plan.resume_from else 0
    if plan.continue_past is not None and end <= plan.continue_past:
        raise ConfigError(
            f"output_dir {args.output_dir} holds a finished Stage {stage} run that ended at step {plan.continue_past}; "
            f"this config ends at step {end} ({ends_at}), so there is nothing to continue. Pass "
            "--overwrite_output_dir true to train it anew, or choose another --output_dir"
        )
    if plan.resume_from is not None and start > end:
        raise ConfigError(
            f"resume_from_checkpoint {plan.resume_from}: step {start} is past the end of this config (step {end}: "
            f"{ends_at}); resume with the config it was trained with, or start anew"
        )
    plan.finalize_only = plan.resume_from is not None and start == end
    folder, clear = plan.folder, []
    if plan.clear:
        clear = [folder.path / COMPLETE_MARKER, *folder.model_files, folder.path / FINAL_SAVE_RECORD]
        clear += [c.path for c in folder.checkpoints if plan.keep_up_to is None or c.step > plan.keep_up_to]
        clear = [p for p in dict.fromkeys(clear) if p.exists()]
    check_disk_space(args.output_dir, estimate_disk(args, model, start, end, per_epoch), freed=clear)
    if args.should_save:
        if clear:
            names = ", ".join(p.name for p in clear)
            logger.warning("overwrite_output_dir: removing the previous run's %s from %s", names, args.output_dir)
        for path in clear:
            remove_path(path)
        remove_stale_staging(args.output_dir)
    return _settled(plan)


class RunManager:
    """What a run does with its ``output_dir`` (see the module docstring); made by :meth:`open`."""

    def __init__(self, config: RunConfig, plan: RunPlan):
        self.config, self.plan = config, plan

    @classmethod
    @contextlib.contextmanager
    def open(cls, config: RunConfig) -> Iterator[RunManager]:
        """Check ``output_dir`` (before anything is created), hold its lock while the block runs, and plan the run in
        it; raises :class:`~llm2vec.arguments.ConfigError` or :class:`.lock.RunLocked`."""
        args = config.training
        check_apart(args.output_dir, inputs.run_inputs(config))
        check_writable(args.output_dir)
        with lock.hold(args.output_dir, is_main=args.process_index == 0):
            run = cls(config, plan_run(config))
            if run.finished:
                logger.info(run.plan.finished_message)
            yield run

    @property
    def finished(self) -> bool:
        """``output_dir`` holds this run finished with the same training length: nothing to do."""
        return self.plan.finished

    def record(self, schedule, data_files: list[str]) -> dict[str, Any]:
        """The run config saved beside every checkpoint and the final model: the resolved config, the learning-rate
        ``schedule``, the ``inputs``, the ``batch_geometry`` and the resumes that accepted changes; raises
        :class:`~llm2vec.arguments.ConfigError` when a resumed checkpoint had another schedule or other inputs."""
        from ..schedule import check_resume

        config, checkpoint = self.config, self.plan.resume_from
        check_resume(checkpoint, schedule, extending=self.plan.continue_past is not None)
        found, geometry = inputs.fingerprints(config, data_files), inputs.batch_geometry(config)
        saved = read_json(Path(checkpoint) / RUN_CONFIG_NAME) if checkpoint else None
        accept, step = config.stage.accept_changed_inputs, step_of(checkpoint) if checkpoint else 0
        resumed = inputs.check_resume_inputs(checkpoint, saved, found, geometry, accept, step, config.resolved())
        extra = {"lr_schedule": schedule.as_dict(), "inputs": found, "batch_geometry": geometry}
        return {**config.resolved(), **extra, "resumed_with_changes": resumed}

    def train(self, trainer) -> None:
        """Settle the end step, disk space and overwrite (:func:`prepare`), train as planned and write the final
        model, its completion marker last; a resumed checkpoint at the end step becomes the final model."""
        plan = prepare(self.plan, self.config, trainer.model, len(trainer.train_dataset))
        if plan.finalize_only:
            finalize_from_checkpoint(trainer, plan.resume_from)
        else:
            trainer.train(resume_from_checkpoint=plan.resume_from)
            save_final(trainer)
