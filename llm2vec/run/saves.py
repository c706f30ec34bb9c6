"""Complete-or-absent saves: checkpoints written under a staging name and renamed into place, the final model
finished by its completion marker.

- **Checkpoints are complete or absent.** The Trainer writes a checkpoint into a staging folder
  ``.checkpoint-<step>.staging.tmp/``; once every process has written its part (weights, optimizer,
  scheduler, each rank's RNG state, ``trainer_state.json``), the manifest :data:`CHECKPOINT_MANIFEST` is written,
  the files are fsynced and the folder is renamed to ``checkpoint-<step>`` in one atomic step
  (:func:`staged_checkpoint`). A run killed during a save leaves only the staging folder, which nothing reads and
  the next run deletes (:func:`remove_stale_staging`). Old checkpoints are rotated out (``save_total_limit``) by
  renaming them away before deleting them.
- **Checkpoints carry content hashes.** The manifest records each file's size and SHA-256, computed from the
  staged files before the rename; a resume compares them (:func:`llm2vec.run.folder.content_problem`).
- **The final model is finished when the marker exists, and the marker lists only what the save wrote.** The
  final model is written into ``.final-model.staging.tmp/<name of output_dir>/``; then the names of its files are recorded
  (:data:`~llm2vec.run.folder.FINAL_SAVE_RECORD`, so that a kill in the next moments leaves them known as the
  run's), the old marker is removed, the files are renamed into ``output_dir`` (the run's own files of a
  previous final save that this one did not write again are deleted), and the marker (those names and sizes)
  is written last (:func:`save_final`; :func:`finalize_from_checkpoint` builds the final model from a
  checkpoint at the last step). A user's file is never deleted: a file of the same name that the run did not
  write is moved aside to ``<name>.before-run`` with a warning (a run refuses to start beside one, so this
  happens only to a file created while the run trained).

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..io import atomic_write
from .config_fields import end_values
from .folder import (
    CHECKPOINT_MANIFEST,
    COMPLETE_MARKER,
    FINAL_SAVE_RECORD,
    MARKER_FORMAT,
    RUN_CONFIG_NAME,
    TRAINER_STATE_NAME,
    TRAINING_STATE_FILES,
    RunFolder,
    own_names,
    read_json,
    remove_path,
    sha256_file,
)

logger = logging.getLogger("llm2vec")


FINAL_STAGING = ".final-model.staging.tmp"


def write_checkpoint_manifest(folder: str | os.PathLike, step: int) -> None:
    """Record every file of the checkpoint ``folder`` (relative path, size and SHA-256), written last."""
    folder = Path(folder)
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != CHECKPOINT_MANIFEST]
    files = {str(p.relative_to(folder)): p.stat().st_size for p in paths}
    hashes = {str(p.relative_to(folder)): sha256_file(p) for p in paths}
    with atomic_write(folder / CHECKPOINT_MANIFEST) as f:
        json.dump({"global_step": step, "files": files, "sha256": hashes}, f, indent=2)


def remove_stale_staging(output_dir: str | os.PathLike) -> None:
    """Delete the staging and deletion folders a killed run left behind (``.checkpoint-*.tmp``, the final save's)."""
    for stale in [*Path(output_dir).glob(".checkpoint-*.tmp"), Path(output_dir) / FINAL_STAGING]:
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


def _publish_final(staged: Path, out: Path, run_config: dict[str, Any], global_step: int) -> None:
    """Move the final model's files from ``staged`` into ``out`` and write the marker last (module docstring)."""
    names = sorted(p.name for p in staged.iterdir())
    for p in staged.iterdir():
        _fsync(p)
    previous = own_names(read_json(out / COMPLETE_MARKER), read_json(out / FINAL_SAVE_RECORD)) - {COMPLETE_MARKER}
    with atomic_write(out / FINAL_SAVE_RECORD) as f:  # from here on these names are the run's, marker or not
        json.dump({"files": sorted(set(names) | previous)}, f, indent=2)
    _fsync(out)
    (out / COMPLETE_MARKER).unlink(missing_ok=True)  # from here on the folder is not a finished run
    for name in sorted(previous - set(names)):  # the run's own files of an earlier final save, not written again
        remove_path(out / name)
    for name in names:
        target = out / name
        if target.exists() and name not in previous:  # a file made while the run trained: never deleted
            aside = out / f"{name}.before-run"
            logger.warning(
                "%s was not written by this run: moved to %s to make room for the final model", target, aside
            )
            os.replace(target, aside)
        elif target.is_dir():
            remove_path(target)
        os.replace(staged / name, target)
    shutil.rmtree(out / FINAL_STAGING, ignore_errors=True)
    _fsync(out)
    stage = run_config.get("stage", "I")
    marker = {
        "format": MARKER_FORMAT,
        "stage": stage,
        "global_step": global_step,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "training_end": end_values(run_config, stage) if run_config else {},
        "files": {name: (out / name).stat().st_size for name in names if (out / name).is_file()},
    }
    with atomic_write(out / COMPLETE_MARKER) as f:
        f.write(json.dumps(marker, indent=2) + "\n")
    (out / FINAL_SAVE_RECORD).unlink(missing_ok=True)
    _fsync(out)


@contextlib.contextmanager
def _final_staging(trainer) -> Iterator[Path]:
    """An empty staging folder for the final model (every process: the same path), removed if the save fails. It
    bears ``output_dir``'s own name (``<output_dir>/.final-model.staging.tmp/<name>/``): the model card names the
    folder it is written in."""
    out = Path(trainer.args.output_dir)
    root = out / FINAL_STAGING
    staged = root / (out.resolve().name or "model")
    if trainer.args.should_save:
        shutil.rmtree(root, ignore_errors=True)
        staged.mkdir(parents=True)
    trainer.accelerator.wait_for_everyone()
    try:
        yield staged
    except BaseException:
        if trainer.args.should_save:
            shutil.rmtree(root, ignore_errors=True)
        raise


def save_final(trainer) -> None:
    """The final model and ``trainer_state.json``, staged, moved into place; then (last) the completion marker."""
    out = Path(trainer.args.output_dir)
    trainer.check_weights_finite("the final model was not written")
    with _final_staging(trainer) as staged:
        trainer.save_model(str(staged))
        if trainer.args.should_save:
            trainer.state.save_to_json(str(staged / TRAINER_STATE_NAME))  # the log history beside the final model
        trainer.accelerator.wait_for_everyone()
        if trainer.args.should_save:
            _publish_final(staged, out, trainer.run_config, trainer.state.global_step)
    trainer.accelerator.wait_for_everyone()


def finalize_from_checkpoint(trainer, checkpoint: str) -> None:
    """The final model of a run whose last checkpoint is complete but whose final save was interrupted:
    the checkpoint's model files (no optimizer, scheduler or RNG state), this run's config, then the marker."""
    from transformers import TrainerState

    ckpt = Path(checkpoint)
    trainer.state = TrainerState.load_from_json(str(ckpt / TRAINER_STATE_NAME))
    logger.info(
        "%s is at the last step (%d): writing the final model from it, no training needed",
        ckpt,
        trainer.state.global_step,
    )
    with _final_staging(trainer) as staged:
        if trainer.args.should_save:
            skip = {p.name for pattern in TRAINING_STATE_FILES for p in ckpt.glob(pattern)}
            for src in ckpt.iterdir():
                if src.is_file() and src.name not in skip:
                    shutil.copyfile(src, staged / src.name)
            with atomic_write(staged / RUN_CONFIG_NAME) as f:
                json.dump(trainer.run_config, f, indent=2)
            _publish_final(staged, Path(trainer.args.output_dir), trainer.run_config, trainer.state.global_step)
    trainer.accelerator.wait_for_everyone()
