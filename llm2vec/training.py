"""One training run of either stage: parse and check the config, load the data, build the model, train, save."""

from __future__ import annotations

import errno
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from transformers import TrainerCallback

from .arguments import ConfigError, DataArguments, RunConfig, flag_groups, help_text, parse_config
from .dataset import DataError, TrainDataset, load_e5, load_hf, load_jsonl
from .distributed import release_process_group_at_exit
from .fingerprints import model_folder
from .llm2vec import PackingRefused
from .metrics_file import MetricsFile
from .model_files import ModelFilesError, adapter_problem, check_model_files
from .run import RunLocked, RunManager, newest_checkpoint
from .schedule import SchedulePlan, plan_schedule

logger = logging.getLogger("llm2vec")


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the run; the message says at which step and how to continue."""


def interrupted_message(config: RunConfig, trainer) -> str:
    """What a run stopped by Ctrl-C tells: the step, what is kept (complete checkpoints only) and how to continue."""
    out, stage = config.training.output_dir, config.stage.stage
    step = trainer.state.global_step if trainer is not None else 0
    where = f"Stage {stage} run in {out} stopped by Ctrl-C" + (f" at step {step}" if step else " before training")
    if getattr(config.stage, "trainer", "llm2vec") == "sentence_transformers":
        from .st_training import NO_RESUME

        return f"{where}; {NO_RESUME}"
    newest = newest_checkpoint(out)
    if newest is None:
        return f"{where}; no checkpoint had been saved, so nothing is kept to continue from: run the same command again"
    return (
        f"{where}; its complete checkpoints are kept (newest: {newest}), nothing half-written counts. Continue with the "
        "same command and --resume_from_checkpoint true"
    )


def train(config: RunConfig):
    """Train one stage as ``config`` says: the trainer, or ``None`` if done; Ctrl-C is :class:`RunInterrupted`."""
    setup_logging(config.training)
    config.validate()
    check_model_inputs(config)
    made = []  # the trainer, once it exists: the interruption message reads its step
    try:
        return _train(config, made)
    except KeyboardInterrupt:
        raise RunInterrupted(interrupted_message(config, made[0] if made else None)) from None


def check_model_inputs(config: RunConfig, resume_from: str | None = None) -> None:
    """The model and adapter (or an adapter checkpoint ``resume_from``) checked before anything reads them."""
    trust = config.model.trust_remote_code
    if resume_from is None:
        adapter, other_base = (
            getattr(config.stage, name, None) for name in ("peft_model_name_or_path", "accept_other_base")
        )
        try:
            check_model_files(config.model.model_name_or_path, adapter, trust, bool(other_base))
        except ModelFilesError as e:
            raise ConfigError(f"{config.source}: {e}") from None
    elif (Path(resume_from) / "adapter_model.safetensors").is_file():
        base = model_folder(config.model.model_name_or_path)
        if base is not None and (problem := adapter_problem(Path(resume_from), base, trust)):
            raise ConfigError(f"resume_from_checkpoint {resume_from}: {problem}")


def run_callbacks(config: RunConfig) -> list:
    """The callbacks of ``stop_after_minutes`` and ``metrics_file``; the wall clock counts from here."""
    callbacks = []
    if config.stage.stop_after_minutes is not None:
        callbacks.append(StopAtTimeBudget(config.stage.stop_after_minutes))
    if config.stage.metrics_file is not None:
        callbacks.append(MetricsFile(config.stage.metrics_file))
    return callbacks


class StopAfterNSteps(TrainerCallback):
    """Stops training at the plan's stop step before the schedule's end (a checkpoint there when saving by steps)."""

    def __init__(self, plan: SchedulePlan):
        self.plan = plan

    def on_step_end(self, args, state, control, **kwargs):
        if self.plan.stop_step < self.plan.horizon_steps and state.global_step >= self.plan.stop_step:
            control.should_training_stop = True
            control.should_save = control.should_save or args.save_strategy == "steps"
        return control


class StopAtTimeBudget(TrainerCallback):
    """Stops training (evaluated, saved, logged: ``stopped_by``) at the first step ``minutes`` after ``start``."""

    def __init__(self, minutes: float, start: float | None = None):
        self.seconds, self.start = 60.0 * minutes, time.monotonic() if start is None else start
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        used = time.monotonic() - self.start
        if self.stopped_at is not None or used < self.seconds or state.global_step >= state.max_steps:
            return control
        self.stopped_at, minutes = state.global_step, round(used / 60.0, 3)
        control.should_training_stop = True
        control.should_evaluate = str(args.eval_strategy) not in ("no", "IntervalStrategy.NO")
        control.should_save = control.should_save or args.save_strategy == "steps"
        state.log_history.append({"step": state.global_step, "stopped_by": "stop_after_minutes", "minutes": minutes})
        logger.info(f"stopping at step {state.global_step} of {state.max_steps}: {minutes:.2f} minutes used")
        return control


def _train(config: RunConfig, made: list):
    args, stage = config.training, config.stage.stage
    with_st = getattr(config.stage, "trainer", "llm2vec") == "sentence_transformers"
    if with_st:
        from .st_training import check_config

        if done := check_config(config):  # what that path does not do, before the folder is touched
            logger.info(done)
            return None
    callbacks = run_callbacks(config)  # the budget covers loading the data and the model
    with RunManager.open(config) as run:  # output_dir locked and inspected: start, resume, refuse or nothing to do
        if run.finished:
            return None
        check_model_inputs(config, run.resume_from)
        tokenizer, template, hidden_size = check_model_family(config)  # before the data and the weights load
        if config.stage.num_threads:
            torch.set_num_threads(config.stage.num_threads)
        logger.info("Stage %s: %d CPU thread(s), seed %d", stage, torch.get_num_threads(), args.seed)
        transformers.set_seed(args.seed)
        dataset, validation = load_data(config, tokenizer, template)
        # the retrieval folders read and checked before the weights load
        retrieval = retrieval_evaluation(config.data, hidden_size)
        schedule = plan_schedule(args, dataset.num_global_batches, config.stage.stop_after_n_steps, config.source)
        # refuses a resume whose schedule, inputs or retrieval folders changed
        run_config = run.record(schedule, _data_files(dataset), retrieval)
        run_config["inputs"]["query_instructions"] = trained_instructions(config, dataset)  # what the export writes
        logger.info("Stage %s %s", stage, schedule.describe())
        callbacks = [StopAfterNSteps(schedule), *callbacks]  # the trainer stops where the plan says
        if with_st:
            from .st_training import build_trainer

            trainer = build_trainer(config, dataset, run_config, callbacks, tokenizer, template, retrieval)
        else:
            trainer = _project_trainer(config, dataset, validation, retrieval, run_config, callbacks)
        made.append(trainer)
        run.train(trainer)  # where training ends, disk space, overwrite; train; the final model, its marker last
        logger.info("Stage %s: the model is saved in %s", stage, os.path.abspath(args.output_dir))
        return trainer


def _project_trainer(config: RunConfig, dataset, validation, retrieval, run_config, callbacks):
    """This project's trainer (``trainer: llm2vec``, the paper's path) of a run."""
    from .collator import TrainCollator
    from .trainer import LLM2VecTrainer

    model = build_model(config)
    logger.info("Stage %s: %s, %s", config.stage.stage, config.model.model_name_or_path, model.describe())
    return LLM2VecTrainer(
        model=model,
        args=config.training,
        train_dataset=dataset,
        eval_dataset=validation or ([] if retrieval else None),  # the Trainer evaluates only with a dataset
        data_collator=TrainCollator.for_encoder(model, **collator_options(config)),
        run_config=run_config,
        retrieval_evaluation=retrieval,
        callbacks=callbacks,
    )


def setup_logging(args: transformers.TrainingArguments) -> None:
    level = logging.INFO if args.process_index == 0 else logging.WARNING
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(level)
    transformers.utils.logging.set_verbosity(logging.WARNING)


# ---------------------------------------------------------------------------------------------- the model


def model_class(stage: str):
    """The model class trained by ``stage``."""
    if stage == "I":
        from .llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

        return LLM2Vec_q2d_d2q
    from .llm2vec_contrastive import LLM2VecContrastive

    return LLM2VecContrastive


def check_model_family(config: RunConfig):
    """The model's tokenizer, prompt template and hidden size, before data or weights load, or :class:`ConfigError`."""
    from transformers import AutoConfig, AutoTokenizer

    from .llm2vec import read_llm2vec_config
    from .templates import resolve_template

    path, template = config.model.model_name_or_path, config.model.template
    adapter = getattr(config.stage, "peft_model_name_or_path", None)
    where = f"{config.source}: " if config.source else ""
    try:
        remote = bool(getattr(config.model, "trust_remote_code", False))
        model_config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{where}model_name_or_path {path!r}: cannot read its config and tokenizer ({first}); "
            "give a model folder or a hub id that is available"
        ) from None
    if template is None:
        template = read_llm2vec_config(adapter).get("template") or read_llm2vec_config(path).get("template")
    try:
        spec = resolve_template(model_config, tokenizer, template)
    except ValueError as e:
        raise ConfigError(f"{where}model {path}: {e}") from None
    return tokenizer, spec, getattr(model_config, "hidden_size", None)


