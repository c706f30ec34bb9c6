"""A parsed configuration of one stage (:class:`RunConfig`): its four argument objects, the rules that involve
several of them or the machine (:meth:`RunConfig.validate`), the precision policy, and the resolved record saved
beside each checkpoint (:meth:`RunConfig.resolved`)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..compat import TrainingArguments
from ..config_values import ConfigError
from ..dataset.records import DataError, check_path_kind
from ..devices import resolve_dtype
from ..io import missing_local_path
from .shared import DataArguments, ModelArguments
from .stages import StageIArguments, StageIIArguments

logger = logging.getLogger("llm2vec")


@dataclass
class RunConfig:
    """A parsed configuration of one stage; :meth:`validate` checks it against itself and the machine."""

    model: ModelArguments
    data: DataArguments
    stage: StageIArguments | StageIIArguments
    training: TrainingArguments
    source: str  # the config file, or "command line"

    @property
    def global_batch_size(self) -> int:
        args = self.training
        return args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: ``torch_dtype``; ``auto``: bfloat16 for bf16 training with ``master_weights`` bf16,
        else float32."""
        pure = self.training.bf16 and self.model.master_weights == "bf16"
        return resolve_dtype(
            ("bfloat16" if pure else "float32") if self.model.torch_dtype == "auto" else self.model.torch_dtype
        )

    def apply_precision_policy(self) -> None:
        """Check ``torch_dtype`` against ``master_weights``; with ``master_weights = bf16`` under FSDP switch the
        Trainer's mixed precision off, so that FSDP keeps weights, gradients and AdamW states bf16."""
        model, args = self.model, self.training
        wanted = "bfloat16" if model.master_weights == "bf16" else "float32"
        if args.bf16 and model.torch_dtype not in ("auto", wanted):
            raise ConfigError(
                f"{self.source}: torch_dtype {model.torch_dtype!r} contradicts master_weights {model.master_weights!r} "
                f"(bf16 training keeps {wanted} weights); drop torch_dtype or change master_weights"
            )
        if args.bf16 and model.master_weights == "bf16" and args.fsdp:
            args.mixed_precision = "no"
            logger.info(
                "master_weights bf16 under FSDP: the Trainer's mixed precision is off, so FSDP keeps bf16 weights"
            )

    def validate(self) -> None:
        """The rules that involve several argument classes or the machine, each a :class:`ConfigError` naming the
        config; a run that ends inside its warm-up is warned about."""
        model, data, stage, args, source = self.model, self.data, self.stage, self.training, self.source
        adapter = getattr(stage, "peft_model_name_or_path", None)  # a typo named by its field, before the model checks
        if adapter and (missing_local_path(adapter) or os.path.isfile(adapter)):
            raise ConfigError(
                f"{source}: peft_model_name_or_path {adapter!r} is not a folder: give the folder of a trained adapter "
                "(it holds adapter_config.json) or a hub id, or leave the field out"
            )
        try:  # a folder where a file belongs, or the reverse (a missing path is reported by the loader)
            for path in data.dataset_file_path.split(",") if data.dataset_name == "jsonl" else []:
                check_path_kind(path, "jsonl")
            if data.dataset_name == "E5" and data.dataset_file_path:
                check_path_kind(data.dataset_file_path, "E5")
            if data.validation_file:
                check_path_kind(data.validation_file, "jsonl", "validation_file")
        except DataError as e:
            raise ConfigError(f"{source}: {e}") from None
        if model.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                f"{source}: attn_implementation 'flash_attention_2' needs the flash-attn package: pip install -e "
                "'.[flash]' (CUDA GPUs only), or pass --attn_implementation sdpa"
            )
        if model.attn_implementation == "flash_attention_2" and not torch.cuda.is_available():
            raise ConfigError(
                f"{source}: attn_implementation 'flash_attention_2' needs a CUDA GPU; pass --attn_implementation sdpa to run on CPU"
            )
        if args.fsdp and args.activation_checkpointing and (args.fsdp_config or {}).get("activation_checkpointing"):
            raise ConfigError(
                f"{source}: activation checkpointing is asked for twice, by activation_checkpointing and by "
                "fsdp_config's \"activation_checkpointing\"; the Trainer accepts only one. Keep FSDP's own (it avoids "
                "a redundant all-gather): pass --activation_checkpointing false"
            )
        if stage.total_batch_size is not None and self.global_batch_size != stage.total_batch_size:
            raise ConfigError(
                f"{source}: total_batch_size is {stage.total_batch_size} but per_device_train_batch_size "
                f"{args.per_device_train_batch_size} x {args.world_size} process(es) x gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps} = {self.global_batch_size}. Launch with the intended number of "
                "processes (torchrun --nproc_per_node=N) or change per_device_train_batch_size / "
                "gradient_accumulation_steps."
            )
        if 0 < (budget := getattr(stage, "embedding_token_budget", 0)) < model.max_seq_length:
            raise ConfigError(
                f"{source}: embedding_token_budget {budget} is below max_seq_length {model.max_seq_length}: one text "
                f"alone could exceed it; give at least {model.max_seq_length} (or 0 for no gradient cache)"
            )
        if args.deepspeed and (
            chunked := [f for f in ("token_budget", "embedding_token_budget") if getattr(stage, f, 0)]
        ):
            raise ConfigError(
                f"{source}: {chunked[0]} {getattr(stage, chunked[0])} cannot run under DeepSpeed: the chunked step "
                "back-propagates each chunk outside DeepSpeed's engine (its gradients would be divided by the "
                "accumulation steps twice and the optimizer stepped on every chunk of the last micro-batch); pass "
                f"--{chunked[0]} 0, or train with FSDP (--fsdp true --fsdp_config train_configs/fsdp/fsdp2_full_shard.json)"
            )
        if getattr(stage, "stop_decoder_gradient", False) and args.fsdp:
            raise ConfigError(
                f"{source}: stop_decoder_gradient cannot run under FSDP (it calls the decoder with detached weights, "
                "which FSDP's sharded parameters do not allow); use DDP or drop the option"
            )
        evaluates = str(args.eval_strategy) not in ("no", "IntervalStrategy.NO")
        if evaluates and not (data.validation_file or data.validation_size or data.retrieval_eval_dirs):
            raise ConfigError(
                f"{source}: eval_strategy {args.eval_strategy.value!r} needs validation pairs: set validation_file or "
                "validation_size, or retrieval folders: retrieval_eval_dirs (or eval_strategy 'no')"
            )
        if data.retrieval_eval_dirs and not evaluates:
            raise ConfigError(
                f"{source}: retrieval_eval_dirs are scored at each evaluation, and eval_strategy 'no' never evaluates: "
                "set eval_strategy 'steps' (and eval_steps) or drop retrieval_eval_dirs"
            )
        out = os.path.realpath(args.output_dir)
        if stage.metrics_file and os.path.commonpath([out, os.path.realpath(stage.metrics_file)]) == out:
            raise ConfigError(
                f"{source}: metrics_file {stage.metrics_file} is inside output_dir {args.output_dir}; give a path outside it"
            )
        stage.check(args, source)
        self._warn_short_run()

    def _warn_short_run(self) -> None:
        """One warning when ``max_steps`` ends the run inside (or mostly inside) the linear warm-up: the rate then
        peaks at ``(max_steps - 1) / warmup`` of ``learning_rate`` (step ``s``, from 0, has ``s / warmup`` of it)."""
        args = self.training
        warmup = args.get_warmup_steps(args.max_steps) if args.max_steps > 0 else 0
        if warmup > 0 and 2 * warmup > args.max_steps:
            top = min(args.max_steps - 1, warmup) / warmup
            where = "the whole run is warm-up" if warmup >= args.max_steps else "warm-up takes most of the run"
            logger.warning(
                f"{self.source}: max_steps {args.max_steps} with warmup_steps {args.warmup_steps}: {where}, so the "
                f"learning rate reaches at most {100 * top:.0f} % of learning_rate {args.learning_rate:g}; lower "
                f"warmup_steps (e.g. --warmup_steps {args.max_steps // 10}) for a short run"
            )

    def resolved(self) -> dict[str, Any]:
        """Every field of every argument class, JSON-serialisable, to save beside each checkpoint."""
        out: dict[str, Any] = {}
        for obj in (self.model, self.data, self.stage, self.training):
            values = obj.to_dict() if isinstance(obj, TrainingArguments) else asdict(obj)
            out.update({k: v for k, v in values.items() if not k.startswith("_")})
        autocast = "off" if self.training.mixed_precision == "no" else self.training.mixed_precision
        out.update(
            config_file=self.source,
            world_size=self.training.world_size,
            precision={"weights": str(self.dtype).removeprefix("torch."), "autocast": autocast},
        )
        return json.loads(json.dumps(out, default=str))
