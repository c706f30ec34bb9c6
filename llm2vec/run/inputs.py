"""What a run trained with, recorded in ``run_config.json`` so that a restart notices a change: the compared fields,
the training-length fields, the input fingerprints and batch geometry, and the record of resumes that changed them."""

from __future__ import annotations

import json
import logging
from dataclasses import MISSING, fields
from typing import Any

from ..arguments import ConfigError, argument_classes
from ..fingerprints import fingerprint_file, fingerprint_model

logger = logging.getLogger("llm2vec")

TRAINING_END_FIELDS = ("max_steps", "num_train_epochs", "stop_after_n_steps")
# Where or how a run is launched, not what it trains (lr_schedule, inputs and batch are compared apart).
NOT_COMPARED = frozenset(
    "output_dir resume_from_checkpoint overwrite_output_dir accept_changed_inputs accept_other_base config_file "
    "lr_schedule inputs batch_geometry resumed_with_changes".split()
)
# What a resume may change without accept_changed_inputs: how it is launched, logged, saved, evaluated, spread.
RESUME_FREE_FIELDS = frozenset(
    """logging_steps logging_strategy logging_first_step logging_nan_inf_filter log_level log_level_replica
    log_on_each_node disable_tqdm report_to run_name project trackio_space_id trackio_bucket_id trackio_static_space_id
    skip_memory_metrics include_num_input_tokens_seen metrics_file stop_after_minutes
    save_steps save_strategy save_total_limit save_on_each_node save_only_model push_to_hub hub_model_id hub_strategy
    hub_token hub_private_repo hub_always_push hub_revision
    eval_steps eval_strategy eval_delay eval_on_start per_device_eval_batch_size eval_accumulation_steps
    eval_do_concat_batches eval_use_gather_object batch_eval_metrics prediction_loss_only include_for_metrics
    validation_file do_eval do_predict do_train bf16_full_eval fp16_full_eval retrieval_eval_dirs
    retrieval_eval_instruction retrieval_eval_instructions
    world_size local_rank num_threads dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers
    dataloader_prefetch_factor dataloader_multiprocessing_context ddp_backend ddp_timeout ddp_bucket_cap_mb
    ddp_broadcast_buffers ddp_find_unused_parameters ddp_static_graph torch_empty_cache_steps debug trust_remote_code
    model_name_or_path peft_model_name_or_path dataset_file_path
    per_device_train_batch_size gradient_accumulation_steps total_batch_size""".split()
)


def config_differences(saved: dict[str, Any], new: dict[str, Any], limit: int = 8) -> list[str]:
    keys = sorted((set(saved) | set(new)) - NOT_COMPARED)
    diffs = [f"{k} {json.dumps(saved.get(k))} -> {json.dumps(new.get(k))}" for k in keys if saved.get(k) != new.get(k)]
    return diffs[:limit] + [f"{len(diffs) - limit} more"] if len(diffs) > limit else diffs


def training_end_fields(stage: str) -> dict[str, Any]:
    """The stage's fields that decide where training ends (named, or ``ends_training`` metadata), with defaults."""
    defaults, tagged = {}, []
    for f in (f for cls in argument_classes(stage) for f in fields(cls)):
        if f.default is not MISSING or f.default_factory is not MISSING:
            defaults[f.name] = f.default if f.default is not MISSING else f.default_factory()
        tagged += [f.name] if f.metadata.get("ends_training") else []
    return {name: defaults[name] for name in dict.fromkeys([*TRAINING_END_FIELDS, *tagged]) if name in defaults}


def end_values(config: dict[str, Any], stage: str) -> dict[str, Any]:
    return {name: config.get(name, default) for name, default in training_end_fields(stage).items()}


def fingerprints(config, data_files: list[str]) -> dict[str, Any]:
    return {
        "data": {str(p): fingerprint_file(p) for p in sorted(set(map(str, data_files)))},
        "base_model": fingerprint_model(config.model.model_name_or_path),
        "adapter": fingerprint_model(getattr(config.stage, "peft_model_name_or_path", None)),
    }