def build_model(config: RunConfig):
    """The model to train; a model folder or adapter that cannot be loaded is one :class:`ConfigError`."""
    from .trainer import first_line

    stage, model_args = config.stage.stage, config.model
    adapter = getattr(config.stage, "peft_model_name_or_path", None)
    try:
        return model_class(stage).build(model_args, config.stage, config.dtype)
    except (PackingRefused, ConfigError) as e:
        raise ConfigError(f"{config.source or 'the config'}: {e}") from None
    except torch.OutOfMemoryError:
        raise
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        what = f"model {model_args.model_name_or_path}" + (f" with adapter {adapter}" if adapter else "")
        raise ConfigError(
            f"{config.source}: cannot load the {what}: {first_line(e)}. Check that the folder is complete (no "
            "truncated weights file)" + (" and that the adapter was trained on this base model" if adapter else "")
        ) from e


# ---------------------------------------------------------------------------------------------- the data


def collator_options(config: RunConfig) -> dict:
    return {**config.stage.collator_options(), **config.data.collator_options()}


def load_data(config: RunConfig, tokenizer, template) -> tuple[TrainDataset, list]:
    """The training data and the validation pairs, logged, one example of each instruction through the collator."""
    from .collator import TrainCollator, check_examples
    from .templates import pad_token

    args, stage = config.training, config.stage.stage
    dataset = load_training_data(config.data, config.global_batch_size, args.seed, config.stage.require_negative)
    logger.info(
        f"Stage {stage} data ({len(dataset)} examples, global batch {config.global_batch_size}):\n{dataset.summary()}"
    )
    validation = validation_pairs(config.data, dataset)
    if validation:
        logger.info(
            "Stage %s validation: %d held-out pairs, evaluated every %s steps", stage, len(validation), args.eval_steps
        )
    pad = tokenizer.convert_tokens_to_ids(pad_token(tokenizer, template))
    check_examples(
        TrainCollator(tokenizer, template, config.model.max_seq_length, pad, **collator_options(config)),
        dataset.instruction_examples() + validation,
    )
    return dataset, validation


