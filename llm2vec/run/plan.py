"""The owner of a run's ``output_dir``, :class:`RunManager`: the driver calls ``RunManager.open(config)`` (checked,
locked, planned: :func:`plan_run`), ``run.record(schedule, data_files)`` (what it trains with, so that a restart
notices a change) and ``run.train(trainer)``; the rules are ``docs/run_safety.md``'s table."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from accelerate import PartialState

from ..arguments import ConfigError, RunConfig, argument_classes
from ..fingerprints import fingerprint_file, fingerprint_model
from ..io import COMPLETE_MARKER
from .folder import (
    FINAL_SAVE_RECORD,
    RUN_CONFIG_NAME,
    RunFolder,
    checkpoint_problem,
    listed,
    read_json,
    remove_path,
    step_of,
)
from .lock import LOCK_NAME, hold, is_held
from .saves import finalize_from_checkpoint, remove_stale_staging, save_final
from .target import check_apart, check_disk_space, estimate_disk

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


def _file_changes(label: str, old_files: dict[str, dict], new_files: dict[str, dict]) -> list[str]:
    changes = []
    for name in sorted({*old_files, *new_files}):
        old, new = old_files.get(name), new_files.get(name)
        if old is None or new is None:
            changes.append(f"{label} {name} is {'new' if old is None else 'gone'}")
        elif old != new:
            what = [f"size {old.get('size')} -> {new.get('size')} bytes"] if old.get("size") != new.get("size") else []
            if old.get("head_sha256") != new.get("head_sha256"):
                what.append("its first MiB differs")
            elif old.get("sha256") != new.get("sha256"):
                what.append("its SHA-256 differs" if "sha256" in old else "the record has no SHA-256 (an older run's)")
            what += ["modified since"] if old.get("mtime_ns") != new.get("mtime_ns") else []
            changes.append(f"{label} {name}: {', '.join(what) or 'its record differs'}")
    return changes


def input_changes(saved: dict[str, Any], inputs: dict[str, Any], geometry: dict[str, int]) -> list[str]:
    """What differs from the ``saved`` run config's inputs and batch; data files compared by their real paths."""
    old_inputs, old_geometry, changes = saved.get("inputs"), saved.get("batch_geometry"), []
    if isinstance(old_inputs, dict):
        old, new = ({os.path.realpath(p): v for p, v in (i.get("data") or {}).items()} for i in (old_inputs, inputs))
        changes += _file_changes("data file", old, new)
        for key in ("base_model", "adapter"):
            old, new = old_inputs.get(key) or {}, inputs.get(key) or {}
            if old.get("name") != new.get("name"):
                changes.append(f"{key} {old.get('name')} -> {new.get('name')}")
            elif "files" in old and "files" in new:
                changes += _file_changes(f"{key} file", old["files"], new["files"])
    if isinstance(old_geometry, dict):
        changes += [f"{k} {old_geometry.get(k)} -> {v}" for k, v in geometry.items() if old_geometry.get(k) != v]
    return changes


def check_retrieval_folders(saved: dict[str, Any] | None, inputs: dict[str, Any]) -> None:
    """Refuse a resume whose retrieval folder of a name holds other files than its run config ``saved`` recorded."""
    old = ((saved or {}).get("inputs") or {}).get("retrieval") or {}
    for name, now in (inputs.get("retrieval") or {}).items():
        if name in old and (changes := _file_changes("file", old[name].get("files", {}), now["files"])):
            raise ConfigError(
                f"retrieval folder {now['path']} ({name}) is not the one this run evaluated as {name!r} since it "
                f"started ({'; '.join(changes)}): its scores would continue one curve with another folder's. Restore "
                "the folder, or start anew with --overwrite_output_dir true or another output_dir"
            )


def check_schedule(saved: dict[str, Any] | None, schedule, checkpoint: str | None, extending: bool) -> None:
    """A resume keeps the schedule its run config ``saved`` planned (``extending`` a finished run: a warning)."""
    old = (saved or {}).get("lr_schedule") or {}
    for key in schedule.KEPT_ON_RESUME if old else ():
        if old.get(key) != (new := getattr(schedule, key)):
            change = f"{checkpoint} was trained with {key} {old.get(key)!r} but this run plans {new!r}"
            if not extending:
                raise ConfigError(
                    f"resume_from_checkpoint: {change}; resuming would change the learning-rate schedule. Resume "
                    "with the same data, batch, num_train_epochs / max_steps and warm-up, or start a new run"
                )
            logger.warning("continuing a finished run with another learning-rate schedule: %s", change)