def run_inputs(config) -> list[tuple[str, str | None]]:
    """``(label, path)`` of everything a run reads."""
    data, e5 = config.data, config.data.dataset_name == "E5"
    paths = [] if e5 else [p.strip() for p in data.dataset_file_path.split(",") if p.strip()]
    return [
        ("base model", config.model.model_name_or_path),
        ("adapter", getattr(config.stage, "peft_model_name_or_path", None)),
        *[("data file", p) for p in paths],
        *([("data folder", data.dataset_file_path)] if e5 and data.dataset_file_path else []),
        ("validation file", data.validation_file),
        *[("retrieval folder", d) for d in data.retrieval_eval_dirs or []],
    ]


def batch_geometry(config) -> dict[str, int]:
    args = config.training
    return {
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "processes": args.world_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "global_batch_size": config.global_batch_size,
    }


def _file_change(label: str, old: dict | None, new: dict | None) -> str | None:
    if old == new or old is None or new is None:
        return None if old == new else f"{label} is {'new' if old is None else 'gone'}"
    what = [f"size {old.get('size')} -> {new.get('size')} bytes"] if old.get("size") != new.get("size") else []
    if old.get("head_sha256") != new.get("head_sha256"):
        what.append("its first MiB differs")
    elif old.get("sha256") != new.get("sha256"):
        what.append("its SHA-256 differs")
    what += ["modified since"] if old.get("mtime_ns") != new.get("mtime_ns") else []
    return f"{label}: {', '.join(what) or 'its record differs'}"


def input_changes(saved: dict[str, Any], inputs: dict[str, Any], geometry: dict[str, int]) -> list[str]:
    old_inputs, old_geometry, changes = saved.get("inputs"), saved.get("batch_geometry"), []
    if isinstance(old_inputs, dict):
        old_data, new_data = old_inputs.get("data") or {}, inputs.get("data") or {}
        changes += [
            _file_change(f"data file {p}", old_data.get(p), new_data.get(p)) for p in sorted({*old_data, *new_data})
        ]
        for key in ("base_model", "adapter"):
            old, new = old_inputs.get(key) or {}, inputs.get(key) or {}
            if old.get("name") != new.get("name"):
                changes.append(f"{key} {old.get('name')} -> {new.get('name')}")
            elif "files" in old and "files" in new:
                names = sorted({*old["files"], *new["files"]})
                changes += [_file_change(f"{key} file {n}", old["files"].get(n), new["files"].get(n)) for n in names]
    if isinstance(old_geometry, dict):
        changes += [f"{k} {old_geometry.get(k)} -> {v}" for k, v in geometry.items() if old_geometry.get(k) != v]
    return [c for c in changes if c]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_resume_inputs(
    checkpoint: str | None, saved: dict | None, inputs: dict, geometry: dict, accept: bool, step: int, config: dict
) -> list[dict[str, Any]]:
    """The ``resumed_with_changes`` record: the checkpoint's, plus an entry for this resume when its training length
    differs or (with ``accept``, else refused) its inputs, batch or settings do."""
    if checkpoint is None or not saved:
        return []
    history, settings, lengths = list(saved.get("resumed_with_changes") or []), {}, {}
    ends = training_end_fields(str(saved.get("stage", "")))
    for key in sorted(set(saved) - NOT_COMPARED - RESUME_FREE_FIELDS):
        if saved[key] != config.get(key):
            (lengths if key in ends else settings)[key] = {"before": saved[key], "after": config.get(key)}
    changed = lambda fields: [f"{k} {_short(v['before'])} -> {_short(v['after'])}" for k, v in fields.items()]  # noqa: E731
    changes = changed(settings) + input_changes(saved, inputs, geometry)
    if not changes and not lengths:
        return history
    listed = "; ".join(changes[:6]) + (f"; {len(changes) - 6} more" if len(changes) > 6 else "")
    if changes and not accept:
        raise ConfigError(
            f"resume_from_checkpoint {checkpoint}: what it was trained with changed since it was saved ({listed}); "
            "pass --accept_changed_inputs true to continue anyway"
        )
    if changes:
        logger.warning("accept_changed_inputs: resuming %s at step %d although %s", checkpoint, step, listed)
    changes += changed(lengths)
    before = {"inputs": saved.get("inputs"), "batch_geometry": saved.get("batch_geometry")}
    entry = {"step": step, "from_step": step + 1, "checkpoint": str(checkpoint), "changes": changes}
    return history + [{**entry, "settings": {**settings, **lengths}, "before": before}]