def retrieval_evaluation(data: DataArguments, hidden_size: int | None = None):
    """The ``retrieval_eval_dirs`` read, checked (:class:`DataError`) and their cost logged; ``None`` without any."""
    folders = data.retrieval_folders()
    if not folders:
        return None
    from .retrieval import RetrievalEvaluation

    try:
        evaluation = RetrievalEvaluation.read(folders)
    except (OSError, ValueError) as e:
        raise DataError(f"retrieval_eval_dirs: {e}") from None
    for line in evaluation.describe(hidden_size):
        logger.info("retrieval evaluation at every eval_steps: %s", line)
    return evaluation


def load_training_data(data: DataArguments, global_batch_size: int, seed: int, require_negative: bool) -> TrainDataset:
    """The training data; with ``validation_size`` its ``held_out`` slice holds the validation pairs."""
    if not data.dataset_file_path:
        what = {
            "E5": "the folder of the E5 <source>.jsonl files",
            "jsonl": "your .jsonl file(s)",
            "hf": "your dataset(s): save_to_disk folders, data files or cached dataset ids",
        }[data.dataset_name]
        raise DataError(f"dataset_file_path is not set: give {what} in the config or as --dataset_file_path")
    common = {"global_batch_size": global_batch_size, "seed": seed, "require_negative": require_negative}
    common["validation_size"] = data.validation_size
    if data.dataset_name == "E5":
        return load_e5(
            data.dataset_file_path, sources=data.e5_sources, max_per_source=data.max_examples_per_source, **common
        )
    if data.dataset_name == "hf":
        return load_hf(
            data.dataset_file_path,
            column_map=data.column_map,
            split=data.dataset_split,
            default_instruction=data.default_instruction,
            max_per_source=data.max_examples_per_source,
            **common,
        )
    paths = [p for p in data.dataset_file_path.split(",") if p]
    return load_jsonl(paths, default_instruction=data.default_instruction, **common)


