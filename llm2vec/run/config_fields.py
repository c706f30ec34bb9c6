"""Which fields of a run config a restarted run compares with the saved ``run_config.json`` (:func:`config_differences`:
all but those that say where or how a run is launched, :data:`NOT_COMPARED`), and which decide where training ends
(:func:`training_end_fields`, recorded in the completion marker by :func:`end_values`).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from typing import Any

from ..arguments import argument_classes

# The fields that decide where training ends; a field added later is found by its metadata ``ends_training`` too.
# Its value is read as "stop after this many optimizer steps" when it is a positive int.
TRAINING_END_FIELDS = ("max_steps", "num_train_epochs", "stop_after_n_steps")
# Fields that say where or how a run is launched, not what it trains: left out of config comparisons.
NOT_COMPARED = (
    *("output_dir", "resume_from_checkpoint", "overwrite_output_dir", "accept_changed_inputs", "accept_other_base"),
    *("config_file", "lr_schedule", "inputs", "batch_geometry", "resumed_with_changes"),
)  # lr_schedule: derived from the compared fields and the data; inputs and batch: llm2vec.run.inputs


def config_differences(saved: dict[str, Any], new: dict[str, Any], limit: int = 8) -> list[str]:
    """``field old -> new`` for each compared field whose value differs (at most ``limit``, then a count)."""
    keys = sorted((set(saved) | set(new)) - set(NOT_COMPARED))
    diffs = [f"{k} {json.dumps(saved.get(k))} -> {json.dumps(new.get(k))}" for k in keys if saved.get(k) != new.get(k)]
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"{len(diffs) - limit} more"]
    return diffs


def _defaults(stage: str) -> dict[str, Any]:
    out = {}
    for cls in argument_classes(stage):
        for f in fields(cls):
            if f.default is not MISSING:
                out[f.name] = f.default
            elif f.default_factory is not MISSING:
                out[f.name] = f.default_factory()
    return out


def training_end_fields(stage: str) -> tuple[str, ...]:
    """:data:`TRAINING_END_FIELDS` and the stage's fields whose metadata says ``ends_training``, those that exist."""
    defaults = _defaults(stage)
    tagged = [f.name for cls in argument_classes(stage) for f in fields(cls) if f.metadata.get("ends_training")]
    return tuple(name for name in dict.fromkeys([*TRAINING_END_FIELDS, *tagged]) if name in defaults)


def end_values(config: dict[str, Any], stage: str) -> dict[str, Any]:
    """The training-length fields of a resolved config; a field it lacks has its default."""
    defaults = _defaults(stage)
    return {name: config.get(name, defaults[name]) for name in training_end_fields(stage)}
