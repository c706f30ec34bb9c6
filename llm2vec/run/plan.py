"""What a run does with its ``output_dir``: start, resume, continue a finished run, or refuse (:func:`plan_run`, before
anything loads); then, with the data and the model loaded, where training ends, the free disk space and what
``--overwrite_output_dir`` deletes (:func:`prepare`).

- A folder holding a run (finished, or checkpoints) is not started in again: ``--resume_from_checkpoint true``
  continues it, ``--overwrite_output_dir true`` replaces it; the refusal says how its ``run_config.json`` differs.
- Files the folder's run did not record refuse a start unless ``--overwrite_output_dir true``, which writes beside
  them and never deletes them; one the run would write over is refused whatever the flags.
- A resume takes the newest checkpoint of its own stage whose files hash as its manifest recorded; with
  ``--resume_from_checkpoint true`` a damaged one is skipped with a warning, a named one is refused.
- A finished run resumed with the same training-length fields is left alone (nothing to do); one that trains further
  continues from its newest complete checkpoint; one that ends earlier is refused.
- A resumed checkpoint past the end is refused; one at the end becomes the final model without training. Only after
  the disk space is checked does ``--overwrite_output_dir`` delete the old run.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..arguments import ConfigError, RunConfig
from ..io import COMPLETE_MARKER
from .checks import bytes_under, check_disk_space, estimate_disk
from .config_fields import config_differences, end_values
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
from .saves import remove_stale_staging

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


def _resume_setting(value) -> str | bool | None:
    if value in (None, False, "false", "False", ""):
        return None
    return True if value in (True, "true", "True") else str(value)


def plan_run(config: RunConfig) -> RunPlan:
    """Decide, writing nothing, what this run does with its ``output_dir`` (the same on every process); raises
    :class:`ConfigError` when it would replace a run the user did not ask to replace."""
    args, stage = config.training, config.stage.stage
    folder, where = RunFolder.inspect(args.output_dir), f"output_dir {args.output_dir}"
    resume, overwrite = _resume_setting(args.resume_from_checkpoint), config.stage.overwrite_output_dir
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
        return _settled(_plan_resume(plan, where, stage, overwrite, saved, new, diffs, differs))

    # an explicit checkpoint folder
    problem = checkpoint_problem(resume)
    if problem:
        newest = RunFolder.inspect(Path(resume).parent).newest
        raise ConfigError(
            f"resume_from_checkpoint {resume}: {problem}; this checkpoint is incomplete"
            + (f". The newest complete one in its folder: {newest.path}" if newest else "")
        )
    _check_stage(resume, stage)
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


def _plan_resume(plan, where, stage, overwrite, saved, new, diffs, differs) -> RunPlan:
    """``--resume_from_checkpoint true``: nothing to do for a finished run of the same length, else the newest
    checkpoint whose files hold what they held when saved (each newer one skipped with a warning naming the file)."""
    folder = plan.folder
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
            _check_stage(checkpoint.path, stage)
            plan.resume_from = str(checkpoint.path)
            return plan
        logger.warning("%s: %s; skipped", checkpoint.path, problem)
    raise ConfigError(
        f"{where}: no checkpoint holds what it held when saved (each was skipped above); start anew with "
        "--overwrite_output_dir true"
    )


def checkpoint_stage(checkpoint: str | Path) -> str | None:
    """The stage that saved ``checkpoint``: its ``run_config.json``'s, else read from its weights (a LoRA adapter
    is Stage II's, a full model Stage I's); ``None`` when neither says."""
    checkpoint = Path(checkpoint)
    stage = (read_json(checkpoint / RUN_CONFIG_NAME) or {}).get("stage")
    if stage:
        return str(stage)
    if (checkpoint / "adapter_model.safetensors").is_file():
        return "II"
    if (checkpoint / "model.safetensors").is_file() or (checkpoint / "model.safetensors.index.json").is_file():
        return "I"
    return None


def _check_stage(checkpoint: str | Path, stage: str) -> None:
    saved = checkpoint_stage(checkpoint)
    if saved is not None and saved != stage:
        what = "a LoRA adapter of Stage II" if saved == "II" else "a full model of Stage I"
        raise ConfigError(
            f"resume_from_checkpoint {checkpoint}: a Stage {saved} checkpoint ({what}), but this is a Stage {stage} "
            f"config; a run resumes only its own stage. Resume it with run_stage_{saved}.py, or start this "
            f"Stage {stage} run without --resume_from_checkpoint"
            + (" (a Stage I model is Stage II's model_name_or_path)" if saved == "I" else "")
        )


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
    check_disk_space(args.output_dir, estimate_disk(args, model, start, end, per_epoch), freed=bytes_under(clear))
    if args.should_save:
        if clear:
            names = ", ".join(p.name for p in clear)
            logger.warning("overwrite_output_dir: removing the previous run's %s from %s", names, args.output_dir)
        for path in clear:
            remove_path(path)
        remove_stale_staging(args.output_dir)
    return _settled(plan)