def trained_instructions(config: RunConfig, dataset: TrainDataset) -> list[str]:
    """The distinct instructions the run's queries train with (``""``: none), in training order."""
    return [e.query_instruction for e in dataset.instruction_examples()] if config.data.query_instructions else [""]


def validation_pairs(data: DataArguments, dataset: TrainDataset) -> list:
    """The held-out pairs: ``validation_file`` (in one order whatever the seed) or ``validation_size``'s slice."""
    if not data.validation_file:
        return dataset.held_out
    file = load_jsonl([data.validation_file], global_batch_size=1, seed=0, default_instruction=data.default_instruction)
    return file.examples  # negatives optional: Stage II's validation loss uses those the file has


def _data_files(dataset: TrainDataset) -> list[str]:
    return [path for stats in dataset.sources.values() for path in stats.files]


# ---------------------------------------------------------------------------------------------- the command line


def run(stage: str, argv: list[str]):
    """Parse ``argv`` as a config of ``stage`` and train; returns the trainer."""
    return train(parse_config(stage, argv))


def _debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without the driver's ``--debug`` (alone or true/false/1/0), and whether it asks for tracebacks."""
    debug = os.environ.get("LLM2VEC_DEBUG", "").lower() in ("1", "true")
    head, rest = (argv[:1], argv[1:]) if argv and not argv[0].startswith("--") else ([], argv)
    try:
        groups = flag_groups(rest)
    except ConfigError:  # a stray value: parse_config reports it
        return argv, debug
    out = list(head)
    for name, values in groups:
        if name == "debug" and len(values) <= 1 and all(v.lower() in ("true", "false", "1", "0") for v in values):
            debug = not values or values[0].lower() in ("true", "1")
        else:
            out += [f"--{name}", *values]
    return out, debug


def user_error(error: BaseException) -> tuple[str, int] | None:
    """The message and exit code of an error whose cause is the user's; ``None`` for a bug (a traceback)."""
    from .trainer import TrainingDiverged

    if isinstance(error, (ConfigError, DataError, RunLocked)):
        return str(error), 2
    if isinstance(error, TrainingDiverged):
        return str(error), 3
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        where = error.filename or "the output folder"
        return (
            f"{where}: no space left on device while writing. Free some space, then continue the run with "
            "--resume_from_checkpoint true (its complete checkpoints are kept)",
            1,
        )
    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{error.filename or 'a file'}: {error.strerror}; check the permissions of the folder", 1
    return None


def _save_traceback(error: BaseException) -> str | None:
    try:
        fd, path = tempfile.mkstemp(prefix="llm2vec-error-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            traceback.print_exception(error, file=f)
        return path
    except OSError:
        return None


def main(stage: str, argv: list[str] | None = None) -> int:
    """A stage's driver: ``--help``; a user's error is one line on stderr (exit 2: config, data or folder; 3: the run
    diverged; 1: disk or permissions), a library's traceback saved to a file it names (``--debug`` raises instead);
    Ctrl-C one ``interrupted:`` line, exit 130."""
    argv = sys.argv[1:] if argv is None else argv
    argv, debug = _debug_flag(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text(stage))
        return 0 if argv else 2
    try:
        run(stage, argv)
        release_process_group_at_exit()  # several runs may share the process (and its group) until it exits
    except KeyboardInterrupt as e:  # Ctrl-C: one line, and the exit status of a process stopped by SIGINT
        if debug:
            raise
        print(f"interrupted: {e if isinstance(e, RunInterrupted) else 'stopped by Ctrl-C'}", file=sys.stderr)
        return 130
    except Exception as e:
        known = user_error(e)
        if known is None or debug:
            raise
        message, code = known
        if (e.__cause__ is not None or isinstance(e, OSError)) and (trace := _save_traceback(e)):
            message += f" (traceback: {trace}; --debug shows it)"
        print(f"error: {message}", file=sys.stderr)
        return code
    return 0