def _short(value: Any) -> str:
    return text if len(text := json.dumps(value)) <= 60 else text[:57] + "..."


def check_resume_inputs(saved: dict | None, checkpoint, inputs: dict, geometry: dict, config) -> list[dict[str, Any]]:
    """The ``resumed_with_changes`` record: the ``checkpoint``'s, plus this resume's when its length differs or (with
    ``accept_changed_inputs``, else refused) its inputs, batch or settings do."""
    if not saved:
        return []
    accept, step, new = config.stage.accept_changed_inputs, step_of(checkpoint), config.resolved()
    history, settings, lengths = list(saved.get("resumed_with_changes") or []), {}, {}
    ends = training_end_fields(str(saved.get("stage", "")))
    for key in sorted(set(saved) - NOT_COMPARED - RESUME_FREE_FIELDS):
        if saved[key] != new.get(key):
            (lengths if key in ends else settings)[key] = {"before": saved[key], "after": new.get(key)}
    changed = lambda fields: [f"{k} {_short(v['before'])} -> {_short(v['after'])}" for k, v in fields.items()]  # noqa: E731
    changes = changed(settings) + input_changes(saved, inputs, geometry)
    if not changes and not lengths:
        return history
    summary = "; ".join(changes[:6]) + (f"; {len(changes) - 6} more" if len(changes) > 6 else "")
    if changes and not accept:
        raise ConfigError(
            f"resume_from_checkpoint {checkpoint}: what it was trained with changed since it was saved ({summary}); "
            "pass --accept_changed_inputs true to continue anyway"
        )
    if changes:
        logger.warning("accept_changed_inputs: resuming %s at step %d although %s", checkpoint, step, summary)
    changes += changed(lengths)
    before = {"inputs": saved.get("inputs"), "batch_geometry": saved.get("batch_geometry")}
    entry = {"step": step, "from_step": step + 1, "checkpoint": str(checkpoint), "changes": changes}
    return history + [{**entry, "settings": {**settings, **lengths}, "before": before}]


def plan_run(config: RunConfig) -> RunManager:
    """What this run does with its ``output_dir``, deciding and writing nothing else; or :class:`ConfigError`."""
    args, stage = config.training, config.stage.stage
    folder, where = RunFolder.inspect(args.output_dir), f"output_dir {args.output_dir}"
    resume, overwrite = args.resume_from_checkpoint, config.stage.overwrite_output_dir  # None, True or a folder
    plan, saved, (foreign, clashing) = RunManager(config, folder), folder.saved_config(), folder.foreign_files()
    if foreign and not overwrite:
        raise ConfigError(
            f"{where} holds files this run did not write ({listed(foreign)}); move them, or pass "
            "--overwrite_output_dir true to write beside them"
        )
    if clashing:
        raise ConfigError(
            f"{where} holds {listed(clashing)}, which no run wrote there but which this run would write over"
        )
    if foreign:
        logger.warning("writing into %s beside files the run did not write (kept): %s", where, ", ".join(foreign))
    diffs = config_differences(saved, config.resolved()) if saved else []
    differs = f"its {RUN_CONFIG_NAME} " + (
        f"differs from this config in: {'; '.join(diffs)}" if diffs else "equals this config" if saved else "is missing"
    )
    if resume is None:
        if folder.holds_run and not overwrite:
            raise ConfigError(
                f"{where} already holds {folder.describe()}; {differs}. Pass --resume_from_checkpoint true to continue "
                "it or --overwrite_output_dir true to replace it"
            )
        plan.clear = folder.holds_run
    elif (saved or {}).get("stage", stage) != stage:
        raise ConfigError(f"{where} holds {folder.describe()}, but this is a Stage {stage} config")
    elif resume is True:
        _plan_resume(plan, where, overwrite, saved, f" ({differs})" if diffs else "")
    else:
        _plan_checkpoint(plan, resume, where, overwrite)
    PartialState().wait_for_everyone()
    return plan


