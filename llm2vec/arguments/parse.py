"""Reading a run's configuration: a JSON file, command-line flags, or a JSON file followed by flags that override
it, into a validated-per-field :class:`~llm2vec.arguments.run_config.RunConfig` of one stage; and the drivers'
``--help``.
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Any

import torch
from transformers import HfArgumentParser

from ..config_values import Flag, ValueProblem, check_ranges, coerce_config
from ..io import JsonFileError, read_json_file
from .run_config import RunConfig
from .shared import STAGES, ConfigError
from .stages import STAGE_ARGUMENTS, argument_classes

# Training defaults that differ from transformers' (set unless the config gives them).
TRAINING_DEFAULTS = {"remove_unused_columns": False, "report_to": "none", "ddp_find_unused_parameters": False}


def flag_groups(argv: list[str]) -> list[tuple[str, tuple[str, ...]]]:
    """``--name value...`` (or ``--name=value``) groups of ``argv``, in order: the one reading of flags, shared by the
    config (:func:`load_config`) and the drivers' own ``--debug`` (:func:`llm2vec.training.main`). The strings are
    read as each field's type later (:func:`llm2vec.config_values.coerce_config`)."""
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


def _parse_flags(argv: list[str]) -> dict[str, Flag]:
    """:func:`flag_groups` as ``{name: Flag(values)}``; a name given twice is refused."""
    out: dict[str, Flag] = {}
    for name, values in flag_groups(argv):
        if name in out:
            raise ConfigError(f"command line: --{name} is given twice; give it once")
        out[name] = Flag(values)
    return out


def load_config(argv: list[str]) -> tuple[dict[str, Any], str]:
    """The merged raw config: a JSON file (if the first argument is one) overridden by flags."""
    source = "command line"
    config: dict[str, Any] = {}
    if argv and argv[0].endswith(".json"):
        source = argv[0]
        try:
            config = read_json_file(source, "config file")
        except JsonFileError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(config, dict):
            raise ConfigError(f"{source}: the config must be a JSON object of field: value")
        argv = argv[1:]
    config.update(_parse_flags(argv))
    return config, source


def parse_config(stage: str, argv: list[str]) -> RunConfig:
    """Parse a config for ``stage`` (``"I"`` or ``"II"``); field values checked, nothing run-time yet."""
    config, source = load_config(argv)
    if isinstance(config.get("stage"), Flag):
        config["stage"] = " ".join(config["stage"].values)
    given_stage = config.get("stage", stage)
    if given_stage != stage:
        raise ConfigError(
            f"{source}: this config is for stage {given_stage!r} (field 'stage'); use run_stage_{given_stage}.py"
            if given_stage in STAGES
            else f"{source}: stage={given_stage!r}: choose one of {', '.join(STAGES)}"
        )
    classes = argument_classes(stage)
    known = {f.name for cls in classes for f in fields(cls)}
    _refuse_unknown(config, known, stage, source)
    if "model_name_or_path" not in config or "output_dir" not in config:
        raise ConfigError(f"{source}: 'model_name_or_path' and 'output_dir' are required")
    bf16_from_flag = isinstance(config.get("bf16"), Flag)
    try:
        config = coerce_config(config, classes)
        check_ranges(config)
    except ValueProblem as e:
        raise ConfigError(f"{source}: {e}") from None
    _check_bf16(config, source, bf16_from_flag)
    for key, value in TRAINING_DEFAULTS.items():
        config.setdefault(key, value)
    config.setdefault("dataloader_pin_memory", has_accelerator())  # torch warns on every CPU batch otherwise
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


def has_accelerator() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS, ...), where pinned host memory speeds up the copies."""
    return torch.accelerator.is_available()


def _refuse_unknown(config: dict[str, Any], known: set[str], stage: str, source: str) -> None:
    """One line for the unknown fields: blamed on the command line when they came as flags (a JSON file may come
    first), else on the file; each with the closest known name (``difflib``) or the stage it belongs to."""
    other = next(s for s in STAGES if s != stage)
    of_other = {f.name for f in fields(STAGE_ARGUMENTS[other])}
    flags = sorted(k for k, v in config.items() if k not in known and isinstance(v, Flag))
    in_file = sorted(k for k, v in config.items() if k not in known and not isinstance(v, Flag))
    for unknown, where, shown in ((flags, "command line", "--{}"), (in_file, source, "'{}'")):
        if not unknown:
            continue
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            if name in of_other:
                hints.append(f"{name}: Stage {other} only")
            elif close:
                hints.append(f"{shown.format(name)}: did you mean {shown.format(close[0])}?")
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
