"""What a run does with its ``output_dir``: start, resume, continue a finished run, or refuse (:func:`plan_run`,
before anything is loaded); then, once the data and the model are loaded, where training ends, the free disk
space and what ``--overwrite_output_dir`` deletes (:func:`prepare`).

- **A finished run is not overwritten.** A run refuses to start in a folder that holds a finished model or
  checkpoints, and says what is there and how its ``run_config.json`` differs from the new config:
  ``--resume_from_checkpoint true`` continues it, ``--overwrite_output_dir true`` replaces it.
- **What the run did not write is not touched.** Files the folder's run did not record
  (:meth:`llm2vec.run.folder.RunFolder.foreign_files`) refuse a start unless ``--overwrite_output_dir true``, which
  then writes beside them and never deletes them; one the run would write over is refused whatever the flags.
- **A resume takes only an intact checkpoint of its own stage.** The checkpoint's stage must be this config's
  (:func:`checkpoint_stage`); its files must hash as its manifest recorded (:func:`llm2vec.run.folder.content_problem`:
  with ``--resume_from_checkpoint true`` a changed one is skipped with a warning for the next older one, a
  named one is refused).
- **A finished run is recognised.** ``--resume_from_checkpoint true`` on a finished run whose training-length
  fields (:func:`llm2vec.run.config_fields.training_end_fields`) equal the new config's says so and does nothing
  (exit 0). If the new config trains further, the run continues from its newest complete checkpoint; if it ends
  earlier, it is refused. A checkpoint without its weights or its ``trainer_state.json`` (made by other tools or
  older versions) is skipped with a warning.
- **Where training ends decides the rest** (:func:`prepare`): a resumed checkpoint past the end is refused, one
  at the end (a kill during the final save) is turned into the final model without training another step; the
  free disk space is checked (:func:`llm2vec.run.checks.check_disk_space`); only then does
  ``--overwrite_output_dir`` delete the old run.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..arguments import ConfigError, RunConfig
from .checks import bytes_under, check_disk_space, estimate_disk
from .config_fields import config_differences, end_values
from .folder import (
    COMPLETE_MARKER,
    FINAL_SAVE_RECORD,
    RUN_CONFIG_NAME,
    RunFolder,
    checkpoint_problem,
    content_problem,
    listed,
    read_json,
    remove_path,
    step_of,
)
from .saves import remove_stale_staging

logger = logging.getLogger("llm2vec")


# ---------------------------------------------------------------------------------------------- where training ends


def steps_per_epoch(config: RunConfig, num_examples: int) -> int:
    """Optimizer steps in one pass over ``num_examples`` (as the Trainer counts them)."""
    args = config.training
    batches = math.ceil(num_examples / (args.per_device_train_batch_size * args.world_size))
    return max(1, math.ceil(batches / args.gradient_accumulation_steps))


def planned_end_step(values: dict[str, Any], per_epoch: int) -> int:
    """The optimizer step at which training ends: ``max_steps`` if positive, else ``num_train_epochs`` passes;
    capped by any other training-length field holding a positive step count."""
    max_steps = values.get("max_steps", -1)
    end = max_steps if max_steps and max_steps > 0 else math.ceil(values["num_train_epochs"] * per_epoch)
    for name, value in values.items():
        if (
            name not in ("max_steps", "num_train_epochs")
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value > 0
        ):
            end = min(end, value)
    return end


# ---------------------------------------------------------------------------------------------- the plan


@dataclass
class RunPlan:
    """What a run will do with its ``output_dir`` (decided by :func:`plan_run`, settled by :func:`prepare`)."""

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
    if value in (True, "true", "True"):
        return True
    return str(value)


def _how_to_proceed(flags: str) -> str:
    return f"{flags}, or choose another --output_dir"


def plan_run(config: RunConfig) -> RunPlan:
    """Decide, without writing anything, what this run does with its ``output_dir``; raises :class:`ConfigError`
    when it would replace a run the user did not ask to replace. Every process decides the same."""
    args, stage = config.training, config.stage.stage
    folder = RunFolder.inspect(args.output_dir)
    resume, overwrite = _resume_setting(args.resume_from_checkpoint), config.stage.overwrite_output_dir
    new = config.resolved()
    saved = folder.saved_config()
    diffs = config_differences(saved, new) if saved else []
    differs = (
        f"its {RUN_CONFIG_NAME} differs from this config in: {'; '.join(diffs)}"
        if diffs
        else f"its {RUN_CONFIG_NAME} equals this config"
        if saved
        else f"it has no {RUN_CONFIG_NAME}"
    )
    where = f"output_dir {args.output_dir}"
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
            f"{where} holds {listed(clashing)}, which no run wrote there but which this run would write over (a "
            "run saves its model, tokenizer, model card and checkpoints under such names); move them away or "
            "choose another --output_dir"
        )
    if foreign:
        logger.warning(
            "overwrite_output_dir: writing into %s beside files the run did not write (kept): %s",
            where,
            ", ".join(foreign),
        )

    if resume is None:
        if folder.holds_run and not overwrite:
            raise ConfigError(
                f"{where} already holds {folder.describe()}; {differs}. To continue it pass "
                f"--resume_from_checkpoint true; to replace it pass --overwrite_output_dir true; or "
                "choose another --output_dir."
            )
        plan.clear = folder.holds_run
        return _settled(plan)

    saved_stage = (saved or {}).get("stage", stage)
    if saved_stage != stage:
        raise ConfigError(
            f"{where} holds {folder.describe()}, but this is a Stage {stage} config: it cannot continue "
            "it; choose another --output_dir"
        )
    if resume is True:
        if overwrite:
            raise ConfigError(
                f"{where}: --resume_from_checkpoint true continues the run there and "
                "--overwrite_output_dir true replaces it; pass only one of them"
            )
        for c in folder.checkpoints:
            if c.problem:
                logger.warning("%s is incomplete (%s): skipped", c.path, c.problem)
        if folder.finished:
            step = folder.marker.get("global_step")
            saved_end, new_end = end_values(saved or {}, stage), end_values(new, stage)
            if saved_end == new_end:
                note = f" ({differs}; none of these fields changes where training ends)" if diffs else ""
                plan.finished_message = (
                    f"{where} holds a finished Stage {stage} run (step {step}, finished "
                    f"{folder.marker.get('finished', '?')}) with the same training length "
                    f"({', '.join(f'{k} {v}' for k, v in new_end.items())}){note}: nothing to do. To train it "
                    "again pass --overwrite_output_dir true, or choose another --output_dir."
                )
                return plan
            if folder.newest is None:
                raise ConfigError(
                    f"{where} holds a finished Stage {stage} run (step {step}) but no complete "
                    "checkpoint to continue from; "
                    + _how_to_proceed("pass --overwrite_output_dir true to train it anew")
                )
            plan.continue_past = step if isinstance(step, int) else None
        elif folder.newest is None:
            raise ConfigError(
                f"resume_from_checkpoint is true but {args.output_dir} holds no complete checkpoint-* "
                "folder"
                + (f" ({folder.describe()})" if folder.holds_run else "")
                + "; start without --resume_from_checkpoint"
                + (" and with --overwrite_output_dir true" if folder.holds_run else "")
            )
        chosen = _intact_checkpoint(folder)
        if chosen is None:
            raise ConfigError(
                f"{where}: no checkpoint holds what it held when saved (each was skipped above); start anew with "
                "--overwrite_output_dir true"
            )
        _check_stage(chosen, stage)
        plan.resume_from = str(chosen)
        return _settled(plan)

    # an explicit checkpoint folder
    problem = checkpoint_problem(resume)
    if problem:
        raise ConfigError(
            f"resume_from_checkpoint {resume}: {problem}; this checkpoint is incomplete"
            + (
                f". The newest complete one in its folder: {newest}"
                if (newest := RunFolder.inspect(Path(resume).parent).newest)
                else ""
            )
        )
    _check_stage(resume, stage)
    problem = content_problem(resume)
    if problem:
        raise ConfigError(
            f"resume_from_checkpoint {resume}: {problem}; the checkpoint was changed or damaged after it was saved. "
            "Resume from another checkpoint, or start anew"
        )
    plan.resume_from = resume
    inside = Path(resume).resolve().parent == Path(args.output_dir).resolve()
    step = step_of(resume)
    later = [c for c in folder.checkpoints if not inside or c.step > step]
    if folder.finished or later or (not inside and folder.model_files):
        if not overwrite:
            what = (
                folder.describe()
                if folder.finished or not inside
                else f"checkpoints beyond step {step} ({', '.join(c.path.name for c in later)})"
            )
            raise ConfigError(
                f"{where} holds {what}; resuming from {resume} would replace them. Pass "
                "--overwrite_output_dir true to do so, or choose another --output_dir."
            )
        plan.clear, plan.keep_up_to = True, step if inside else None
    return _settled(plan)


def _intact_checkpoint(folder: RunFolder) -> Path | None:
    """The newest complete checkpoint whose files hold what they held when saved (:func:`content_problem`); each
    newer one that does not is skipped with a warning naming the file."""
    for checkpoint in reversed(folder.complete):
        problem = content_problem(checkpoint.path)
        if problem is None:
            return checkpoint.path
        logger.warning("%s: %s; skipped", checkpoint.path, problem)
    return None


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


# ---------------------------------------------------------------------------------------------- before training


def _to_clear(plan: RunPlan) -> list[Path]:
    """What --overwrite_output_dir deletes: the marker, the files the run recorded as its own, the run's
    checkpoints (beyond the one resumed from, when it lies in the same folder). Nothing else."""
    folder = plan.folder
    paths = [folder.path / COMPLETE_MARKER] if folder.marker is not None else []
    paths += folder.model_files  # only the files its marker or final-save record list (llm2vec.run.folder)
    paths += [folder.path / FINAL_SAVE_RECORD]
    paths += [c.path for c in folder.checkpoints if plan.keep_up_to is None or c.step > plan.keep_up_to]
    return [p for p in dict.fromkeys(paths) if p.exists()]


def prepare(plan: RunPlan, config: RunConfig, model, num_examples: int) -> RunPlan:
    """The checks that need the data and the model, then (main process) the changes to ``output_dir``.

    Where training ends (:func:`planned_end_step`): a continued finished run must end later than it did; a
    resumed checkpoint past the end is refused, one at the end is turned into the final model without training.
    Free disk space for the checkpoints and final model (:func:`llm2vec.run.checks.estimate_disk`). Only then does
    ``--overwrite_output_dir`` delete the old run (marker first) and the stale staging folders go.
    """
    args, stage = config.training, config.stage.stage
    per_epoch = steps_per_epoch(config, num_examples)
    values = end_values(config.resolved(), stage)
    end = planned_end_step(values, per_epoch)
    ends_at = ", ".join(f"{k} {v}" for k, v in values.items())
    start = step_of(plan.resume_from) if plan.resume_from else 0
    if plan.continue_past is not None and end <= plan.continue_past:
        raise ConfigError(
            f"output_dir {args.output_dir} holds a finished Stage {stage} run that ended at step "
            f"{plan.continue_past}; this config ends at step {end} ({ends_at}), so there is nothing "
            "to continue. " + _how_to_proceed("Pass --overwrite_output_dir true to train it anew")
        )
    if plan.resume_from is not None:
        if start > end:
            raise ConfigError(
                f"resume_from_checkpoint {plan.resume_from}: step {start} is past the end of this config "
                f"(step {end}: {ends_at}); resume with the config it was trained with, or start anew"
            )
        plan.finalize_only = start == end
    clear = _to_clear(plan) if plan.clear else []
    check_disk_space(args.output_dir, estimate_disk(args, model, start, end, per_epoch), freed=bytes_under(clear))
    if args.should_save:
        if clear:
            logger.warning(
                "overwrite_output_dir: removing the previous run's %s from %s",
                ", ".join(p.name for p in clear),
                args.output_dir,
            )
        for path in clear:
            remove_path(path)
        remove_stale_staging(args.output_dir)
    from accelerate import PartialState

    PartialState().wait_for_everyone()
    return plan
