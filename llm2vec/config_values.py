"""Strict config values: each raw value read as its field's declared type (:func:`coerce_config`), every number
within its field's range (:data:`RANGES`) and every choice among its field's ``choices`` (:func:`check_fields`)."""

from __future__ import annotations

import json
import math
import types
import typing
from collections import namedtuple
from dataclasses import dataclass, fields
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad configuration: the message names the file or flag, the field, and what to do."""


Flag = namedtuple("Flag", "values")  # the raw strings given after --name on the command line (none, one or several)
NUMBER_LIMIT = 2**31 - 1  # the largest count any field takes; its negative is the smallest number
MAX_PARALLEL = 1024  # the most threads or data-loading processes a run may ask for


@dataclass(frozen=True)
class Range:
    """The numbers a field takes: ``low`` to ``high`` (``None``: unbounded; excluded when ``*_open``), or ``also``."""

    low: int | None = None
    high: int | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[int, ...] = ()

    def check(self, name: str, value: float) -> None:
        """``value`` in this range, and within :data:`NUMBER_LIMIT` of zero on a side it leaves unbounded."""
        capped = (-NUMBER_LIMIT if self.low is None else self.low, NUMBER_LIMIT if self.high is None else self.high)
        for low, high in ((self.low, self.high), capped):
            below = low is not None and (value <= low if self.low_open else value < low)
            above = high is not None and (value >= high if self.high_open else value > high)
            if (below or above) and value not in self.also:
                bounds = [f"{'>' if self.low_open else '>='} {low}"] if low is not None else []
                bounds += [f"{'<' if self.high_open else '<='} {high}"] if high is not None else []
                also = "".join(f", or {v}" for v in self.also)
                raise ConfigError(f"{name}={value!r}: must be {' and '.join(bounds)}{also}")


FIELDS_BY_RANGE = {  # every numeric field with a range: transformers' TrainingArguments' and this project's
    Range(1): "per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps total_batch_size "
    "eval_accumulation_steps torch_empty_cache_steps dataloader_prefetch_factor ddp_bucket_cap_mb ddp_timeout lora_r "
    "stop_after_n_steps max_examples_per_source",
    Range(0, low_open=True): "num_train_epochs learning_rate adam_epsilon neftune_noise_alpha logging_steps eval_steps "
    "save_steps stop_after_minutes loss_scale lora_alpha",
    Range(0): "warmup_steps weight_decay max_grad_norm eval_delay save_total_limit token_budget logit_chunk_rows "
    "embedding_token_budget validation_size",
    Range(0, 1, high_open=True): "adam_beta1 adam_beta2 label_smoothing_factor lora_dropout "
    "reconstruction_input_dropout",
    Range(0, 1): "alpha",
    Range(1, also=(-1,)): "max_steps",
    Range(0, 2**32 - 1): "seed data_seed",
    Range(0, MAX_PARALLEL): "dataloader_num_workers",
    Range(1, MAX_PARALLEL): "num_threads",
    Range(8): "max_seq_length",
}
RANGES: dict[str, Range] = {name: r for r, names in FIELDS_BY_RANGE.items() for name in names.split()}


def check_ranges(values: dict[str, Any]) -> None:
    """Each number of ``values`` in its field's range (:data:`RANGES`), or :class:`ConfigError` naming them."""
    for name, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            RANGES.get(name, Range()).check(name, value)


def check_fields(arguments) -> None:
    """The dataclass ``arguments``: each field among its ``choices`` (metadata) and within its range."""
    values = {f.name: getattr(arguments, f.name) for f in fields(arguments)}
    for f in fields(arguments):
        if (choices := f.metadata.get("choices")) and values[f.name] not in choices:
            raise ConfigError(f"{f.name}={values[f.name]!r}: choose one of {', '.join(map(str, choices))}")
    check_ranges(values)


