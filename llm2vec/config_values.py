"""Strict values for config fields: each raw value is read as its field's declared type, then range-checked."""

from __future__ import annotations

import functools
import inspect
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar


class ConfigError(ValueError):
    """A bad configuration: the message names the file or flag, the field, and what to do."""


class ValueProblem(ValueError):
    """A value that cannot be read as its field's type or lies outside its range (one line, no source)."""


@dataclass(frozen=True)
class Flag:
    """The raw strings given after ``--name`` on the command line (none, one or several)."""

    values: tuple[str, ...]


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric field: ``low`` / ``high`` bounds (inclusive unless ``*_open``) and ``also``,
    single values allowed outside them (e.g. ``max_steps = -1``)."""

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
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_number(self.high)}")
        text = " and ".join(parts) or "any number"
        return text + "".join(f", or {_number(v)}" for v in self.also)

    def capped(self, value: float) -> Range:
        """This range with the side that ``value`` lies beyond bounded by :data:`NUMBER_LIMIT` where it is open."""
        if value > 0 and self.high is None:
            return Range(self.low, NUMBER_LIMIT, self.low_open, False, self.also)
        if value < 0 and self.low is None:
            return Range(-NUMBER_LIMIT, self.high, False, self.high_open, self.also)
        return self


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


NUMBER_LIMIT = 2**31 - 1
"""The largest count any field takes (the largest 32-bit integer), and its negative the smallest number."""

MAX_PARALLEL = 1024
"""The most threads (``num_threads``) or data-loading processes (``dataloader_num_workers``) a run may ask for."""

# The numeric fields of transformers' TrainingArguments, with the values that can make a run.
TRAINING_RANGES: dict[str, Range] = {
    "per_device_train_batch_size": Range(1),
    "per_device_eval_batch_size": Range(1),
    "gradient_accumulation_steps": Range(1),
    "num_train_epochs": Range(0, low_open=True),
    "max_steps": Range(1, also=(-1,)),
    "learning_rate": Range(0, low_open=True),
    "warmup_steps": Range(0),
    "weight_decay": Range(0),
    "adam_beta1": Range(0, 1, high_open=True),
    "adam_beta2": Range(0, 1, high_open=True),
    "adam_epsilon": Range(0, low_open=True),
    "max_grad_norm": Range(0),
    "label_smoothing_factor": Range(0, 1, high_open=True),
    "neftune_noise_alpha": Range(0, low_open=True),
    "torch_empty_cache_steps": Range(1),
    "logging_steps": Range(0, low_open=True),
    "eval_steps": Range(0, low_open=True),
    "eval_delay": Range(0),
    "eval_accumulation_steps": Range(1),
    "save_steps": Range(0, low_open=True),
    "save_total_limit": Range(0),
    "seed": Range(0, 2**32 - 1),
    "data_seed": Range(0, 2**32 - 1),
    "dataloader_num_workers": Range(0, MAX_PARALLEL),
    "dataloader_prefetch_factor": Range(1),
    "ddp_bucket_cap_mb": Range(1),
    "ddp_timeout": Range(1),
}

_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _shape(hint) -> tuple[str, bool]:
    """``(kind, optional)`` of a type hint: kind is bool, int, float, str, list_str or other."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    optional = type(None) in args
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 1:
        only = rest[0]
        for kind in (bool, int, float, str):
            if only is kind:
                return kind.__name__, optional
        if typing.get_origin(only) is list and typing.get_args(only) == (str,):
            return "list_str", optional
    if len(rest) == 2 and str in rest and any(isinstance(a, type) and issubclass(a, str) for a in rest if a is not str):
        return "str", optional  # an Enum of strings, or a string (lr_scheduler_type, save_strategy, ...)
    return "other", optional


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueProblem(f"{name}={value!r}: a true/false field takes true or false (or 1 / 0)")


def _parsed(name: str, value: Any, expected: str) -> Any:
    """A string read as an int, else as a float (:class:`ValueProblem` saying what was ``expected``); else ``value``."""
    if not isinstance(value, str):
        return value
    for parse in (int, float):
        try:
            return parse(value.strip())
        except ValueError:
            pass
    raise ValueProblem(f"{name}={value!r}: expected {expected}")


def _as_int(name: str, value: Any) -> int:
    value = _parsed(name, value, "a whole number")
    if isinstance(value, bool):
        raise ValueProblem(f"{name}={value!r}: expected a whole number, not true/false")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise ValueProblem(f"{name}={value!r}: expected a whole number")


