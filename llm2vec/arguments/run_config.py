"""A parsed configuration of one stage (:class:`RunConfig`): its four argument objects, the checks that involve
several of them or the machine (:meth:`RunConfig.validate`), the precision policy, and the resolved record saved
beside each checkpoint (:meth:`RunConfig.resolved`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..compat import TrainingArguments
from ..dataset.records import DataError, check_path_kind
from ..devices import resolve_dtype
from ..io import missing_local_path
from .shared import ConfigError, DataArguments, ModelArguments
from .stages import StageIArguments, StageIIArguments

logger = logging.getLogger("llm2vec")


@dataclass
class RunConfig:
    """A parsed and validated configuration of one stage."""

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
        """The weights' dtype: with bf16 training, bfloat16 or float32 as ``master_weights`` says; else
        ``torch_dtype`` (``auto``: float32)."""
        name = self.model.torch_dtype
        if name == "auto":
            name = (
                ("bfloat16" if self.model.master_weights == "bf16" else "float32") if self.training.bf16 else "float32"
            )
        return resolve_dtype(name)

    @property
    def autocast(self) -> str:
        """What the Trainer's mixed precision does: ``bf16`` autocast, or ``off``."""
        return "off" if self.training.mixed_precision == "no" else self.training.mixed_precision

    def apply_precision_policy(self) -> None:
        """Check ``torch_dtype`` against ``master_weights``; with ``master_weights = bf16`` switch the Trainer's mixed
        precision off, so that FSDP keeps weights, gradients and AdamW states bf16.
        """
        model, args = self.model, self.training
        if not args.bf16:
            return
        wanted = "bfloat16" if model.master_weights == "bf16" else "float32"
        if model.torch_dtype not in ("auto", wanted):
            raise ConfigError(
                f"{self.source}: torch_dtype {model.torch_dtype!r} contradicts master_weights "
                f"{model.master_weights!r} (bf16 training keeps {wanted} weights); drop torch_dtype or "
                "change master_weights"
            )
        if model.master_weights == "bf16" and args.fsdp:
            args.mixed_precision = "no"
            logger.info(
                "master_weights bf16 under FSDP: the Trainer's mixed precision is off, so FSDP keeps the "
                "bf16 weights (it would otherwise upcast them to float32 master weights)"
            )

    def validate(self) -> None:
        """The checks that involve several argument classes or the machine; raises :class:`ConfigError`."""
        self._check_adapter_path()  # a typo named by its field, before the driver checks the model files
        try:  # a folder where a file belongs, or the reverse (a missing path is reported by the loader)
            for path in self.data.dataset_file_path.split(",") if self.data.dataset_name == "jsonl" else []:
                check_path_kind(path, "jsonl")
            if self.data.dataset_name == "E5" and self.data.dataset_file_path:
                check_path_kind(self.data.dataset_file_path, "E5")
            if self.data.validation_file:
                check_path_kind(self.data.validation_file, "jsonl", "validation_file")
        except DataError as e:
            raise ConfigError(f"{self.source}: {e}") from None
        if self.model.attn_implementation == "flash_attention_2":
            if importlib.util.find_spec("flash_attn") is None:
                raise ConfigError(
                    f"{self.source}: attn_implementation 'flash_attention_2' needs the flash-attn package: "
                    'pip install -e \'.[flash]\' (CUDA GPUs only), or set "attn_implementation": "sdpa" '
                    "(or pass --attn_implementation sdpa)"
                )
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"{self.source}: attn_implementation 'flash_attention_2' needs a CUDA GPU; "
                    "pass --attn_implementation sdpa to run on CPU"
                )
        expected, args = self.stage.total_batch_size, self.training
        if args.fsdp and args.activation_checkpointing and (args.fsdp_config or {}).get("activation_checkpointing"):
            raise ConfigError(
                f"{self.source}: activation checkpointing is asked for twice, by activation_checkpointing and by "
                "fsdp_config's \"activation_checkpointing\"; the Trainer accepts only one. Keep FSDP's own (it "
                "avoids a redundant all-gather): pass --activation_checkpointing false"
            )
        if expected is not None and self.global_batch_size != expected:
            raise ConfigError(
                f"{self.source}: total_batch_size is {expected} but per_device_train_batch_size "
                f"{args.per_device_train_batch_size} x {args.world_size} process(es) x gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps} = {self.global_batch_size}. Launch with the intended number of "
                "processes (torchrun --nproc_per_node=N) or change per_device_train_batch_size / "
                "gradient_accumulation_steps."
            )
        budget = getattr(self.stage, "embedding_token_budget", 0)  # Stage II's gradient cache
        if 0 < budget < self.model.max_seq_length:
            raise ConfigError(
                f"{self.source}: embedding_token_budget {budget} is below max_seq_length "
                f"{self.model.max_seq_length}: one text alone could exceed it; give at least "
                f"{self.model.max_seq_length} (or 0 for no gradient cache)"
            )
        chunked = [f for f in ("token_budget", "embedding_token_budget") if getattr(self.stage, f, 0)]
        if args.deepspeed and chunked:
            field_name = chunked[0]
            raise ConfigError(
                f"{self.source}: {field_name} {getattr(self.stage, field_name)} cannot run under DeepSpeed: the chunked "
                "step back-propagates each chunk outside DeepSpeed's engine (its gradients would be divided by the "
                "accumulation steps twice and the optimizer stepped on every chunk of the last micro-batch); pass "
                f"--{field_name} 0, or train with FSDP (--fsdp true --fsdp_config train_configs/fsdp/fsdp2_full_shard.json)"
            )
        if getattr(self.stage, "stop_decoder_gradient", False) and args.fsdp:
            raise ConfigError(
                f"{self.source}: stop_decoder_gradient cannot run under FSDP (it calls the decoder with detached "
                "weights, which FSDP's sharded parameters do not allow); use DDP or drop the option"
            )
        evaluates = str(args.eval_strategy) not in ("no", "IntervalStrategy.NO")
        if evaluates and not (self.data.validation_file or self.data.validation_size or self.data.retrieval_eval_dirs):
            raise ConfigError(
                f"{self.source}: eval_strategy {args.eval_strategy.value!r} needs validation pairs: set "
                "validation_file or validation_size, or retrieval folders: retrieval_eval_dirs (or eval_strategy 'no')"
            )
        if self.data.retrieval_eval_dirs and not evaluates:
            raise ConfigError(
                f"{self.source}: retrieval_eval_dirs are scored at each evaluation, and eval_strategy 'no' never "
                "evaluates: set eval_strategy 'steps' (and eval_steps) or drop retrieval_eval_dirs"
            )
        self.stage.check(args, self.source)
        self.stage.check_metrics_file(args.output_dir, self.source)
        self._warn_short_run()

    def _check_adapter_path(self) -> None:
        """A ``peft_model_name_or_path`` written as a local path (:func:`llm2vec.io.missing_local_path`) must be
        an existing folder, so a typo fails here and not after the data has loaded."""
        adapter = getattr(self.stage, "peft_model_name_or_path", None)
        if adapter and (missing_local_path(adapter) or os.path.isfile(adapter)):
            raise ConfigError(
                f"{self.source}: peft_model_name_or_path {adapter!r} is not a folder: give the folder of a trained "
                "adapter (it holds adapter_config.json) or a hub id, or leave the field out"
            )

    def _warn_short_run(self) -> None:
        """One warning when ``max_steps`` ends the run inside (or mostly inside) the linear warm-up: the rate then
        never reaches ``learning_rate``; it peaks at ``(max_steps - 1) / warmup`` of it (the rate of step ``s``,
        counted from 0, is ``s / warmup`` of the peak)."""
        args = self.training
        if args.max_steps <= 0:
            return
        warmup = args.get_warmup_steps(args.max_steps)
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
        out.update(
            config_file=self.source,
            world_size=self.training.world_size,
            precision={"weights": str(self.dtype).removeprefix("torch."), "autocast": self.autocast},
        )
        return json.loads(json.dumps(out, default=str))
