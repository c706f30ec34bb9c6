"""The owner of a run's ``output_dir``: one object from before the folder is inspected until the run ends.

A training run calls it three times, in this order::

    with RunManager.open(config) as run:       # writable, locked, inspected, the plan decided
        if run.finished:                        # the same run finished already: nothing to do
            return None
        ...                                     # the model family, the data, the learning-rate schedule
        run_config = run.record(schedule, data_files)   # refuses a resume whose schedule or inputs changed
        ...                                     # the model, the collator, the trainer (saving run_config)
        run.train(trainer)                      # end step, disk space, overwrite; train; final model, marker last

What each step does, and where its parts live in this package:

1. :meth:`RunManager.open` checks that ``output_dir`` lies apart from every input and from other runs
   (:func:`.checks.check_apart`, before anything is created) and can be written (:mod:`.checks`), takes its lock
   for the whole run (:mod:`.lock`: one run per folder) and decides, without writing anything, whether this run
   starts, resumes (from a checkpoint of this stage whose files still hash as recorded), continues a finished run,
   finds it finished, or is refused (:func:`.plan.plan_run`, reading the folder through :class:`.folder.RunFolder`,
   which knows the files the run wrote from the ones it did not).
2. :meth:`RunManager.record` checks that a resumed checkpoint continues the same learning-rate schedule
   (:func:`llm2vec.schedule.check_resume`) and was trained with the same settings and inputs (:mod:`.inputs`:
   the compared fields of the run config, fingerprints of the data and model files, the batch geometry; a change
   accepted by ``accept_changed_inputs`` is recorded), and returns the run config that every save writes beside
   the model.
3. :meth:`RunManager.train` settles where training ends and checks the free disk space, and only then lets
   ``--overwrite_output_dir`` delete an old run (:func:`.plan.prepare`); it trains (fresh or resumed), and writes the
   final model with its completion marker last (:mod:`.saves`). Checkpoints are written complete-or-absent by the
   trainer through :func:`.saves.staged_checkpoint`.

The trainer (:mod:`llm2vec.trainer`) needs three things of this package, exported by its ``__init__``: the staged
checkpoint, the newest complete checkpoint (named when a run diverges) and the error of a checkpoint that cannot be
read back. The export claims its folder through :mod:`.claim` (the same lock and rules). Nothing here knows a
stage's model or loss.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..arguments import RunConfig
from . import inputs, lock
from .checks import check_apart, check_writable
from .folder import saved_run_config, step_of
from .plan import RunPlan, plan_run, prepare
from .saves import finalize_from_checkpoint, save_final

logger = logging.getLogger("llm2vec")


class RunManager:
    """What a run does with its ``output_dir`` (see the module docstring); made by :meth:`open`."""

    def __init__(self, config: RunConfig, plan: RunPlan):
        self.config = config
        self.plan = plan

    @classmethod
    @contextlib.contextmanager
    def open(cls, config: RunConfig) -> Iterator[RunManager]:
        """Check that ``output_dir`` can be written, hold its lock while the block runs, and plan the run in it.
        Raises :class:`llm2vec.arguments.ConfigError` when the run would replace one the user did not ask to
        replace, :class:`.lock.RunLocked` when another live run holds the folder."""
        args = config.training
        check_apart(args.output_dir, inputs.run_inputs(config))  # before anything is created
        check_writable(args.output_dir)
        with lock.hold(args.output_dir, is_main=args.process_index == 0):
            run = cls(config, plan_run(config))
            if run.finished:
                logger.info(run.plan.finished_message)
            yield run

    @property
    def finished(self) -> bool:
        """``output_dir`` holds this run finished, with the same training length: nothing to do."""
        return self.plan.finished

    def record(self, schedule, data_files: list[str]) -> dict[str, Any]:
        """The run config saved beside every checkpoint and the final model: the resolved config, the learning-rate
        ``schedule`` (:class:`llm2vec.schedule.SchedulePlan`), the ``inputs`` (fingerprints of ``data_files`` and of
        the model files), the ``batch_geometry`` and the resumes that accepted changed inputs. Raises
        :class:`llm2vec.arguments.ConfigError` when the resumed checkpoint had another schedule or other inputs."""
        from ..schedule import check_resume

        config, checkpoint = self.config, self.plan.resume_from
        check_resume(checkpoint, schedule, extending=self.plan.continue_past is not None)
        found, geometry = inputs.fingerprints(config, data_files), inputs.batch_geometry(config)
        resumed = inputs.check_resume_inputs(
            checkpoint,
            saved_run_config(checkpoint),
            found,
            geometry,
            config.stage.accept_changed_inputs,
            step_of(checkpoint) if checkpoint else 0,
            config.resolved(),
        )
        return {
            **config.resolved(),
            "lr_schedule": schedule.as_dict(),
            "inputs": found,
            "batch_geometry": geometry,
            "resumed_with_changes": resumed,
        }

    def train(self, trainer) -> None:
        """Settle the end step, the disk space and the overwrite (:func:`.plan.prepare`), then train as planned
        (fresh, or resumed from the planned checkpoint) and write the final model, its completion marker last. A
        resumed checkpoint at the end step becomes the final model without another training step."""
        plan = prepare(self.plan, self.config, trainer.model, len(trainer.train_dataset))
        if plan.finalize_only:
            finalize_from_checkpoint(trainer, plan.resume_from)
            return
        trainer.train(resume_from_checkpoint=plan.resume_from)
        save_final(trainer)
