"""Reading a run's configuration once: a JSON file, command-line flags, or a JSON file followed by flags that override
it, into the :class:`~llm2vec.arguments.run_config.RunConfig` of one stage; and the drivers' ``--help``."""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any

import torch
from transformers import HfArgumentParser

from ..compat import TrainingArguments
from ..config_values import ConfigError, Flag, check_ranges, coerce_config
from ..io import JsonFileError, read_json_file
from .run_config import RunConfig
from .shared import STAGES
from .stages import STAGE_ARGUMENTS, argument_classes

# Training defaults that differ from transformers' (set unless the config gives them).
TRAINING_DEFAULTS = {"remove_unused_columns": False, "report_to": "none", "ddp_find_unused_parameters": False}


def flag_groups(argv: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``--name value...`` (or ``--name=value``) groups of ``argv``, in order: the one reading of flags, shared by the
    config (:func:`load_config`) and the drivers' own ``--debug`` (:func:`llm2vec.training.main`)."""
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
    """The merged raw config and where it came from: a JSON file (if the first argument is one) overridden by flags
    (each a :class:`~llm2vec.config_values.Flag`; a name given twice is refused)."""
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
    """Parse a config for ``stage`` (``"I"`` or ``"II"``); each value read as its field's type and checked, nothing
    run-time yet (:meth:`RunConfig.validate`)."""
    config, source = load_config(argv)
    if isinstance(config.get("stage"), Flag):
        config["stage"] = " ".join(config["stage"].values)
    if (given := config.get("stage", stage)) != stage:
        raise ConfigError(
            f"{source}: this config is for stage {given!r} (field 'stage'); use run_stage_{given}.py"
            if given in STAGES
            else f"{source}: stage={given!r}: choose one of {', '.join(STAGES)}"
        )
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
    """``bf16: true`` where transformers' ``TrainingArguments`` refuses it (no ``use_cpu`` and no GPU or XLA device
    with bf16): one line naming the setting to change and where it was given, in place of transformers' message."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    if config.get("bf16") is not True or config.get("use_cpu") is True:
        return
    if is_torch_bf16_gpu_available() or is_torch_xla_available():
        return
    machine = "this machine's GPU has no bf16" if torch.cuda.is_available() else "torch sees no GPU here"
    given = "--bf16 true" if from_flag else '"bf16": true'
    fix = "pass --bf16 false" if from_flag else f'set "bf16": false in {source} (or pass --bf16 false)'
    raise ConfigError(
        f"{source}: {given} needs a GPU with bf16 and {machine}: {fix} to train in float32, or pass --use_cpu true "
        "to train in bf16 on the CPU"
    )


def _refuse_unknown(config: dict[str, Any], known: set[str], stage: str, source: str) -> None:
    """One line for the unknown fields: blamed on the command line when they came as flags (a JSON file may come
    first), else on the file; each with the closest known name (``difflib``) or the stage it belongs to."""
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