def _plan_resume(plan: RunManager, where: str, overwrite: bool, saved: dict | None, differs: str) -> None:
    """``--resume_from_checkpoint true``: nothing to do (finished, same length), or the newest intact checkpoint."""
    folder, stage = plan.folder, plan.config.stage.stage
    if overwrite:
        raise ConfigError("pass only one of --resume_from_checkpoint true and --overwrite_output_dir true")
    for c in (c for c in folder.checkpoints if c.problem):
        logger.warning("%s is incomplete (%s): skipped", c.path, c.problem)
    if folder.finished:
        step = folder.marker.get("global_step")
        if end_values(saved or {}, stage) == end_values(plan.config.resolved(), stage):
            plan.finished_message = (
                f"{where} holds a finished Stage {stage} run (step {step}) of the same training length{differs}: "
                "nothing to do"
            )
            return logger.info(plan.finished_message)
        if folder.newest is None:
            raise ConfigError(f"{where} holds a finished Stage {stage} run (step {step}) but no complete checkpoint")
        plan.continue_past = step if isinstance(step, int) else None
    elif folder.newest is None:
        held = f" ({folder.describe()})" if folder.holds_run else ""
        raise ConfigError(f"resume_from_checkpoint is true but {folder.path} holds no complete checkpoint{held}")
    for checkpoint in reversed(folder.complete):
        if (problem := checkpoint_problem(checkpoint.path, contents=True)) is None:
            return _resume_from(plan, str(checkpoint.path))
        logger.warning("%s: %s; skipped", checkpoint.path, problem)
    raise ConfigError(f"{where}: no checkpoint holds what it held when saved")


def without_resume(config: RunConfig, way_out: str) -> str | None:
    """For a trainer that does not resume: ``None``, "nothing to do", or :class:`ConfigError` naming ``way_out``."""
    out = config.training.output_dir
    if config.stage.overwrite_output_dir or not os.path.isdir(out) or is_held(Path(out) / LOCK_NAME):
        return None
    folder, stage = RunFolder.inspect(out), config.stage.stage
    if not folder.holds_run:
        return None
    if folder.finished and end_values(folder.saved_config() or {}, stage) == end_values(config.resolved(), stage):
        step = folder.marker.get("global_step")
        return f"output_dir {out} holds this Stage {stage} run finished (step {step}): nothing to do ({way_out})"
    raise ConfigError(f"output_dir {out} holds {folder.describe()}; {way_out}")


def _plan_checkpoint(plan: RunManager, resume: str, where: str, overwrite: bool) -> None:
    """``--resume_from_checkpoint <folder>``, if intact; what lies beyond it is replaced only with ``overwrite``."""
    if problem := checkpoint_problem(resume, contents=True):
        newest = RunFolder.inspect(Path(resume).parent).newest
        newest = f"; newest complete: {newest.path}" if newest else ""
        raise ConfigError(f"resume_from_checkpoint {resume}: {problem}; it is incomplete or changed{newest}")
    _resume_from(plan, resume)
    folder, step = plan.folder, step_of(resume)
    inside = Path(resume).resolve().parent == folder.path.resolve()
    later = [c for c in folder.checkpoints if not inside or c.step > step]
    if folder.finished or later or (not inside and folder.model_files):
        if not overwrite:
            what = f"checkpoints beyond step {step} ({', '.join(c.path.name for c in later)})"
            what = folder.describe() if folder.finished or not inside else what
            raise ConfigError(f"{where} holds {what}; pass --overwrite_output_dir true to replace them")
        plan.clear, plan.keep_up_to = True, step if inside else None


