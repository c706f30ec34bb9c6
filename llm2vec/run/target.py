"""The checks of a folder a command writes: apart from its inputs and other runs' (:func:`check_apart`), with room
(:func:`check_disk_space`); an export's folder claimed and written whole under the lock (``docs/run_safety.md``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections import namedtuple
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from ..arguments import ConfigError
from ..io import COMPLETE_MARKER, EXPORT_MARKER, atomic_dir, atomic_write, file_record, remove_stale_temporaries
from .folder import (
    FINAL_SAVE_RECORD,
    RunFolder,
    is_own_checkpoint,
    listed,
    read_json,
)
from .lock import LOCK_NAME, RunLocked, describe_holder, hold, is_held

SCAN_DEPTH, SCAN_LIMIT = 3, 5000  # how deep below an output folder other runs are looked for, in how many folders


class ExportFolderError(ConfigError):
    """An export's output folder that it may not write."""


def folder_holds(path: Path) -> str | None:
    """What of a command of this package ``path`` holds (a stale lock file is nothing), else ``None``."""
    if (path / EXPORT_MARKER).is_file():
        return "an export"
    if (path / COMPLETE_MARKER).is_file():
        return "a finished run"
    if is_held(path / LOCK_NAME):
        return "a run in progress"
    if (path / FINAL_SAVE_RECORD).is_file() or any(is_own_checkpoint(c) for c in _subfolders(path)):
        return "a run"
    return None


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(c for c in folder.iterdir() if c.is_dir() and not c.is_symlink() and c.name[0] != ".")
    except OSError:
        return []


def check_apart(output_dir, inputs: list[tuple[str, str | os.PathLike | None]], own_runs=True, error=ConfigError):
    """Refuse (``error``) an ``output_dir`` that is, lies inside or contains one of ``inputs`` (``(label, path)``) or
    another run's or export's folder (``own_runs``: its own checkpoints are not another run)."""
    out = Path(output_dir).expanduser().resolve()
    for label, path in ((label, path) for label, path in inputs if path and os.path.exists(path)):
        read = Path(path).expanduser().resolve()
        relation = {read == out: "is", read in out.parents: "lies inside", out in read.parents: "contains"}.get(True)
        if relation:
            raise error(
                f"output_dir {output_dir} {relation} the {label} {os.fspath(path)}: a command never writes where it "
                "reads"
            )
    for parent in out.parents:
        if what := folder_holds(parent):
            raise error(f"output_dir {output_dir} lies inside {parent}, which holds {what}")
    found, queue = [], [(c, 1) for c in _subfolders(out) if not (own_runs and is_own_checkpoint(c))]
    for folder, depth in islice(queue, SCAN_LIMIT):  # a breadth-first walk: queue grows while it is read
        if what := folder_holds(folder):
            found.append(f"{folder} ({what})")
        elif depth < SCAN_DEPTH:
            queue += [(c, depth + 1) for c in _subfolders(folder)]
    if found:
        raise error(
            f"output_dir {output_dir} contains the folders of other runs or exports ({listed(sorted(found), 4)})"
        )


