"""What a saved model's run configs say about where it came from: its base's hub id and its query instructions."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .io import iter_jsonl

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+)--([^/]+)/snapshots/[^/]+/?$")


def is_hub_id(name: str | None) -> bool:
    """``org/name`` that is not a local path."""
    return bool(name) and not os.path.exists(name) and bool(_HUB_ID.match(name))


def hub_id_of(name: str | os.PathLike | None) -> str | None:
    """The hub id ``name`` stands for (itself, or ``org/name`` of a Hugging Face cache snapshot), else None."""
    if not name:
        return None
    name = os.fspath(name)
    if is_hub_id(name):
        return name
    match = _CACHE_SNAPSHOT.search(Path(name).as_posix())
    return f"{match.group(1)}/{match.group(2)}" if match else None


def base_model_hub_id(first_run_config: Mapping[str, Any] | None, fallback: str | None = None) -> str | None:
    """The hub id of the weights a chain of runs started from: the first run's ``base_model_hub_id``, else the hub
    id its ``model_name_or_path`` stands for; ``fallback``'s when no run config is known."""
    if first_run_config:
        recorded = first_run_config.get("base_model_hub_id")
        if recorded:
            return str(recorded) if _HUB_ID.match(str(recorded)) else None
        return hub_id_of(first_run_config.get("model_name_or_path"))
    return hub_id_of(fallback)


class UnknownInstructions(ValueError):
    """The run config does not say which query instructions the run trained with; the message says why."""


def _data_files(run_config: Mapping[str, Any]) -> list[str]:
    recorded = (run_config.get("inputs") or {}).get("data") or {}
    if recorded:
        return sorted(recorded)
    given = run_config.get("dataset_file_path") or ""
    return [p.strip() for p in str(given).split(",") if p.strip()]


def _check_recorded_data(run_config: Mapping[str, Any]) -> None:
    """The data files read here are those the run fingerprinted (``inputs.data``), unchanged; else
    :class:`UnknownInstructions`."""
    from .fingerprints import fingerprint_file

    recorded = (run_config.get("inputs") or {}).get("data") or {}
    for path, then in recorded.items():
        now = fingerprint_file(path) if os.path.isfile(path) else None
        if now is None or any(now.get(k) != v for k, v in then.items() if k in now):
            raise UnknownInstructions(f"the training data file {path} is {'gone' if now is None else 'changed'}")
    for given in _data_files({"dataset_file_path": run_config.get("dataset_file_path")}):
        real = os.path.realpath(given)
        if recorded and os.path.exists(given) and not any(p == real or p.startswith(real + os.sep) for p in recorded):
            raise UnknownInstructions(f"{given}, read from {os.getcwd()}, is not the data the run recorded")


def trained_query_instructions(run_config: Mapping[str, Any]) -> Counter[str]:
    """``instruction -> number of training queries`` of the run (``""``: none): the distinct instructions it recorded
    (``inputs.query_instructions``), else read back from its data while its files are the ones it fingerprinted
    (docs/design.md); :class:`UnknownInstructions` when they cannot be read back."""
    recorded = (run_config.get("inputs") or {}).get("query_instructions")
    if isinstance(recorded, list) and all(isinstance(i, str) for i in recorded):
        return Counter(recorded)
    if run_config.get("query_instructions") is False:
        return Counter({"": 1})
    dataset = run_config.get("dataset_name", "E5")
    if dataset == "E5":
        from .dataset.e5 import E5_SOURCES

        sources = run_config.get("e5_sources") or list(E5_SOURCES)
        unknown = [s for s in sources if s not in E5_SOURCES]
        if unknown:
            raise UnknownInstructions(f"e5_sources {unknown} are not E5 sources of the paper's Table 6")
        return Counter(i for s in sources for i in E5_SOURCES[s].instructions)
    _check_recorded_data(run_config)
    if dataset == "hf":
        from .dataset import DataError
        from .dataset.hf import instruction_counts

        try:
            return instruction_counts(
                str(run_config.get("dataset_file_path") or ""),
                run_config.get("column_map"),
                str(run_config.get("dataset_split") or "train"),
                str(run_config.get("default_instruction") or ""),
            )
        except DataError as e:
            raise UnknownInstructions(f"the training data cannot be read from {os.getcwd()}: {e}") from None
    if dataset != "jsonl":
        raise UnknownInstructions(f"dataset_name {dataset!r}: no rule for its query instructions")
    default = str(run_config.get("default_instruction") or "").strip()
    files = _data_files(run_config)
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise UnknownInstructions(
            f"the training data {missing or files or '(none recorded)'} cannot be read from {os.getcwd()}"
        )
    counts: Counter[str] = Counter()
    for path in files:
        for _, row in iter_jsonl(path, error=UnknownInstructions):
            if row is None:
                continue
            instruction = row.get("instruction")
            counts[instruction.strip() if isinstance(instruction, str) else default] += 1
    return counts
