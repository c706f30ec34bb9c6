"""What a run trained on, recorded in ``run_config.json`` so that a resume notices when it changed: ``inputs`` (a
fingerprint of every data file and every file of the base model and adapter folders, :mod:`llm2vec.fingerprints`; a hub
id not in the local cache by name), ``batch_geometry`` and ``resumed_with_changes`` (one entry per resume that changed
what the run trains with: the step from which it holds, what differed, the values before).

:func:`check_resume_inputs` compares a checkpoint's record with the resuming run's inputs, batch and training settings
(all fields but those that only say how a run is launched, logged, saved or evaluated, :data:`RESUME_FREE_FIELDS`,
and the training length, which a resume may change). A difference is refused unless ``accept_changed_inputs``, which
logs and records it. :func:`run_inputs` lists what a run reads, for :func:`llm2vec.run.checks.check_apart`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..arguments import ConfigError
from ..fingerprints import fingerprint_file, fingerprint_model
from .config_fields import NOT_COMPARED, training_end_fields

logger = logging.getLogger("llm2vec")


def fingerprints(config, data_files: list[str]) -> dict[str, Any]:
    """The ``inputs`` record of a run: its data files, its base model and (Stage II) the adapter it merges."""
    return {
        "data": {str(p): fingerprint_file(p) for p in sorted(set(map(str, data_files)))},
        "base_model": fingerprint_model(config.model.model_name_or_path),
        "adapter": fingerprint_model(getattr(config.stage, "peft_model_name_or_path", None)),
    }


def run_inputs(config) -> list[tuple[str, str | None]]:
    """``(label, path)`` of everything a run reads (an hf dataset id names no path; check_apart leaves it out)."""
    data = config.data
    paths = [p.strip() for p in data.dataset_file_path.split(",") if p.strip()] if data.dataset_name != "E5" else []
    return [
        ("base model", config.model.model_name_or_path),
        ("adapter", getattr(config.stage, "peft_model_name_or_path", None)),
        *[("data file", p) for p in paths],
        *([("data folder", data.dataset_file_path)] if data.dataset_name == "E5" and data.dataset_file_path else []),
        ("validation file", data.validation_file),
        *[("retrieval folder", d) for d in data.retrieval_eval_dirs or []],
    ]


# Fields a resume may change without --accept_changed_inputs: how the run is launched, logged, saved or evaluated, or
# compared elsewhere (paths as ``inputs``, the batch as ``batch_geometry``, length and schedule by plan and schedule).
RESUME_FREE_FIELDS = frozenset(
    {
        # logging and reporting
        *("logging_steps", "logging_strategy", "logging_first_step", "logging_nan_inf_filter", "log_level"),
        *("log_level_replica", "log_on_each_node", "disable_tqdm", "report_to", "run_name", "project"),
        *("trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "skip_memory_metrics"),
        *("include_num_input_tokens_seen", "metrics_file", "stop_after_minutes"),
        # saving
        *("save_steps", "save_strategy", "save_total_limit", "save_on_each_node", "save_only_model"),
        *("push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push"),
        "hub_revision",
        # evaluation on held-out pairs (never trained on)
        *("eval_steps", "eval_strategy", "eval_delay", "eval_on_start", "per_device_eval_batch_size"),
        *("eval_accumulation_steps", "eval_do_concat_batches", "eval_use_gather_object", "batch_eval_metrics"),
        *("prediction_loss_only", "include_for_metrics", "validation_file", "do_eval", "do_predict", "do_train"),
        *("bf16_full_eval", "fp16_full_eval", "retrieval_eval_dirs", "retrieval_eval_instruction"),
        "retrieval_eval_instructions",
        # processes and workers (the batch they make is batch_geometry)
        *("world_size", "local_rank", "num_threads", "dataloader_num_workers", "dataloader_pin_memory"),
        *("dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context"),
        *("ddp_backend", "ddp_timeout", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_find_unused_parameters"),
        *("ddp_static_graph", "torch_empty_cache_steps", "debug", "trust_remote_code"),
        # compared as inputs (the files) and batch_geometry
        *("model_name_or_path", "peft_model_name_or_path", "dataset_file_path"),
        *("per_device_train_batch_size", "gradient_accumulation_steps", "total_batch_size"),
    }
)


def setting_changes(saved: dict[str, Any], new: dict[str, Any], stage: str) -> tuple[dict, dict]:
    """``{field: {"before", "after"}}`` of the compared fields that differ between a checkpoint's run config and this
    run's: those that need ``accept_changed_inputs``, and the training-length ones (recorded, never refused)."""
    ends = set(training_end_fields(stage))
    changed, lengths = {}, {}
    for key in sorted((set(saved) | set(new)) - set(NOT_COMPARED) - RESUME_FREE_FIELDS):
        if saved.get(key) != new.get(key) and key in saved:  # a field the checkpoint's version did not have: new
            (lengths if key in ends else changed)[key] = {"before": saved.get(key), "after": new.get(key)}
    return changed, lengths


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


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_resume_inputs(
    checkpoint: str | None,
    saved: dict[str, Any] | None,
    inputs: dict,
    geometry: dict,
    accept: bool,
    step: int,
    config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The ``resumed_with_changes`` record of this run: the checkpoint's, plus an entry for this resume when its inputs,
    batch or settings (``config`` against ``saved``) differ and ``accept``, or only its training length differs.
    Raises :class:`ConfigError` naming every difference otherwise. The changes hold from the step after ``step``."""
    if checkpoint is None or not saved:
        return []
    history = list(saved.get("resumed_with_changes") or [])
    settings, lengths = setting_changes(saved, config, str(saved.get("stage", ""))) if config else ({}, {})
    described = [f"{k} {_short(v['before'])} -> {_short(v['after'])}" for k, v in settings.items()]
    changes = described + input_changes(saved, inputs, geometry)
    if not changes and not lengths:
        return history
    listed = "; ".join(changes[:6]) + (f"; {len(changes) - 6} more" if len(changes) > 6 else "")
    if changes and not accept:
        raise ConfigError(
            f"resume_from_checkpoint {checkpoint}: what it was trained with changed since it was saved ({listed}). "
            "Resume with the same settings, data, model and batch, start a new run, or pass "
            "--accept_changed_inputs true to continue anyway (run_config.json and the model card then record each "
            "change and the step it took effect)"
        )
    if changes:
        logger.warning("accept_changed_inputs: resuming %s at step %d although %s", checkpoint, step, listed)
    changes += [f"{k} {_short(v['before'])} -> {_short(v['after'])}" for k, v in lengths.items()]
    previous = {"inputs": saved.get("inputs"), "batch_geometry": saved.get("batch_geometry")}
    entry = {
        "step": step,
        "from_step": step + 1,
        "checkpoint": str(checkpoint),
        "changes": changes,
        "settings": {**settings, **lengths},
        "before": previous,
    }
    return history + [entry]
