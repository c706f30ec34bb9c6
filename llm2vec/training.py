"""One training run of either stage: parse and check the config, load the data, build the model, train, save.

    torchrun --nproc_per_node=8 run_stage_I.py stage_I_config.json

The two drivers (``run_stage_I.py``, ``run_stage_II.py``) call :func:`main` with their stage. Both stages run the same sequence;
what differs is the argument class (:mod:`llm2vec.arguments`) and the model class, whose ``build``
turns a run config into the model to train:

- Stage I: :class:`llm2vec.llm2vec_q2d_d2q.LLM2Vec_q2d_d2q` (full causal LM, reconstruction loss);
- Stage II: :class:`llm2vec.llm2vec_contrastive.LLM2VecContrastive` (LoRA, InfoNCE).
"""

from __future__ import annotations

import logging
import sys

import torch
import transformers

from . import checkpoints
from .arguments import ConfigError, DataArguments, RunConfig, help_text, parse_config
from .dataset import DataError, TrainDataset, load_e5, load_jsonl
from .schedule import StopAfterNSteps, check_resume, plan_schedule

logger = logging.getLogger("llm2vec")


def model_class(stage: str):
    """The model class trained by ``stage``."""
    if stage == "I":
        from .llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

        return LLM2Vec_q2d_d2q
    from .llm2vec_contrastive import LLM2VecContrastive

    return LLM2VecContrastive


def load_training_data(data: DataArguments, global_batch_size: int, seed: int, require_negative: bool) -> TrainDataset:
    if not data.dataset_file_path:
        what = "the folder of the E5 <source>.jsonl files" if data.dataset_name == "E5" else "your .jsonl file(s)"
        raise DataError(f"dataset_file_path is not set: give {what} in the config or as --dataset_file_path")
    if data.dataset_name == "E5":
        return load_e5(
            data.dataset_file_path,
            global_batch_size=global_batch_size,
            seed=seed,
            sources=data.e5_sources,
            max_per_source=data.max_examples_per_source,
            require_negative=require_negative,
        )
    paths = [p for p in data.dataset_file_path.split(",") if p]
    return load_jsonl(
        paths,
        global_batch_size=global_batch_size,
        seed=seed,
        default_instruction=data.default_instruction,
        require_negative=require_negative,
    )


def setup_logging(args: transformers.TrainingArguments) -> None:
    level = logging.INFO if args.process_index == 0 else logging.WARNING
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(level)
    transformers.utils.logging.set_verbosity(logging.WARNING)


def train(config: RunConfig):
    """Train one stage as ``config`` says; returns the trainer (its model is the trained model), or ``None`` when
    ``output_dir`` holds this run finished already (see :mod:`llm2vec.checkpoints`)."""
    from .collator import TrainCollator
    from .trainer import LLM2VecTrainer

    args, stage = config.training, config.stage.stage
    setup_logging(args)
    config.validate()
    plan = checkpoints.plan_run(config)  # refuses to replace a run in output_dir; a finished one: nothing to do
    if plan.finished:
        logger.info(plan.finished_message)
        return None
    checkpoints.startup_checks(config)  # output_dir writable, the model's config, tokenizer and template
    if config.stage.num_threads:
        torch.set_num_threads(config.stage.num_threads)
    logger.info("Stage %s: %d CPU thread(s), seed %d", stage, torch.get_num_threads(), args.seed)
    transformers.set_seed(args.seed)
    dataset = load_training_data(config.data, config.global_batch_size, args.seed, config.stage.require_negative)
    logger.info(
        "Stage %s data (%d examples, global batch %d):\n%s",
        stage,
        len(dataset),
        config.global_batch_size,
        dataset.summary(),
    )
    schedule = plan_schedule(args, dataset.num_global_batches, config.stage.stop_after_n_steps, config.source)
    check_resume(plan.resume_from, schedule, extending=plan.continue_past is not None)
    logger.info("Stage %s %s", stage, schedule.describe())
    model = model_class(stage).build(config.model, config.stage, config.dtype)
    logger.info("Stage %s: %s, %s", stage, config.model.model_name_or_path, model.describe())
    checkpoints.prepare(plan, config, model, len(dataset))  # where training ends, free disk space, overwrite
    collator = TrainCollator.for_encoder(model, **config.stage.collator_options(), **config.data.collator_options())
    trainer = LLM2VecTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=collator,
        run_config={**config.resolved(), "lr_schedule": schedule.as_dict()},
        callbacks=[StopAfterNSteps(schedule)],
    )
    checkpoints.train_and_save(trainer, plan)  # the final model, its completion marker last
    return trainer


def run(stage: str, argv: list[str]):
    """Parse ``argv`` as a config of ``stage`` and train; returns the trainer."""
    return train(parse_config(stage, argv))


def main(stage: str, argv: list[str] | None = None) -> int:
    """The command line of a stage's driver: ``--help``; bad configuration or data is one line and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text(stage))
        return 0 if argv else 2
    try:
        run(stage, argv)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
