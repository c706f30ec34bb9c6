"""What a run trained on, recorded so that a resume notices when it changed.

Each run saves in ``run_config.json`` (beside every checkpoint and the final model):

- ``inputs``: a fingerprint of every data file it read and of every file of its base model folder (and, in
  Stage II, of the adapter it merges): size, modification time and the SHA-256 of the first MiB. A hub id
  that is not in the local cache is recorded by name only;
- ``batch_geometry``: per-device batch, processes, gradient accumulation and the global batch;
- ``resumed_with_changes``: one entry per resume that accepted changed inputs (the step, the checkpoint and
  what differed), so the record keeps both the old and the new values.

:func:`check_resume_inputs` compares a checkpoint's record with the resuming run's: a difference is refused
with what differs, unless ``accept_changed_inputs`` is true, in which case it is logged and recorded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from ..arguments import ConfigError

logger = logging.getLogger("llm2vec")

HEAD_BYTES = 1 << 20


def fingerprint_file(path: str | os.PathLike) -> dict[str, Any]:
    """Size, modification time (ns) and SHA-256 of the first MiB of ``path``."""
    stat = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head_sha256": head}


def _model_folder(name: str) -> Path | None:
    if os.path.isdir(name):
        return Path(name)
    try:  # a hub id: its snapshot in the local cache, if there is one
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a hub id: recorded by name only
        return None


def fingerprint_model(name: str | None) -> dict[str, Any] | None:
    """``{"name", "files": {file: fingerprint}}`` of a model folder or cached hub snapshot (top-level files;
    the model card aside, which a save may rewrite); ``{"name"}`` alone when it cannot be found locally."""
    if not name:
        return None
    folder = _model_folder(str(name))
    if folder is None:
        return {"name": str(name)}
    files = {
        p.name: fingerprint_file(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.name.startswith(".") and p.name != "README.md"
    }
    return {"name": str(name), "files": files}


def fingerprints(config, data_files: list[str]) -> dict[str, Any]:
    """The ``inputs`` record of a run: its data files, its base model and (Stage II) the adapter it merges."""
    return {
        "data": {str(p): fingerprint_file(p) for p in sorted(set(map(str, data_files)))},
        "base_model": fingerprint_model(config.model.model_name_or_path),
        "adapter": fingerprint_model(getattr(config.stage, "peft_model_name_or_path", None)),
    }


def batch_geometry(config) -> dict[str, int]:
    args = config.training
    return {
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "processes": args.world_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "global_batch_size": config.global_batch_size,
    }


def _when(ns: int | None) -> str:
    return "?" if ns is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


def _file_change(label: str, old: dict | None, new: dict | None) -> str | None:
    if old == new:
        return None
    if old is None:
        return f"{label} is new"
    if new is None:
        return f"{label} is gone"
    what = []
    if old.get("size") != new.get("size"):
        what.append(f"size {old.get('size')} -> {new.get('size')} bytes")
    if old.get("head_sha256") != new.get("head_sha256"):
        what.append("its first MiB differs")
    if old.get("mtime_ns") != new.get("mtime_ns"):
        what.append(f"modified {_when(old.get('mtime_ns'))} -> {_when(new.get('mtime_ns'))}")
    return f"{label}: {', '.join(what)}"


def input_changes(saved: dict[str, Any], inputs: dict[str, Any], geometry: dict[str, int]) -> list[str]:
    """What differs between a checkpoint's ``run_config.json`` (``saved``) and this run's inputs and batch."""
    changes = []
    old_inputs = saved.get("inputs")
    if isinstance(old_inputs, dict):
        old_data, new_data = old_inputs.get("data") or {}, inputs.get("data") or {}
        for path in sorted(set(old_data) | set(new_data)):
            change = _file_change(f"data file {path}", old_data.get(path), new_data.get(path))
            if change:
                changes.append(change)
        for key in ("base_model", "adapter"):
            old, new = old_inputs.get(key) or {}, inputs.get(key) or {}
            if old.get("name") != new.get("name"):
                changes.append(f"{key} {old.get('name')} -> {new.get('name')}")
                continue
            if "files" not in old or "files" not in new:
                continue
            for name in sorted(set(old["files"]) | set(new["files"])):
                change = _file_change(f"{key} file {name}", old["files"].get(name), new["files"].get(name))
                if change:
                    changes.append(change)
    old_geometry = saved.get("batch_geometry")
    if isinstance(old_geometry, dict):
        for key, value in geometry.items():
            if old_geometry.get(key) != value:
                changes.append(f"{key} {old_geometry.get(key)} -> {value}")
    return changes


def check_resume_inputs(
    checkpoint: str | None, saved: dict[str, Any] | None, inputs: dict, geometry: dict, accept: bool, step: int
) -> list[dict[str, Any]]:
    """The ``resumed_with_changes`` record of this run: the checkpoint's, plus an entry for this resume when
    its inputs or batch differ and ``accept`` is true; raises :class:`ConfigError` naming every difference
    when they differ and ``accept`` is false."""
    if checkpoint is None or not saved:
        return []
    history = list(saved.get("resumed_with_changes") or [])
    changes = input_changes(saved, inputs, geometry)
    if not changes:
        return history
    listed = "; ".join(changes[:6]) + (f"; {len(changes) - 6} more" if len(changes) > 6 else "")
    if not accept:
        raise ConfigError(
            f"resume_from_checkpoint {checkpoint}: the inputs changed since it was saved ({listed}). Resume with "
            "the same data, model and batch, start a new run, or pass --accept_changed_inputs true to continue "
            "anyway (run_config.json then records the change)"
        )
    logger.warning("accept_changed_inputs: resuming %s at step %d although %s", checkpoint, step, listed)
    previous = {"inputs": saved.get("inputs"), "batch_geometry": saved.get("batch_geometry")}
    return history + [{"step": step, "checkpoint": str(checkpoint), "changes": changes, "before": previous}]
