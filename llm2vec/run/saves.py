"""Complete-or-absent saves: staged in a hidden folder, renamed into place, the manifest or completion marker (each
file's size and SHA-256) last; a kill leaves only staging; a user's file in the way becomes ``<name>.before-run``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..io import COMPLETE_MARKER, atomic_write, file_record, record_problem
from .folder import (
    CHECKPOINT_MANIFEST,
    FINAL_SAVE_RECORD,
    RUN_CONFIG_NAME,
    TRAINER_STATE_NAME,
    TRAINING_STATE_FILES,
    CheckpointError,
    checkpoints_of,
    own_names,
    read_json,
    remove_path,
)

logger = logging.getLogger("llm2vec")

FINAL_STAGING = ".final-model.staging.tmp"


def _written(folder: Path) -> list[str]:
    if links := [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_symlink()]:
        raise CheckpointError(f"{folder}: {links[0]} is a link, which no save writes; nothing was published")
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def remove_stale_staging(output_dir: str | os.PathLike) -> None:
    for stale in [*Path(output_dir).glob(".checkpoint-*.tmp"), Path(output_dir) / FINAL_STAGING]:
        shutil.rmtree(stale, ignore_errors=True)


def _fsync(path: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _staged(trainer, root: Path, folder: Path, publish) -> Iterator[Path]:
    """The saving process empties ``root`` and makes ``folder`` in it; the block writes into ``folder``; then the
    saving process runs ``publish``, and ``root`` is removed, published or not. Every process waits at each step."""
    saver = trainer.args.should_save
    if saver:
        shutil.rmtree(root, ignore_errors=True)
        folder.mkdir(parents=True)
    trainer.accelerator.wait_for_everyone()
    try:
        yield folder
        trainer.accelerator.wait_for_everyone()
        if saver:
            publish()
    finally:
        if saver:
            shutil.rmtree(root, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()


@contextlib.contextmanager
def staged_checkpoint(trainer) -> Iterator[Path]:
    """Weights checked finite, the Trainer saves ``checkpoint-<step>`` into a staging ``args.output_dir``, published."""
    trainer.check_weights_finite(f"checkpoint-{trainer.state.global_step} was not written")
    before = trainer.args.output_dir
    run_dir, name = Path(before), f"checkpoint-{trainer.state.global_step}"
    staging = run_dir / f".{name}.staging.tmp"
    with _staged(trainer, staging, staging, lambda: _publish_checkpoint(trainer, staging / name, run_dir)):
        trainer.args.output_dir = str(staging)
        try:
            yield staging
        finally:
            trainer.args.output_dir = before


def _publish_checkpoint(trainer, staged: Path, run_dir: Path) -> None:
    target = run_dir / staged.name
    record = {"global_step": trainer.state.global_step, **file_record(staged, _written(staged))}
    with atomic_write(staged / CHECKPOINT_MANIFEST) as f:
        json.dump(record, f, indent=2)
    for path in [*staged.rglob("*"), staged]:
        _fsync(path)
    if target.exists():
        remove_path(target)
    os.replace(staged, target)
    _fsync(run_dir)
    limit = trainer.args.save_total_limit
    for old in checkpoints_of(run_dir, complete=True)[:-limit] if limit and limit > 0 else []:
        logger.info("save_total_limit %d: deleting %s", limit, old.path)
        remove_path(old.path)


def _publish_final(trainer, staged: Path, out: Path, training_end: dict[str, Any]) -> None:
    names = _written(staged)
    for name in names:
        _fsync(staged / name)
    previous = own_names(read_json(out / COMPLETE_MARKER), read_json(out / FINAL_SAVE_RECORD)) - {COMPLETE_MARKER}
    with atomic_write(out / FINAL_SAVE_RECORD) as f:  # from here on these names are the run's, marker or not
        json.dump({"files": sorted(set(names) | previous)}, f, indent=2)
    _fsync(out)
    (out / COMPLETE_MARKER).unlink(missing_ok=True)  # from here on the folder is not a finished run
    for name in sorted(previous - set(names)):  # the run's own files of an earlier final save, not written again
        remove_path(out / name)
    for name in names:
        target = out / name
        if (target.exists() or target.is_symlink()) and name not in previous:  # made while the run trained: kept
            logger.warning("%s was not written by this run: moved to %s.before-run to make room", target, name)
            os.replace(target, out / f"{name}.before-run")
        elif target.is_dir() and not target.is_symlink():
            remove_path(target)
        os.replace(staged / name, target)
    _fsync(out)
    stage, finished = trainer.run_config.get("stage", "I"), time.strftime("%Y-%m-%d %H:%M:%S")
    marker = {"stage": stage, "global_step": trainer.state.global_step, "finished": finished}
    with atomic_write(out / COMPLETE_MARKER) as f:
        json.dump({**marker, "training_end": training_end, **file_record(out, names)}, f, indent=2)
    (out / FINAL_SAVE_RECORD).unlink(missing_ok=True)
    _fsync(out)


def _final_save(trainer, training_end: dict[str, Any]):
    """An empty staging folder for the final model; published when the block ends (removed if it fails)."""
    out = Path(trainer.args.output_dir)
    staged = out / FINAL_STAGING / (out.resolve().name or "model")  # the model card names its folder
    return _staged(trainer, out / FINAL_STAGING, staged, lambda: _publish_final(trainer, staged, out, training_end))


def save_final(trainer, training_end: dict[str, Any]) -> None:
    """The final model, its completion marker (with ``training_end``: where training ends) written last."""
    trainer.check_weights_finite("the final model was not written")
    with _final_save(trainer, training_end) as staged:
        trainer.save_model(str(staged))
        if trainer.args.should_save:
            trainer.state.save_to_json(str(staged / TRAINER_STATE_NAME))  # the log history beside the final model


def finalize_from_checkpoint(trainer, checkpoint: str, training_end: dict[str, Any]) -> None:
    """The final model from a complete checkpoint at the last step (its model files, checked by content)."""
    from transformers import TrainerState

    ckpt = Path(checkpoint)
    trainer.state = TrainerState.load_from_json(str(ckpt / TRAINER_STATE_NAME))
    logger.info("%s is at the last step (%d): the final model is written from it", ckpt, trainer.state.global_step)
    with _final_save(trainer, training_end) as staged:
        if trainer.args.should_save:
            manifest = read_json(ckpt / CHECKPOINT_MANIFEST) or {}
            if problem := record_problem(ckpt, manifest, CHECKPOINT_MANIFEST):
                raise CheckpointError(f"{ckpt}: {problem}; the final model was not written from it")
            skip = {n for n in manifest["files"] for pattern in TRAINING_STATE_FILES if Path(n).match(pattern)}
            for name in sorted(n for n in set(manifest["files"]) - skip - {RUN_CONFIG_NAME} if "/" not in n):
                shutil.copyfile(ckpt / name, staged / name, follow_symlinks=False)
            with atomic_write(staged / RUN_CONFIG_NAME) as f:
                json.dump(trainer.run_config, f, indent=2)
