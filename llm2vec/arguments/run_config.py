"""A run's configuration, read once (:func:`parse_config`: a JSON file, flags, or a JSON file and flags that override
it) into the :class:`RunConfig` of one stage, which checks the rules across argument classes (``validate``) and is
saved beside each checkpoint (``resolved``); and the drivers' ``--help``."""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from transformers import HfArgumentParser

from ..compat import TrainingArguments
from ..config_values import ConfigError, Flag, check_ranges, coerce_config
from ..dataset.records import DataError, check_path_kind
from ..devices import resolve_dtype
from ..io import JsonFileError, missing_local_path, read_json_file
from .fields import (
    STAGE_ARGUMENTS,
    STAGES,
    DataArguments,
    ModelArguments,
    StageIArguments,
    StageIIArguments,
    argument_classes,
)

logger = logging.getLogger("llm2vec")

# Training defaults that differ from transformers' (set unless the config gives them).
TRAINING_DEFAULTS = {"remove_unused_columns": False, "report_to": "none", "ddp_find_unused_parameters": False}


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
        """The weights' dtype: ``torch_dtype``; ``auto``: bfloat16 if bf16 training keeps bf16 master weights."""
        pure = self.training.bf16 and self.model.master_weights == "bf16"
        return resolve_dtype(
            ("bfloat16" if pure else "float32") if self.model.torch_dtype == "auto" else self.model.torch_dtype
        )

    def apply_precision_policy(self) -> None:
        """``torch_dtype`` checked against ``master_weights``; pure bf16 under FSDP: no mixed precision (bf16 kept)."""
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
        """The first rule across argument classes or of the machine that the config breaks, a :class:`ConfigError`."""
        if problem := next(self._problems(), None):
            raise ConfigError(f"{self.source}: {problem}")
        self.stage.check(self.training)

    def _problems(self) -> Iterator[str]:
        model, data, stage, args = self.model, self.data, self.stage, self.training
        adapter = getattr(stage, "peft_model_name_or_path", None)  # a typo named by its field, before the model checks
        if adapter and (missing_local_path(adapter) or os.path.isfile(adapter)):
            yield (
                f"peft_model_name_or_path {adapter!r} is not a folder: give the folder of a trained adapter (it holds "
                "adapter_config.json) or a hub id, or leave the field out"
            )
        try:  # a folder where a file belongs, or the reverse (a missing path is reported by the loader)
            for path in data.dataset_file_path.split(",") if data.dataset_name == "jsonl" else []:
                check_path_kind(path, "jsonl")
            if data.dataset_name == "E5" and data.dataset_file_path:
                check_path_kind(data.dataset_file_path, "E5")
            if data.validation_file:
                check_path_kind(data.validation_file, "jsonl", "validation_file")
        except DataError as e:
            yield str(e)
        flash = model.attn_implementation == "flash_attention_2"
        if flash and importlib.util.find_spec("flash_attn") is None:
            yield (
                "attn_implementation 'flash_attention_2' needs the flash-attn package (pip install -e '.[flash]', CUDA "
                "GPUs only); or pass --attn_implementation sdpa"
            )
        if flash and not torch.cuda.is_available():
            yield "attn_implementation 'flash_attention_2' needs a CUDA GPU; pass --attn_implementation sdpa on CPU"
        if args.fsdp and args.activation_checkpointing and (args.fsdp_config or {}).get("activation_checkpointing"):
            yield (
                "activation checkpointing is asked for twice, by activation_checkpointing and by fsdp_config's "
                '"activation_checkpointing"; keep FSDP\'s own (no redundant all-gather): pass '
                "--activation_checkpointing false"
            )
        if stage.total_batch_size is not None and self.global_batch_size != stage.total_batch_size:
            yield (
                f"total_batch_size is {stage.total_batch_size} but per_device_train_batch_size "
                f"{args.per_device_train_batch_size} x {args.world_size} process(es) x gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps} = {self.global_batch_size}: launch as many processes as meant "
                "(torchrun --nproc_per_node=N) or change per_device_train_batch_size / gradient_accumulation_steps"
            )
        if 0 < (budget := getattr(stage, "embedding_token_budget", 0)) < model.max_seq_length:
            yield (
                f"embedding_token_budget {budget} is below max_seq_length {model.max_seq_length}, which one text may "
                f"fill: give at least {model.max_seq_length} (or 0 for no gradient cache)"
            )
        chunked = [f for f in ("token_budget", "embedding_token_budget") if getattr(stage, f, 0)]
        if args.deepspeed and chunked:
            yield (
                f"{chunked[0]} {getattr(stage, chunked[0])} cannot run under DeepSpeed: the chunked step "
                "back-propagates each chunk outside its engine, which would divide the gradients by the accumulation "
                f"steps twice and step on every chunk; pass --{chunked[0]} 0, or use FSDP (--fsdp true --fsdp_config "
                "train_configs/fsdp/fsdp2_full_shard.json)"
            )
        if getattr(stage, "stop_decoder_gradient", False) and args.fsdp:
            yield "stop_decoder_gradient cannot run under FSDP (its sharded weights cannot be detached); use DDP"
        evaluates = str(args.eval_strategy) not in ("no", "IntervalStrategy.NO")
        if evaluates and not (data.validation_file or data.validation_size or data.retrieval_eval_dirs):
            yield (
                f"eval_strategy {args.eval_strategy.value!r} needs validation pairs (validation_file or "
                "validation_size) or retrieval folders (retrieval_eval_dirs); or set eval_strategy 'no'"
            )
        if data.retrieval_eval_dirs and not evaluates:
            yield (
                "retrieval_eval_dirs are scored at each evaluation, and eval_strategy 'no' never evaluates: set "
                "eval_strategy 'steps' (and eval_steps) or drop retrieval_eval_dirs"
            )
        out = os.path.realpath(args.output_dir)
        if stage.metrics_file and os.path.commonpath([out, os.path.realpath(stage.metrics_file)]) == out:
            yield f"metrics_file {stage.metrics_file} is inside output_dir {args.output_dir}; give a path outside it"

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