def _size(n: float) -> str:
    power = min(4, int(math.log10(max(n, 1)) // 3))
    return f"{n:.0f} B" if power == 0 else f"{n / 1000**power:.1f} {'KMGT'[power - 1]}B"


DiskEstimate = namedtuple("DiskEstimate", "weights optimizer checkpoints")


def estimate_disk(args, model, start_step: int, end_step: int, per_epoch: int) -> DiskEstimate:
    """Bytes of the weights (a LoRA model's: its adapter) and of each checkpoint's AdamW state (none with
    ``save_only_model``), and how many checkpoints are kept at once (``save_total_limit + 1``)."""
    params = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in params)
    weights = trainable if hasattr(getattr(model, "model", None), "peft_config") else total
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    every = args.save_steps if args.save_steps >= 1 else end_step * args.save_steps  # a fraction: of the run
    every = max(1, math.ceil(per_epoch if strategy == "epoch" else every))  # steps (and best): every save_steps
    saves = end_step // every - start_step // every + (1 if end_step % every else 0)  # and one at the end
    saves = 0 if strategy == "no" or end_step <= start_step else saves
    limit = args.save_total_limit
    kept = min(saves, limit + 1) if limit and limit > 0 else saves
    return DiskEstimate(weights, 0 if args.save_only_model else 2 * trainable, kept)


def check_disk_space(output_dir: str, estimate: DiskEstimate, freed: list[Path]) -> None:
    """Refuse a run whose checkpoints and final model would not fit in the free space (plus what ``freed`` holds)."""
    where = Path(output_dir).absolute()
    while not where.exists() and where.parent != where:
        where = where.parent
    free = shutil.disk_usage(where).free
    free += sum(f.stat().st_size for p in freed for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    weights, optimizer, kept = estimate
    if free < (total := kept * (weights + optimizer) + weights):
        raise ConfigError(
            f"output_dir {output_dir}: {_size(free)} free, but this run writes about {_size(total)}: {kept} "
            f"checkpoint(s) of {_size(weights + optimizer)} and the final model; free space or save less "
            "(save_total_limit, save_steps, save_only_model)"
        )


def _check_export_contents(folder: Path, overwrite: bool, locked: bool = False) -> None:
    """Refuse unless ``folder`` is absent, empty, or (with ``overwrite``) a previous export and nothing else."""
    if folder.exists() and not folder.is_dir():
        raise ExportFolderError(f"output_dir {folder} is a file; give a folder path")
    if not locked and is_held(folder / LOCK_NAME):
        raise ExportFolderError(f"output_dir {folder} is in use by a run: {describe_holder(folder / LOCK_NAME)}")
    if not folder.is_dir() or not (entries := sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)):
        return
    run, exported = RunFolder.inspect(folder), (read_json(folder / EXPORT_MARKER) or {}).get("sha256")
    if run.holds_run or not isinstance(exported, dict):
        what = run.describe() if run.holds_run else f"files no export wrote ({listed(entries)})"
        raise ExportFolderError(f"output_dir {folder} holds {what}; --overwrite replaces only a previous export")
    found = {str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir()} - {LOCK_NAME, EXPORT_MARKER}
    if others := sorted(found - set(exported)):
        raise ExportFolderError(
            f"output_dir {folder} holds a previous export and files it did not write ({listed(others)})"
        )
    if not overwrite:
        raise ExportFolderError(f"output_dir {folder} holds a previous export; pass --overwrite to replace it")


def check_export_target(output_dir: str | os.PathLike, overwrite: bool, inputs: list) -> None:
    """The checks of an export's folder and inputs (no unfinished run), before the model loads, writing nothing."""
    for what, path in inputs:  # a finished run's model is checked against its marker by the loader, not here
        folder = Path(path) if path is not None and os.path.isdir(path) else None
        saves = folder and ((folder / FINAL_SAVE_RECORD).exists() or any(map(is_own_checkpoint, folder.iterdir())))
        if saves and not (folder / COMPLETE_MARKER).exists():
            raise ExportFolderError(
                f"{what} {path}: its run did not finish (no completion marker: cut before or during its final "
                "save); resume it with the same command, then export"
            )
    check_apart(output_dir, inputs, own_runs=False, error=ExportFolderError)
    _check_export_contents(Path(output_dir), overwrite)


@contextlib.contextmanager
def claim_export_folder(output_dir: str | os.PathLike, overwrite: bool, inputs: list) -> Iterator[Path]:
    """Check ``output_dir``, hold its lock, check again, and yield an empty folder to build in; on a clean exit write
    the marker (each file's size and SHA-256) last and rename the folder into place. On an error nothing changes."""
    target = Path(output_dir)
    check_export_target(target, overwrite, inputs)
    created = not target.exists()
    try:
        with hold(target):
            _check_export_contents(target, overwrite, locked=True)
            remove_stale_temporaries(target)
            with atomic_dir(target, replace=True) as tmp:
                yield tmp
                if any(p.is_symlink() for p in tmp.rglob("*")):
                    raise ExportFolderError(f"output_dir {target}: the export wrote a link; nothing was published")
                names = [str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()]
                with atomic_write(tmp / EXPORT_MARKER) as f:
                    json.dump(file_record(tmp, names), f, indent=2)
    except BaseException as e:
        if created and target.is_dir() and not any(target.iterdir()):
            target.rmdir()  # the folder made only to hold the lock
        if isinstance(e, RunLocked):
            raise ExportFolderError(str(e)) from None
        raise
