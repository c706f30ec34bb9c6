"""The owner of a run's ``output_dir``: one object from before the folder is inspected until the run ends.

A training run calls it three times, in this order::

    with RunManager.open(config) as run:       # writable, locked, inspected, the plan decided
        if run.finished:                        # the same run finished already: nothing to do
            return None
        ...                                     # the model family, the data, the learning-rate schedule
        run_config = run.record(schedule, data_files)   # refuses a resume whose schedule or inputs changed
        ...                                     # the model, the collator, the trainer (saving run_config)
        run.train(trainer)                      # end step, disk space, overwrite; train; final model, marker last

``open`` checks that ``output_dir`` lies apart from every input and other runs and can be written (:mod:`.checks`),
holds its lock for the whole run (:mod:`.lock`) and decides, writing nothing, whether the run starts, resumes,
continues a finished run, finds it finished or is refused (:mod:`.plan`, reading the folder through :mod:`.folder`).
``record`` refuses a resume whose schedule, settings or inputs changed (:mod:`.inputs`) and returns the run config
every save writes beside the model. ``train`` settles the end step, the disk space and the overwrite, trains, and
writes the final model with its completion marker last (:mod:`.saves`). Nothing here knows a stage's model or loss.
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
        """Check ``output_dir``, hold its lock while the block runs, and plan the run in it; raises
        :class:`~llm2vec.arguments.ConfigError` or :class:`.lock.RunLocked`."""
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
        """``output_dir`` holds this run finished with the same training length: nothing to do."""
        return self.plan.finished

    def record(self, schedule, data_files: list[str]) -> dict[str, Any]:
        """The run config saved beside every checkpoint and the final model: the resolved config, the learning-rate
        ``schedule``, the ``inputs`` (fingerprints of ``data_files`` and the model files), the ``batch_geometry`` and
        the resumes that accepted changed inputs; raises :class:`~llm2vec.arguments.ConfigError` when a resumed
        checkpoint had another schedule or other inputs."""
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
        """Settle the end step, disk space and overwrite (:func:`.plan.prepare`), train as planned and write the final
        model, its completion marker last; a resumed checkpoint at the end step becomes the final model."""
        plan = prepare(self.plan, self.config, trainer.model, len(trainer.train_dataset))
        if plan.finalize_only:
            finalize_from_checkpoint(trainer, plan.resume_from)
            return
        trainer.train(resume_from_checkpoint=plan.resume_from)
        save_final(trainer)