def _resume_from(plan: RunManager, checkpoint: str) -> None:
    """Resume from ``checkpoint``, unless it is the other stage's (by its run config, else its weights)."""
    folder, stage = Path(checkpoint), plan.config.stage.stage
    adapter = (folder / "adapter_model.safetensors").is_file()
    full = any((folder / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json"))
    saved = (read_json(folder / RUN_CONFIG_NAME) or {}).get("stage") or ("II" if adapter else "I" if full else None)
    if saved and str(saved) != stage:
        raise ConfigError(
            f"resume_from_checkpoint {checkpoint}: a Stage {saved} checkpoint, but this is a Stage {stage} config; "
            f"resume it with run_stage_{saved}.py"
        )
    plan.resume_from = checkpoint


@dataclass
class RunManager:
    """What a run does with its ``output_dir``: made by :meth:`open`, then :meth:`record` and :meth:`train`."""

    config: RunConfig
    folder: RunFolder
    resume_from: str | None = None
    finished_message: str | None = None  # set when there is nothing to do
    continue_past: int | None = None  # continuing a finished run: the step it ended at
    clear: bool = False  # --overwrite_output_dir: delete the old run (after the disk check)
    keep_up_to: int | None = None  # ... but keep the checkpoints up to this step (the one resumed from)
    schedule: Any = None  # the run's llm2vec.schedule.SchedulePlan, handed over by record()

    @classmethod
    @contextlib.contextmanager
    def open(cls, config: RunConfig) -> Iterator[RunManager]:
        """Check ``output_dir`` (writable, unless done already), hold its lock in the block, plan the run there."""
        args, out = config.training, config.training.output_dir
        check_apart(out, run_inputs(config))
        try:  # writable
            os.makedirs(out, exist_ok=True)
            tempfile.TemporaryFile(dir=out, prefix=".write-test.", suffix=".tmp").close()
        except OSError as e:
            finished = plan_run(config) if RunFolder.inspect(out).finished else None
            if finished is None or not finished.finished:
                raise ConfigError(
                    f"output_dir {out}: cannot write there ({e.strerror or e}); choose a folder you can write to"
                ) from None
            yield finished
            return
        with hold(out, is_main=args.process_index == 0):
            yield plan_run(config)

    @property
    def finished(self) -> bool:
        return self.finished_message is not None

    def record(self, schedule, data_files: list[str], retrieval=None) -> dict[str, Any]:
        """The run config saved with every save: its inputs' fingerprints (data files by real path, ``retrieval``'s
        folders by name) and batch geometry; refuses a resume whose schedule or inputs changed."""
        config, args, self.schedule = self.config, self.config.training, schedule
        saved = read_json(Path(self.resume_from) / RUN_CONFIG_NAME) if self.resume_from else None
        check_schedule(saved, schedule, self.resume_from, extending=self.continue_past is not None)
        found = {
            "data": {p: fingerprint_file(p) for p in sorted({os.path.realpath(p) for p in data_files})},
            "base_model": fingerprint_model(config.model.model_name_or_path),
            "adapter": fingerprint_model(getattr(config.stage, "peft_model_name_or_path", None)),
            "retrieval": {
                f.name: {
                    "path": os.path.realpath(f.data.path),
                    "files": {n: {"sha256": h} for n, h in f.data.file_sha256.items()},
                }
                for f in (retrieval.folders if retrieval else [])
            },
        }
        check_retrieval_folders(saved, found)
        geometry = {"per_device_train_batch_size": args.per_device_train_batch_size, "processes": args.world_size}
        geometry |= {"gradient_accumulation_steps": args.gradient_accumulation_steps}
        geometry |= {"global_batch_size": config.global_batch_size}
        resumed = check_resume_inputs(saved, self.resume_from, found, geometry, config)
        extra = {"lr_schedule": schedule.as_dict(), "inputs": found, "batch_geometry": geometry}
        return {**config.resolved(), **extra, "resumed_with_changes": resumed}

    def train(self, trainer) -> None:
        """Check the plan's end and the disk space, clear what an overwrite replaces, train, save the final model."""
        args, stage, folder = self.config.training, self.config.stage.stage, self.folder
        per_epoch, end = self.schedule.global_batches_per_epoch, self.schedule.stop_step
        values = end_values(self.config.resolved(), stage)
        ends_at = ", ".join(f"{k} {v}" for k, v in values.items())
        start = step_of(self.resume_from) if self.resume_from else 0
        if self.continue_past is not None and end <= self.continue_past:
            raise ConfigError(
                f"output_dir {args.output_dir} holds a finished Stage {stage} run that ended at step "
                f"{self.continue_past}; this config ends at step {end} ({ends_at})"
            )
        if self.resume_from is not None and start > end:
            raise ConfigError(
                f"resume_from_checkpoint {self.resume_from}: step {start} is past the end of this config ({end})"
            )
        old = [folder.path / COMPLETE_MARKER, *folder.model_files, folder.path / FINAL_SAVE_RECORD]
        old += [c.path for c in folder.checkpoints if self.keep_up_to is None or c.step > self.keep_up_to]
        clear = [p for p in dict.fromkeys(old) if p.exists()] if self.clear else []
        check_disk_space(args.output_dir, estimate_disk(args, trainer.model, start, end, per_epoch), freed=clear)
        if args.should_save:
            if clear:
                names = ", ".join(p.name for p in clear)
                logger.warning("overwrite_output_dir: removing the previous run's %s from %s", names, args.output_dir)
            for path in clear:
                remove_path(path)
            remove_stale_staging(args.output_dir)
        PartialState().wait_for_everyone()
        if self.resume_from is not None and start == end:
            finalize_from_checkpoint(trainer, self.resume_from, values)
        else:
            trainer.train(resume_from_checkpoint=self.resume_from)
            save_final(trainer, values)