def flag_groups(argv: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``--name value...`` (or ``--name=value``) groups of ``argv``: the flags, for the config and ``--debug``."""
    groups: list[tuple[str, tuple[str, ...]]] = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, equals, value = arg[2:].partition("=")
            groups.append((name, (value,) if equals else ()))
        elif groups:
            groups[-1] = (groups[-1][0], (*groups[-1][1], arg))
        else:
            raise ConfigError(f"command line: expected --field, got {arg!r} (a JSON config must come first)")
    return groups


def load_config(argv: list[str]) -> tuple[dict[str, Any], str]:
    """The raw config and its source: a JSON file (if the first argument is one) overridden by flags (``Flag``)."""
    source, config = "command line", {}
    if argv and argv[0].endswith(".json"):
        source, argv = argv[0], argv[1:]
        try:
            config = read_json_file(source, "config file")
        except JsonFileError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(config, dict):
            raise ConfigError(f"{source}: the config must be a JSON object of field: value")
    flags: dict[str, Flag] = {}
    for name, values in flag_groups(argv):
        if name in flags:
            raise ConfigError(f"command line: --{name} is given twice; give it once")
        flags[name] = Flag(values)
    return {**config, **flags}, source


def parse_config(stage: str, argv: list[str]) -> RunConfig:
    """The config of ``stage`` (``"I"`` or ``"II"``) in ``argv``, each value read as its field's type and checked."""
    config, source = load_config(argv)
    given = config.get("stage", stage)  # a value that is no stage is refused with the other fields' values
    if (given := " ".join(given.values) if isinstance(given, Flag) else given) != stage and given in STAGES:
        raise ConfigError(f"{source}: this config is for stage {given!r} (field 'stage'); use run_stage_{given}.py")
    classes = argument_classes(stage)
    _refuse_unknown(config, {f.name for cls in classes for f in fields(cls)}, stage, source)
    if "model_name_or_path" not in config or "output_dir" not in config:
        raise ConfigError(f"{source}: 'model_name_or_path' and 'output_dir' are required")
    bf16_from_flag = isinstance(config.get("bf16"), Flag)
    try:  # transformers' fields in their ranges before it reads them; this project's are checked by their classes
        config = coerce_config(config, classes)
        check_ranges({f.name: config[f.name] for f in fields(TrainingArguments) if f.name in config})
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    if (resume := config.get("resume_from_checkpoint")) is not None:  # None, True (the newest checkpoint) or a folder
        resume = str(resume)
        config["resume_from_checkpoint"] = (
            None if resume in ("", "False", "false") else resume in ("True", "true") or resume
        )
    _check_bf16(config, source, bf16_from_flag)
    config = {**TRAINING_DEFAULTS, "dataloader_pin_memory": torch.accelerator.is_available(), **config}
    if config.get("validation_file") or config.get("validation_size") or config.get("retrieval_eval_dirs"):
        config.setdefault("eval_strategy", "steps")  # held-out pairs and retrieval folders: every eval_steps
    if config.get("activation_checkpointing"):
        config.setdefault("activation_checkpointing_kwargs", {"use_reentrant": False})
    try:
        model, data, stage_args, training = HfArgumentParser(classes).parse_dict(config, allow_extra_keys=False)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: {e}") from None
    config = RunConfig(model, data, stage_args, training, source)
    config.apply_precision_policy()
    return config


def _check_bf16(config: dict[str, Any], source: str, from_flag: bool) -> None:
    """``bf16: true`` on a machine without bf16: one line naming the setting to change, where it was given."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    if config.get("bf16") is not True or config.get("use_cpu") is True or is_torch_bf16_gpu_available():
        return
    if is_torch_xla_available():
        return
    machine = "this machine's GPU has no bf16" if torch.cuda.is_available() else "torch sees no GPU here"
    given, fix = (
        ("--bf16 true", "pass --bf16 false")
        if from_flag
        else ('"bf16": true', f'set "bf16": false in {source} (or pass --bf16 false)')
    )
    raise ConfigError(
        f"{source}: {given} needs a GPU with bf16 and {machine}: {fix} to train in float32, or pass --use_cpu true "
        "to train in bf16 on the CPU"
    )


def _refuse_unknown(config: dict[str, Any], known: set[str], stage: str, source: str) -> None:
    """Unknown fields, blamed on the flags or the file, with the closest known name or the stage they belong to."""
    other = next(s for s in STAGES if s != stage)
    of_other = {f.name for f in fields(STAGE_ARGUMENTS[other])}
    for from_flags, where, shown in ((True, "command line", "--{}"), (False, source, "'{}'")):
        unknown = sorted(k for k, v in config.items() if k not in known and isinstance(v, Flag) == from_flags)
        hints = [f"{name}: Stage {other} only" for name in unknown if name in of_other]
        for name in (name for name in unknown if name not in of_other):
            for close in difflib.get_close_matches(name, known, n=1, cutoff=0.75):
                hints.append(f"{shown.format(name)}: did you mean {shown.format(close)}?")
        if unknown:
            hint = f" ({'; '.join(hints)})" if hints else ""
            raise ConfigError(
                f"{where}: unknown field(s) for Stage {stage}: {unknown}{hint}. "
                f"`run_stage_{stage}.py --help` lists the fields."
            )


def help_text(stage: str) -> str:
    """The ``--help`` of a stage's driver: every field with its help and default."""
    parser = HfArgumentParser(argument_classes(stage))
    parser.prog = f"run_stage_{stage}.py"
    parser.usage = f"run_stage_{stage}.py CONFIG.json [--field value ...]  |  run_stage_{stage}.py --field value ..."
    return parser.format_help()
