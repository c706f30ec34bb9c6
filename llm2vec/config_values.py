"""Strict config values: each raw value read as its field's declared type (:func:`coerce_config`), every number
within its field's range (:data:`RANGES`) and every choice among its field's ``choices`` (:func:`check_fields`)."""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from .keywords import strict_booleans as strict_booleans  # the Python API's, imported from here by its modules


class ConfigError(ValueError):
    """A bad configuration: the message names the file or flag, the field, and what to do."""


@dataclass(frozen=True)
class Flag:
    """The raw strings given after ``--name`` on the command line (none, one or several)."""

    values: tuple[str, ...]


NUMBER_LIMIT = 2**31 - 1  # the largest count any field takes; its negative is the smallest number
MAX_PARALLEL = 1024  # the most threads or data-loading processes a run may ask for


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric field: bounds (inclusive unless ``*_open``) and ``also``, single values allowed
    outside them (``max_steps = -1``)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, ...] = ()

    def __contains__(self, value: float) -> bool:
        if value in self.also:
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def describe(self) -> str:
        text = lambda v: str(v) if isinstance(v, int) else f"{v:g}"  # noqa: E731
        parts = [f"{'>' if self.low_open else '>='} {text(self.low)}"] if self.low is not None else []
        parts += [f"{'<' if self.high_open else '<='} {text(self.high)}"] if self.high is not None else []
        return " and ".join(parts) + "".join(f", or {text(v)}" for v in self.also)

    def check(self, name: str, value: float) -> None:
        """``value`` within this range, and within :data:`NUMBER_LIMIT` of zero where a side is unbounded."""
        low, high = -NUMBER_LIMIT if self.low is None else self.low, NUMBER_LIMIT if self.high is None else self.high
        for allowed in (self, replace(self, low=low, high=high)):
            if value not in allowed:
                raise ConfigError(f"{name}={value!r}: must be {allowed.describe()}")


FIELDS_BY_RANGE = {  # every numeric field with a range: transformers' TrainingArguments' and this project's
    Range(1): "per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps total_batch_size "
    "eval_accumulation_steps torch_empty_cache_steps dataloader_prefetch_factor ddp_bucket_cap_mb ddp_timeout lora_r "
    "stop_after_n_steps max_examples_per_source",
    Range(0, low_open=True): "num_train_epochs learning_rate adam_epsilon neftune_noise_alpha logging_steps eval_steps "
    "save_steps stop_after_minutes loss_scale lora_alpha",
    Range(0): "warmup_steps weight_decay max_grad_norm eval_delay save_total_limit token_budget logit_chunk_rows "
    "embedding_token_budget validation_size",
    Range(
        0, 1, high_open=True
    ): "adam_beta1 adam_beta2 label_smoothing_factor lora_dropout reconstruction_input_dropout",
    Range(0, 1): "alpha",
    Range(1, also=(-1,)): "max_steps",
    Range(0, 2**32 - 1): "seed data_seed",
    Range(0, MAX_PARALLEL): "dataloader_num_workers",
    Range(1, MAX_PARALLEL): "num_threads",
    Range(8): "max_seq_length",
}
RANGES: dict[str, Range] = {name: r for r, names in FIELDS_BY_RANGE.items() for name in names.split()}


def check_ranges(values: dict[str, Any]) -> None:
    """Each number of ``values`` (``None``: unset) within its field's range of :data:`RANGES` (or any number
    within :data:`NUMBER_LIMIT`); raises :class:`ConfigError` naming the field, the value and the range."""
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
    """``(kind, optional)`` of a type hint: kind is bool, int, float, str, list_str or other."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    rest = [a for a in args if a is not type(None)]
    kind = "other"
    if len(rest) == 1 and rest[0] in (bool, int, float, str):
        kind = rest[0].__name__
    elif len(rest) == 1 and typing.get_origin(rest[0]) is list and typing.get_args(rest[0]) == (str,):
        kind = "list_str"
    elif len(rest) == 1 and typing.get_origin(rest[0]) is Literal:
        kind = "str"  # a field of choices (they are strings)
    elif len(rest) == 2 and str in rest and all(isinstance(a, type) and issubclass(a, str) for a in rest):
        kind = "str"  # an Enum of strings, or a string (lr_scheduler_type, save_strategy, ...)
    return kind, type(None) in args


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "false", "0"):
        return value.strip().lower() in ("true", "1")
    raise ConfigError(f"{name}={value!r}: a true/false field takes true or false (or 1 / 0)")


def _as_number(name: str, value: Any, whole: bool) -> int | float:
    """A finite number (a whole number stays an int, as JSON reads it); ``whole``: an int."""
    what = "a whole number" if whole else "a number"
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r}: expected {what}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r}: expected {what}" + (", not true/false" * isinstance(value, bool)))
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name}={value!r}: expected a finite number")
    if whole and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{name}={value!r}: expected a whole number")
    return int(value) if whole else value


def _as_list_str(name: str, value: Any, from_flag: bool) -> list[str]:
    if from_flag and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name}={value!r}: not a JSON list ({e.msg})") from None
    if from_flag and isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ConfigError(f"{name}={value!r}: expected a list of strings")


def _from_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def coerce_value(name: str, value: Any, hint, choices=()) -> Any:
    """``value`` (a JSON value, or a :class:`Flag`) read as type ``hint``; raises :class:`ConfigError`."""
    kind, optional = _shape(hint)
    from_flag = isinstance(value, Flag)
    if from_flag:
        given = value.values
        if not given:
            if kind == "bool":
                return True
            raise ConfigError(f"--{name} is given without a value; give one (e.g. --{name} VALUE)")
        if len(given) > 1 and kind not in ("list_str", "other"):
            raise ConfigError(f"--{name} is given {len(given)} values ({' '.join(given)}); give one")
        if kind == "other":  # a flag's value as JSON where it parses (dicts, lists), else the string
            parsed = [_from_json(v) for v in given]
            return parsed[0] if len(parsed) == 1 else parsed
        if kind == "list_str" and len(given) > 1:
            return list(given)
        value = given[0]
        if optional and value.strip().lower() in ("null", "none"):
            return None
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} is null; this field needs a value ({kind.replace('_str', ' of strings')})")
    if kind == "bool":
        return _as_bool(name, value)
    if kind in ("int", "float"):
        return _as_number(name, value, whole=kind == "int")
    if kind == "str" and isinstance(value, bool) and {"true", "false"} <= set(choices):
        return str(value).lower()  # a JSON true/false for a field whose choices are the strings
    if kind == "str" and not isinstance(value, str):
        raise ConfigError(f"{name}={json.dumps(value)}: expected a string")
    return _as_list_str(name, value, from_flag) if kind == "list_str" else value


# Fields read by this project in a looser way than their declared type says.
HINT_OVERRIDES: dict[str, Any] = {
    "resume_from_checkpoint": str | bool | None,  # true / false / a checkpoint folder (llm2vec.run.plan)
    "fsdp": str | bool | list | None,  # declared str, but the Trainer takes true / false and a list of options
}


def coerce_config(config: dict[str, Any], classes) -> dict[str, Any]:
    """Every value of ``config`` read as its field's type, with no NaN or infinity at any depth; unknown keys are
    left as they are (the caller reports them)."""
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
    """No float in ``value`` (dicts and lists at any depth) is NaN or infinite; the error names its ``path``
    (``lr_scheduler_kwargs.min_lr``, ``fsdp_config.limits[1]``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path}={value!r}: expected a finite number")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        check_finite(f"{path}.{key}" if isinstance(value, dict) else f"{path}[{key}]", item)
