"""A folder one command writes whole (the sentence-transformers export), under the lock and rules of a run's folder.

The export builds its folder beside the target and renames it into place (:func:`llm2vec.io.atomic_dir`), deleting
what the target held; so the target lies apart from the inputs and other runs (:func:`.checks.check_apart`), its run
lock is held for the write, and it is absent, empty, or (with ``overwrite``) a previous export holding nothing else:
every file listed in its marker :data:`~llm2vec.io.EXPORT_MARKER` (written last: each file's size and SHA-256).
Anything else is refused in one line naming what it holds.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from ..arguments import ConfigError
from ..io import EXPORT_MARKER, atomic_dir, atomic_write, file_record, remove_stale_temporaries
from .checks import check_apart, folder_holds
from .folder import RunFolder, listed, read_json
from .lock import LOCK_NAME, RunLocked, describe_holder, hold, is_held


class ExportFolderError(ConfigError):
    """An export's output folder that it may not write (one line: the folder, what it holds, what to do)."""


def _check_contents(folder: Path, overwrite: bool, locked: bool = False) -> None:
    """Raise :class:`ExportFolderError` unless ``folder`` is absent, empty, or (with ``overwrite``) an export;
    ``locked``: this process holds the folder's lock."""
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
    exported = (read_json(folder / EXPORT_MARKER) or {}).get("sha256")
    if not isinstance(exported, dict):
        raise ExportFolderError(
            f"output_dir {folder} holds {folder_holds(folder) or 'files no export wrote'} ({listed(entries)}); "
            f"--overwrite replaces only a previous export (a folder with its {EXPORT_MARKER}). Move them away or "
            "choose another --output_dir"
        )
    found = {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()} - {LOCK_NAME, EXPORT_MARKER}
    if others := sorted(found - set(exported)):
        raise ExportFolderError(
            f"output_dir {folder} holds a previous export and files it did not write ({listed(others)}); replacing it "
            "would delete them. Move them away or choose another --output_dir"
        )
    if not overwrite:
        raise ExportFolderError(
            f"output_dir {folder} holds a previous export; pass --overwrite (overwrite=True) to replace it, or "
            "choose another --output_dir"
        )


def check_export_target(output_dir: str | os.PathLike, overwrite: bool, inputs: list) -> None:
    """The checks of the module docstring, without the lock and writing nothing (before the model loads)."""
    try:
        check_apart(output_dir, inputs, own_runs=False)
    except ConfigError as e:
        raise ExportFolderError(str(e)) from None
    _check_contents(Path(output_dir), overwrite)


@contextlib.contextmanager
def claim_export_folder(output_dir: str | os.PathLike, overwrite: bool, inputs: list) -> Iterator[Path]:
    """Check ``output_dir``, hold its run lock, check it again, and yield an empty folder to build in; on a clean
    exit write the marker into it last and rename it to ``output_dir``. On an error nothing changes."""
    target = Path(output_dir)
    check_export_target(target, overwrite, inputs)
    created = not target.exists()
    try:
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(hold(target))
            except RunLocked as e:
                raise ExportFolderError(f"{e}; an export never writes into a folder in use") from None
            _check_contents(target, overwrite, locked=True)
            remove_stale_temporaries(target)
            with atomic_dir(target, replace=True) as tmp:
                yield tmp
                if any(p.is_symlink() for p in tmp.rglob("*")):
                    raise ExportFolderError(f"output_dir {target}: the export wrote a link; nothing was published")
                names = [str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()]
                with atomic_write(tmp / EXPORT_MARKER) as f:
                    json.dump(file_record(tmp, names), f, indent=2)
    except BaseException:
        if created and target.is_dir() and not any(target.iterdir()):
            target.rmdir()  # the folder made only to hold the lock
        raise