def _as_float(name: str, value: Any) -> float | int:
    """A finite number; a whole number stays an int, as JSON reads it (``logging_steps 1``, not ``1.0``)."""
    value = _parsed(name, value, "a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueProblem(f"{name}={value!r}: expected a number")
    if not math.isfinite(value):
        raise ValueProblem(f"{name}={value!r}: expected a finite number")
    return value


def _as_list_str(name: str, value: Any, from_flag: bool) -> list[str]:
    if from_flag and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueProblem(f"{name}={value!r}: not a JSON list ({e.msg})") from None
    if from_flag and isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ValueProblem(f"{name}={value!r}: expected a list of strings")


def coerce_value(name: str, value: Any, hint, choices=()) -> Any:
    """``value`` (a JSON value, or a :class:`Flag`) read as type ``hint``; raises :class:`ValueProblem`."""
    kind, optional = _shape(hint)
    from_flag = isinstance(value, Flag)
    if from_flag:
        given = value.values
        if not given:
            if kind == "bool":
                return True
            raise ValueProblem(f"--{name} is given without a value; give one (e.g. --{name} VALUE)")
        if len(given) > 1 and kind not in ("list_str", "other"):
            raise ValueProblem(f"--{name} is given {len(given)} values ({' '.join(given)}); give one")
        if kind == "list_str" and len(given) > 1:
            return list(given)
        value = given[0] if len(given) == 1 else list(given)
        if optional and kind != "other" and isinstance(value, str) and value.strip().lower() in ("null", "none"):
            return None
    if value is None:
        if optional:
            return None
        raise ValueProblem(f"{name} is null; this field needs a value ({kind.replace('_str', ' of strings')})")
    if kind == "bool":
        return _as_bool(name, value)
    if kind == "int":
        return _as_int(name, value)
    if kind == "float":
        return _as_float(name, value)
    if kind == "str":
        if isinstance(value, bool) and {"true", "false"} <= set(choices):
            return str(value).lower()  # a JSON true/false for a field whose choices are the strings
        if not isinstance(value, str):
            raise ValueProblem(f"{name}={json.dumps(value)}: expected a string")
        return value
    if kind == "list_str":
        return _as_list_str(name, value, from_flag)
    if from_flag:  # other types: a flag's value as JSON where it parses (dicts, lists), else the string
        values = value if isinstance(value, list) else [value]
        parsed = []
        for v in values:
            try:
                parsed.append(json.loads(v))
            except json.JSONDecodeError:
                parsed.append(v)
        return parsed[0] if len(parsed) == 1 else parsed
    return value


# Fields read by this project in a looser way than their declared type says.
HINT_OVERRIDES: dict[str, Any] = {
    "resume_from_checkpoint": str | bool | None,  # true / false / a checkpoint folder (llm2vec.run.plan)
    "fsdp": str | bool | list | None,  # declared str, but the Trainer takes true / false and a list of options
}


def coerce_config(config: dict[str, Any], classes) -> dict[str, Any]:
    """Every value of ``config`` read as its field's type (see the module docstring), with no NaN or infinity at
    any depth; unknown keys are left as they are (the caller reports them)."""
    hints = {}  # name -> (type hint, choices) of every init field
    for cls in classes:
        types_of = typing.get_type_hints(cls)
        hints.update({f.name: (types_of[f.name], tuple(f.metadata.get("choices", ()))) for f in fields(cls) if f.init})
    out = {}
    for name, value in config.items():
        if name not in hints:
            out[name] = value
            continue
        hint, choices = hints[name]
        out[name] = coerce_value(name, value, HINT_OVERRIDES.get(name, hint), choices)
        check_finite(name, out[name])
    return out


def check_finite(path: str, value: Any) -> None:
    """No float in ``value`` (a JSON value: dicts and lists at any depth) is NaN or infinite; the error names its
    ``path`` (``lr_scheduler_kwargs.min_lr``, ``fsdp_config.limits[1]``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueProblem(f"{path}={value!r}: expected a finite number")
    if isinstance(value, dict):
        for key, item in value.items():
            check_finite(f"{path}.{key}", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_finite(f"{path}[{i}]", item)


def check_ranges(values: dict[str, Any], ranges: dict[str, Range] = TRAINING_RANGES) -> None:
    """Each numeric value lies in its range in ``ranges`` and within :data:`NUMBER_LIMIT` of zero (``None``:
    unset, allowed); the error names the field, the value and the range."""
    for name, value in values.items():
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        allowed = ranges.get(name, Range())
        if value not in allowed:
            raise ValueProblem(f"{name}={value!r}: must be {allowed.describe()}")
        if abs(value) > NUMBER_LIMIT and value not in allowed.capped(value):
            raise ValueProblem(f"{name}={value!r}: must be {allowed.capped(value).describe()}")


# ---------------------------------------------------------------------------------------------- the Python API

F = TypeVar("F", bound=Callable[..., Any])


def strict_booleans(function: F) -> F:
    """Each parameter of ``function`` annotated ``bool`` takes ``True`` or ``False`` only (``bool | None`` also
    ``None``); anything else (``"false"``, ``0``, ``numpy.True_``) is one ``TypeError`` line naming the keyword,
    before the function runs. The annotations are read at the first call (a method's may name its own class)."""
    parameters = inspect.signature(function).parameters
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    position = {name: i for i, (name, p) in enumerate(parameters.items()) if p.kind in by_position}
    booleans: dict[str, bool] = {}  # name -> whether None is allowed
    read = False

    @functools.wraps(function)
    def checked(*args, **kwargs):
        nonlocal read
        if not read:
            for name, hint in typing.get_type_hints(function).items():
                kind, optional = _shape(hint)
                if kind == "bool" and name in parameters:
                    booleans[name] = optional
            read = True
        for name, optional in booleans.items():
            if name in kwargs:
                value = kwargs[name]
            elif position.get(name, len(args)) < len(args):
                value = args[position[name]]
            else:
                continue
            if value is not True and value is not False and not (optional and value is None):
                allowed = "True, False or None" if optional else "True or False"
                why = " (Python reads any non-empty string as true, 'false' included)" if isinstance(value, str) else ""
                raise TypeError(f"{name}={value!r}: {function.__qualname__} takes {allowed} only{why}")
        return function(*args, **kwargs)

    return typing.cast(F, checked)
