"""The Python API's strict true/false keywords: a parameter annotated ``bool`` takes ``True`` or ``False`` only."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def strict_booleans(function: F) -> F:
    """Each ``bool`` parameter of ``function`` takes ``True`` or ``False`` only (``bool | None`` also ``None``): else
    one ``TypeError`` line naming it, before the function runs (annotations read at the first call)."""
    parameters = inspect.signature(function).parameters
    by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    position = {name: i for i, (name, p) in enumerate(parameters.items()) if p.kind in by_position}
    booleans: dict[str, bool] | None = None  # name -> whether None is allowed

    @functools.wraps(function)
    def checked(*args, **kwargs):
        nonlocal booleans
        if booleans is None:
            hints = typing.get_type_hints(function)
            booleans = {name: hint is not bool for name, hint in hints.items() if hint in (bool, bool | None)}
        for name, optional in booleans.items():
            if name in kwargs or position.get(name, len(args)) < len(args):
                value = kwargs[name] if name in kwargs else args[position[name]]
                if value is not True and value is not False and not (optional and value is None):
                    allowed = "True, False or None" if optional else "True or False"
                    why = " (Python reads any non-empty string as true, 'false' included)" * isinstance(value, str)
                    raise TypeError(f"{name}={value!r}: {function.__qualname__} takes {allowed} only{why}")
        return function(*args, **kwargs)

    return typing.cast(F, checked)
