"""Stage II driver: LoRA contrastive fine-tuning (InfoNCE with in-batch and hard negatives).

    torchrun --nproc_per_node=8 experiments/run_stage_II.py train_configs/stage_II/MetaLlama3.2_1b_stage1_2000steps_stage2.json

The base is loaded with ``AutoModel`` (the decoder body): a hub id (the baseline, Stage II only) or a
Stage I output folder, which holds a full causal LM whose LM head ``AutoModel`` leaves out. An optional
``peft_model_name_or_path`` adapter is merged into it first. LoRA adapters are then added and only they
are trained. Checkpoints and the final output hold the adapter (``adapter_model.safetensors``), the
tokenizer, ``llm2vec_config.json`` and ``run_config.json``; load them with
``LLM2Vec.from_pretrained(base, peft_model_name_or_path=output_dir)``.
"""

from __future__ import annotations

import logging

import transformers
from transformers import AutoModel

from .arguments import ExperimentArguments, ModelArguments
from .llm2vec import read_llm2vec_config
from .training import (
    load_tokenizer,
    load_training_data,
    model_dtype,
    parse_for_stage,
    resume_checkpoint,
    resolved_config,
    run_cli,
    setup_logging,
)

logger = logging.getLogger("llm2vec")

__all__ = ["run_stage_II", "load_lora_model", "warn_accumulation", "run_cli"]


def warn_accumulation(per_device: int, processes: int, accumulation: int) -> None:
    """Gradient accumulation splits the contrastive batch: negatives come from one micro-batch only."""
    if accumulation <= 1:
        return
    micro = per_device * processes
    logger.warning(
        "gradient_accumulation_steps = %d: each optimizer step covers %d examples, but InfoNCE only sees the "
        "%d examples of one micro-batch (per_device_train_batch_size %d x %d process(es)), so each query has "
        "%d in-batch positives of other queries (plus hard negatives) as negatives instead of %d. "
        "Raise per_device_train_batch_size or the number of processes to keep the whole batch in one step.",
        accumulation, micro * accumulation, micro, per_device, processes, micro - 1, micro * accumulation - 1)


def load_lora_model(model_args: ModelArguments, exp: ExperimentArguments, dtype):
    """The decoder body (+ merged ``peft_model_name_or_path``) with fresh, trainable LoRA adapters."""
    from peft import LoraConfig, PeftModel, TaskType, get_peft_model

    body = AutoModel.from_pretrained(model_args.model_name_or_path, dtype=dtype,
                                     attn_implementation=model_args.attn_implementation)
    if model_args.peft_model_name_or_path:
        body = PeftModel.from_pretrained(body, model_args.peft_model_name_or_path).merge_and_unload()
        logger.info("merged adapter %s into the base", model_args.peft_model_name_or_path)
    lora = LoraConfig(r=exp.lora_r, lora_alpha=exp.lora_alpha, lora_dropout=exp.lora_dropout,
                      target_modules=list(exp.lora_target_modules), bias="none", task_type=TaskType.FEATURE_EXTRACTION)
    return get_peft_model(body, lora)


def run_stage_II(argv: list[str] | None = None):
    """Stage II: LoRA contrastive fine-tuning; returns the trainer."""
    from .collator import TrainCollator
    from .llm2vec_contrastive import LLM2VecContrastive
    from .trainer import LLM2VecTrainer

    model_args, data_args, exp, args, config, source, global_batch = parse_for_stage("II", argv)
    setup_logging(args)
    warn_accumulation(args.per_device_train_batch_size, args.world_size, args.gradient_accumulation_steps)
    transformers.set_seed(args.seed)
    dataset = load_training_data(data_args, global_batch, args.seed, require_negative=exp.require_negative)
    logger.info("Stage II data (%d examples, global batch %d):\n%s", len(dataset), global_batch, dataset.summary())

    tokenizer = load_tokenizer(model_args)
    peft_model = load_lora_model(model_args, exp, model_dtype(model_args, args))
    template = model_args.template or read_llm2vec_config(model_args.model_name_or_path).get("template")
    model = LLM2VecContrastive(peft_model, tokenizer, loss_scale=exp.loss_scale, pooling_mode=model_args.pooling_mode,
                               max_length=model_args.max_seq_length, template=template)
    trainable, total = peft_model.get_nb_trainable_parameters()
    logger.info("Stage II: %s, template %s, LoRA r %d / alpha %d / dropout %.2f on %s; loss scale %.1f (tau %.3f)",
                model_args.model_name_or_path, model.template.name, exp.lora_r, exp.lora_alpha, exp.lora_dropout,
                ",".join(exp.lora_target_modules), exp.loss_scale, 1.0 / exp.loss_scale)
    logger.info("trainable parameters: %d of %d (%.4f%%)", trainable, total, 100.0 * trainable / total)

    collator = TrainCollator.for_encoder(model, with_negative=exp.require_negative)
    run_config = resolved_config(model_args, data_args, exp, args) | {"config_file": source, "world_size": args.world_size}
    trainer = LLM2VecTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, run_config=run_config)
    trainer.train(resume_from_checkpoint=resume_checkpoint(args))
    trainer.save_model(args.output_dir)
    trainer.save_state()  # trainer_state.json (the log history) beside the final model
    return trainer