def _shape(hint) -> tuple[str, bool]:
    """``(kind, optional)`` of a type hint: kind is bool, int, float, str (choices too), list_str or other."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 1 and rest[0] in (bool, int, float, str):
        return rest[0].__name__, type(None) in args
    if len(rest) == 1 and typing.get_origin(rest[0]) is list and typing.get_args(rest[0]) == (str,):
        return "list_str", type(None) in args
    classes = all(isinstance(a, type) and typing.get_origin(a) is None for a in rest)
    strings = typing.get_origin(rest[0]) is Literal or (classes and all(issubclass(a, str) for a in rest))
    return "str" if len(rest) <= 2 and strings else "other", type(None) in args


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    raise ConfigError(f"{name}={value!r}: a true/false field takes true or false (or 1 / 0)")


def _as_number(name: str, value: Any, whole: bool) -> int | float:
    """A finite number (a whole number stays an int, as JSON reads it); ``whole``: an int."""
    what = "a whole number" if whole else "a number"
    for parse in (int, float) if isinstance(value, str) else ():
        try:
            value = parse(value)
            break
        except ValueError:
            pass
    if isinstance(value, (str, bool)) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r}: expected {what}" + ", not true/false" * isinstance(value, bool))
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value!r}: expected a finite number")
    if whole and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{name}={value!r}: expected a whole number")
    return int(value) if whole else value


def _from_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def coerce_value(name: str, value: Any, hint, choices=()) -> Any:
    """``value`` (a JSON value, or a :class:`Flag`) read as type ``hint``; raises :class:`ConfigError`."""
    kind, optional = _shape(hint)
    if isinstance(value, Flag):
        given = value.values
        if not given and kind == "bool":
            return True
        if not given:
            raise ConfigError(f"--{name} is given without a value; give one (e.g. --{name} VALUE)")
        if len(given) > 1 and kind not in ("list_str", "other"):
            raise ConfigError(f"--{name} is given {len(given)} values ({' '.join(given)}); give one")
        if kind == "other":  # a flag's value as JSON where it parses (dicts, lists), else the string
            return _from_json(given[0]) if len(given) == 1 else [_from_json(v) for v in given]
        if optional and len(given) == 1 and given[0].strip().lower() in ("null", "none"):
            return None
        value = given[0]
        if kind == "list_str":  # several strings, one string, or a JSON list
            value = list(given) if len(given) > 1 or not value.lstrip().startswith("[") else _from_json(value)
    if value is None and not optional:
        raise ConfigError(f"{name} is null; this field needs a value ({kind.replace('_str', ' of strings')})")
    if value is None:
        return None
    if kind == "bool":
        return _as_bool(name, value)
    if kind in ("int", "float"):
        return _as_number(name, value, whole=kind == "int")
    if kind == "str" and isinstance(value, bool) and {"true", "false"} <= set(choices):
        return str(value).lower()  # a JSON true/false for a field whose choices are the strings
    if kind == "str" and not isinstance(value, str):
        raise ConfigError(f"{name}={json.dumps(value)}: expected a string")
    if kind == "list_str" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ConfigError(f"{name}={value!r}: expected a list of strings")
    return value


# Fields read more loosely than declared: resume_from_checkpoint takes true / false / a checkpoint folder, and fsdp
# (declared str) true / false or a list of options, as the Trainer does.
HINT_OVERRIDES: dict[str, Any] = {"resume_from_checkpoint": str | bool | None, "fsdp": str | bool | list | None}


def coerce_config(config: dict[str, Any], classes) -> dict[str, Any]:
    """Every value of ``config`` read as its field's type, with no NaN or infinity at any depth; unknown keys kept."""
    hints = {}  # name -> (type hint, choices) of every init field
    for cls in classes:
        types_of = typing.get_type_hints(cls)
        hints.update({f.name: (types_of[f.name], tuple(f.metadata.get("choices", ()))) for f in fields(cls) if f.init})
    out = {}
    for name, value in config.items():
        if name in hints:
            value = coerce_value(name, value, HINT_OVERRIDES.get(name, hints[name][0]), hints[name][1])
            check_finite(name, value)
        out[name] = value
    return out


def check_finite(path: str, value: Any) -> None:
    """No float in ``value``, at any depth, is NaN or infinite; the error names its ``path`` (``kwargs.min_lr``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}={value!r}: expected a finite number")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        check_finite(f"{path}.{key}" if isinstance(value, dict) else f"{path}[{key}]", item)
