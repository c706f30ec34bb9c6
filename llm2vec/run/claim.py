"""A folder that one command writes whole (the sentence-transformers export): the same lock and rules as a run.

The export builds its folder beside the target and renames it into place (:func:`llm2vec.io.atomic_dir`), so
replacing the target deletes everything in it. That is allowed only for what an export wrote:

- the target is checked apart from the inputs and from other runs (:func:`llm2vec.run.checks.check_apart`:
  not the base model or adapter, not inside or above them, not inside or above a run's or export's folder);
- the target's run lock (:mod:`llm2vec.run.lock`, the same file a training run holds) is taken for the write,
  so an export never writes into a live run's folder, and no run starts in a folder being exported to;
- the target must be absent or empty, or hold a previous export, recognised by its marker :data:`EXPORT_MARKER`
  (written last into every export: the export's files and their sizes) and holding nothing else. ``overwrite``
  replaces such an export and nothing else: a run's folder (finished or not), a folder holding files no export
  wrote, or a folder above other runs is refused in one line naming what it holds, whatever the flags.

:func:`check_export_target` runs the checks before the model loads (nothing is written);
:func:`claim_export_folder` runs them again under the lock, yields the empty folder to build in, writes the
marker and renames the folder into place.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from ..arguments import ConfigError
from ..io import atomic_dir, atomic_write, remove_stale_temporaries
from .checks import EXPORT_MARKER, check_apart, folder_holds
from .folder import RunFolder, listed, read_json
from .lock import LOCK_NAME, RunLocked, describe_holder, hold, is_held


class ExportFolderError(ConfigError):
    """An export's output folder that it may not write (one line: the folder, what it holds, what to do)."""


def _export_files(folder: Path) -> set[str] | None:
    """The names a previous export's marker lists (``None``: no readable marker)."""
    marker = read_json(folder / EXPORT_MARKER)
    files = (marker or {}).get("files")
    return set(files) if isinstance(files, dict) else None


def _check_contents(folder: Path, overwrite: bool, locked: bool = False) -> None:
    """Raise :class:`ExportFolderError` unless ``folder`` is absent, empty, or (with ``overwrite``) an export.
    ``locked``: this process holds the folder's lock (else a held lock means a live run)."""
    if not folder.is_dir():
        if folder.exists():
            raise ExportFolderError(f"output_dir {folder} is a file; give a folder path")
        return
    if not locked and is_held(folder / LOCK_NAME):
        raise ExportFolderError(
            f"output_dir {folder} is in use by a run: {describe_holder(folder / LOCK_NAME)}; an export never writes "
            "into a live run's folder. Choose another --output_dir"
        )
    entries = sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)
    if not entries:
        return
    run = RunFolder.inspect(folder)
    if run.holds_run:
        raise ExportFolderError(
            f"output_dir {folder} holds {run.describe()}; an export never replaces a training run, whatever the "
            "flags. Choose another --output_dir"
        )
    exported = _export_files(folder)
    if exported is None:
        what = folder_holds(folder)
        raise ExportFolderError(
            f"output_dir {folder} holds {what or 'files no export wrote'} ({listed(entries)}); --overwrite replaces only a "
            f"previous export (a folder with its {EXPORT_MARKER}). Move them away or choose another --output_dir"
        )
    found = {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()} - {LOCK_NAME, EXPORT_MARKER}
    others = sorted(found - exported)
    if others:
        raise ExportFolderError(
            f"output_dir {folder} holds a previous export and files it did not write ({listed(others)}); replacing it "
            "would delete them. Move them away or choose another --output_dir"
        )
    if not overwrite:
        raise ExportFolderError(
            f"output_dir {folder} holds a previous export; pass --overwrite (overwrite=True) to replace it, or "
            "choose another --output_dir"
        )


def check_export_target(
    output_dir: str | os.PathLike, overwrite: bool, inputs: list[tuple[str, str | os.PathLike | None]]
) -> None:
    """The checks of the module docstring, without the lock and writing nothing (before the model loads)."""
    _check_apart(output_dir, inputs)
    _check_contents(Path(output_dir), overwrite)


def _check_apart(output_dir: str | os.PathLike, inputs: list[tuple[str, str | os.PathLike | None]]) -> None:
    """:func:`llm2vec.run.checks.check_apart` for an export (no checkpoints of its own), as :class:`ExportFolderError`."""
    try:
        check_apart(output_dir, inputs, own_runs=False)
    except ConfigError as e:
        raise ExportFolderError(str(e)) from None


@contextlib.contextmanager
def claim_export_folder(
    output_dir: str | os.PathLike, overwrite: bool, inputs: list[tuple[str, str | os.PathLike | None]]
) -> Iterator[Path]:
    """Hold ``output_dir``'s run lock, check it again (:func:`check_export_target`), and yield an empty folder to
    build the export in; on a clean exit write :data:`EXPORT_MARKER` into it last and rename it to ``output_dir``
    (the previous export, checked to hold nothing else, is deleted). On an error nothing changes."""
    target = Path(output_dir)
    _check_apart(target, inputs)
    created = not target.exists()
    try:
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(hold(target))  # the lock a training run takes: one writer per folder
            except RunLocked as e:
                raise ExportFolderError(f"{e}; an export never writes into a folder in use") from None
            _check_contents(target, overwrite, locked=True)
            remove_stale_temporaries(target)
            with atomic_dir(target, replace=True) as tmp:
                yield tmp
                files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
                with atomic_write(tmp / EXPORT_MARKER) as f:
                    json.dump({"files": files}, f, indent=2)
    except BaseException:
        if created and target.is_dir() and not any(target.iterdir()):
            target.rmdir()  # the folder made only to hold the lock
        raise
