"""What the Stage I and Stage II drivers share: config checks, model loading, data, the trainer set-up.

The drivers in ``experiments/`` are thin: they call :func:`run_stage_I` / ``run_stage_II`` with argv.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import torch
import transformers
from transformers import AutoTokenizer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from .arguments import ConfigError, DataArguments, ExperimentArguments, ModelArguments, parse_args, print_help, resolved_config
from .dataset import DataError, TrainDataset, load_e5, load_jsonl

logger = logging.getLogger("llm2vec")


def check_attention(model_args: ModelArguments, source: str) -> None:
    """flash_attention_2 needs the flash-attn package and a GPU: say how to get it or how to switch it off."""
    if model_args.attn_implementation != "flash_attention_2":
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            f"{source}: attn_implementation 'flash_attention_2' needs the flash-attn package: "
            "pip install -e '.[flash]' (CUDA GPUs only), or set \"attn_implementation\": \"sdpa\" "
            "(or pass --attn_implementation sdpa)")
    if not torch.cuda.is_available():
        raise ConfigError(f"{source}: attn_implementation 'flash_attention_2' needs a CUDA GPU; "
                          "pass --attn_implementation sdpa to run on CPU")


def check_batch_size(exp: ExperimentArguments, args: TrainingArguments, source: str) -> int:
    """The global batch (per device x processes x accumulation); must equal total_batch_size if the config states one."""
    world = args.world_size
    total = args.per_device_train_batch_size * world * args.gradient_accumulation_steps
    if exp.total_batch_size is not None and total != exp.total_batch_size:
        raise ConfigError(
            f"{source}: total_batch_size is {exp.total_batch_size} but per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x {world} process(es) x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} = {total}. Launch with the intended number of processes "
            "(torchrun --nproc_per_node=N) or change per_device_train_batch_size / gradient_accumulation_steps.")
    return total


def model_dtype(model_args: ModelArguments, args: TrainingArguments) -> torch.dtype:
    if model_args.torch_dtype == "auto":
        return torch.bfloat16 if args.bf16 else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[model_args.torch_dtype]


def load_tokenizer(model_args: ModelArguments):
    return AutoTokenizer.from_pretrained(model_args.model_name_or_path)


def load_training_data(data: DataArguments, global_batch_size: int, seed: int, require_negative: bool) -> TrainDataset:
    if data.dataset_name == "E5":
        return load_e5(data.dataset_file_path, global_batch_size=global_batch_size, seed=seed, sources=data.e5_sources,
                       max_per_source=data.max_examples_per_source, require_negative=require_negative)
    paths = [p for p in data.dataset_file_path.split(",") if p]
    return load_jsonl(paths, global_batch_size=global_batch_size, seed=seed,
                      default_instruction=data.default_instruction, require_negative=require_negative)


def setup_logging(args: TrainingArguments) -> None:
    level = logging.INFO if args.process_index == 0 else logging.WARNING
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(level)
    transformers.utils.logging.set_verbosity(logging.WARNING)


def resume_checkpoint(args: TrainingArguments) -> str | None:
    """``resume_from_checkpoint``: a folder, or ``true`` for the newest checkpoint in output_dir."""
    resume = args.resume_from_checkpoint
    if resume in (None, False, "false", "False"):
        return None
    if resume in (True, "true", "True"):
        last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
        if last is None:
            raise ConfigError(f"resume_from_checkpoint is true but {args.output_dir} holds no checkpoint-* folder")
        return last
    if not os.path.isdir(resume):
        raise ConfigError(f"resume_from_checkpoint: {resume} is not a folder")
    return resume


def parse_for_stage(stage: str, argv: list[str] | None):
    """Parse and validate a config for ``stage``; ``--help`` prints the fields and exits."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print_help(stage)
        raise SystemExit(0 if argv else 2)
    model_args, data_args, exp, args, config, source = parse_args(argv)
    if exp.stage != stage:
        raise ConfigError(f"{source}: this config is for stage {exp.stage!r} (field 'stage'); "
                          f"use experiments/run_stage_{exp.stage}.py")
    check_attention(model_args, source)
    global_batch = check_batch_size(exp, args, source)
    return model_args, data_args, exp, args, config, source, global_batch


def run_cli(main, argv: list[str] | None = None) -> None:
    """Run a stage's main(); configuration and data errors become one clear line and exit code 2."""
    try:
        main(argv)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run_stage_I(argv: list[str] | None = None):
    """Stage I: full-parameter bidirectional reconstruction training (EBQ2D + EBD2Q)."""
    from .collator import TrainCollator
    from .llm2vec_q2d_d2q import LLM2Vec_q2d_d2q
    from .trainer import LLM2VecTrainer

    model_args, data_args, exp, args, config, source, global_batch = parse_for_stage("I", argv)
    setup_logging(args)
    transformers.set_seed(args.seed)
    dataset = load_training_data(data_args, global_batch, args.seed, require_negative=False)
    logger.info("Stage I data (%d pairs, global batch %d):\n%s", len(dataset), global_batch, dataset.summary())

    tokenizer = load_tokenizer(model_args)
    causal_lm = LLM2Vec_q2d_d2q._load_model(model_args.model_name_or_path, dtype=model_dtype(model_args, args),
                                             attn_implementation=model_args.attn_implementation)
    model = LLM2Vec_q2d_d2q(causal_lm, tokenizer, alpha=exp.alpha, reconstruction_targets=exp.reconstruction_targets,
                            pooling_mode=model_args.pooling_mode, max_length=model_args.max_seq_length,
                            template=model_args.template)
    logger.info("Stage I: %s, template %s, alpha %.2f, targets %s", model_args.model_name_or_path,
                model.template.name, exp.alpha, exp.reconstruction_targets)
    collator = TrainCollator.for_encoder(model, reconstruction=exp.reconstruction_targets)
    run_config = resolved_config(model_args, data_args, exp, args) | {"config_file": source, "world_size": args.world_size}
    trainer = LLM2VecTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                             run_config=run_config)
    trainer.train(resume_from_checkpoint=resume_checkpoint(args))
    trainer.save_model(args.output_dir)
    trainer.save_state()  # trainer_state.json (the log history) beside the final model
    return trainer
