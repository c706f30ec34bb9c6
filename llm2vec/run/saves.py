"""Complete-or-absent saves: checkpoints written under a staging name and renamed into place, the final model
finished by its completion marker.

- **Checkpoints are complete or absent.** The Trainer writes a checkpoint into a staging folder
  ``.checkpoint-<step>.staging.tmp/``; once every process has written its part (weights, optimizer,
  scheduler, each rank's RNG state, ``trainer_state.json``), the manifest :data:`CHECKPOINT_MANIFEST` is written,
  the files are fsynced and the folder is renamed to ``checkpoint-<step>`` in one atomic step
  (:func:`staged_checkpoint`). A run killed during a save leaves only the staging folder, which nothing reads and
  the next run deletes (:func:`remove_stale_staging`). Old checkpoints are rotated out (``save_total_limit``) by
  renaming them away before deleting them.
- **The final model is finished when the marker exists.** The marker is removed before the final save starts and
  written (atomically) after every file of the final model is on disk (:func:`save_final`;
  :func:`finalize_from_checkpoint` builds the final model from a checkpoint at the last step).

What the folder holds is read by :mod:`llm2vec.run.folder`. This module imports nothing of the export or the
evaluation (tests/test_import_graph.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from ..io import atomic_write
from .folder import (
    CHECKPOINT_MANIFEST,
    COMPLETE_MARKER,
    RUN_CONFIG_NAME,
    TRAINER_STATE_NAME,
    TRAINING_STATE_FILES,
    RunFolder,
    end_values,
    remove_path,
)

logger = logging.getLogger("llm2vec")


def write_checkpoint_manifest(folder: str | os.PathLike, step: int) -> None:
    """Record every file of the checkpoint ``folder`` (relative path and size), written last."""
    folder = Path(folder)
    files = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != CHECKPOINT_MANIFEST
    }
    with atomic_write(folder / CHECKPOINT_MANIFEST) as f:
        json.dump({"global_step": step, "files": files}, f, indent=2)


def remove_stale_staging(output_dir: str | os.PathLike) -> None:
    """Delete the staging and deletion folders a killed run left behind (``.checkpoint-*.tmp``)."""
    for stale in Path(output_dir).glob(".checkpoint-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(staged: Path, target: Path) -> None:
    """Rename the finished folder ``staged`` to ``target`` (replacing an older one of the same name)."""
    for f in staged.rglob("*"):
        _fsync(f)
    _fsync(staged)
    if target.exists():
        remove_path(target)
    os.replace(staged, target)
    _fsync(target.parent)


def _rotate(run_dir: Path, limit: int | None) -> None:
    """Keep the newest ``limit`` complete checkpoints (transformers' ``save_total_limit``)."""
    if not limit or limit <= 0:
        return
    complete = RunFolder.inspect(run_dir).complete
    for old in complete[:-limit]:
        logger.info("save_total_limit %d: deleting %s", limit, old.path)
        remove_path(old.path)


@contextlib.contextmanager
def staged_checkpoint(trainer, run_dir: str):
    """Yield the folder the Trainer should write ``checkpoint-<step>`` into; publish it when all processes are done.

    Every process writes its part (rank-specific RNG states, FSDP shards) under the same staging folder; after
    a barrier the saving process fsyncs and renames it, then applies ``save_total_limit``.
    """
    run_dir = Path(run_dir)
    name = f"checkpoint-{trainer.state.global_step}"
    staging = run_dir / f".{name}.staging.tmp"
    saver = trainer.args.should_save
    if saver:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    try:
        yield str(staging)
    except BaseException:
        if saver:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    trainer.accelerator.wait_for_everyone()
    if saver:
        write_checkpoint_manifest(staging / name, trainer.state.global_step)
        _publish(staging / name, run_dir / name)
        shutil.rmtree(staging, ignore_errors=True)
        _rotate(run_dir, trainer.args.save_total_limit)
    trainer.accelerator.wait_for_everyone()


def _write_marker(output_dir: Path, run_config: dict[str, Any], global_step: int) -> None:
    files = sorted(p for p in output_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    for p in files:
        _fsync(p)
    stage = run_config.get("stage", "I")
    marker = {
        "stage": stage,
        "global_step": global_step,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "training_end": end_values(run_config, stage) if run_config else {},
        "files": {p.name: p.stat().st_size for p in files if p.name != COMPLETE_MARKER},
    }
    with atomic_write(output_dir / COMPLETE_MARKER) as f:
        f.write(json.dumps(marker, indent=2) + "\n")
    _fsync(output_dir)


def save_final(trainer) -> None:
    """The final model, ``trainer_state.json``, then (last) the completion marker."""
    out = Path(trainer.args.output_dir)
    trainer.check_weights_finite("the final model was not written")
    if trainer.args.should_save:
        (out / COMPLETE_MARKER).unlink(missing_ok=True)  # from here on the folder is not a finished run
    trainer.save_model(str(out))
    trainer.save_state()  # trainer_state.json (the log history) beside the final model
    trainer.accelerator.wait_for_everyone()
    if trainer.args.should_save:
        _write_marker(out, trainer.run_config, trainer.state.global_step)
    trainer.accelerator.wait_for_everyone()


def finalize_from_checkpoint(trainer, checkpoint: str) -> None:
    """The final model of a run whose last checkpoint is complete but whose final save was interrupted:
    the checkpoint's model files (no optimizer, scheduler or RNG state), this run's config, then the marker."""
    from transformers import TrainerState

    out, ckpt = Path(trainer.args.output_dir), Path(checkpoint)
    trainer.state = TrainerState.load_from_json(str(ckpt / TRAINER_STATE_NAME))
    logger.info(
        "%s is at the last step (%d): writing the final model from it, no training needed",
        ckpt,
        trainer.state.global_step,
    )
    if trainer.args.should_save:
        (out / COMPLETE_MARKER).unlink(missing_ok=True)
        skip = {p.name for pattern in TRAINING_STATE_FILES for p in ckpt.glob(pattern)}
        for src in ckpt.iterdir():
            if src.is_file() and src.name not in skip:
                shutil.copyfile(src, out / src.name)
        with atomic_write(out / RUN_CONFIG_NAME) as f:
            json.dump(trainer.run_config, f, indent=2)
        _write_marker(out, trainer.run_config, trainer.state.global_step)
    trainer.accelerator.wait_for_everyone()
