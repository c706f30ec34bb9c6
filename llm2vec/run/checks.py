"""The path and disk checks of an output folder. A command that writes one (training, the export) refuses, whatever
its flags, a folder that is, lies inside or contains one of its inputs (an overwrite could replace what is being
read) or another run's or export's folder (each is owned by the command that wrote it): :func:`check_apart`, before
anything is created. A run also checks that it can write there and has room for its checkpoints and final model
(:func:`check_disk_space`, before anything is deleted)."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..arguments import ConfigError
from ..io import COMPLETE_MARKER, EXPORT_MARKER
from .folder import FINAL_SAVE_RECORD, is_own_checkpoint, listed
from .lock import LOCK_NAME, is_held

SCAN_DEPTH = 3  # how deep below an output folder other runs are looked for
SCAN_LIMIT = 5000  # ... and in how many folders at most


def folder_holds(path: Path) -> str | None:
    """What ``path`` holds that a command of this package owns (an export, a finished run, a live run, a run's
    checkpoints or final save), else ``None``; a stale lock file alone is none."""
    if (path / EXPORT_MARKER).is_file():
        return "an export"
    if (path / COMPLETE_MARKER).is_file():
        return "a finished run"
    if is_held(path / LOCK_NAME):
        return "a run in progress"
    if (path / FINAL_SAVE_RECORD).is_file():
        return "a run"
    with contextlib.suppress(OSError):
        if any(is_own_checkpoint(child) for child in path.iterdir()):
            return "a run (checkpoints)"
    return None


def _runs_below(root: Path, skip) -> list[str]:
    """``<path> (<what>)`` for each folder below ``root`` (depth 1 to :data:`SCAN_DEPTH`, hidden ones aside) that
    :func:`folder_holds` a run or export; ``skip(child)`` leaves out top-level children (the run's own checkpoints)."""
    found, frontier, seen = [], [(root, 0)], 0
    while frontier and seen < SCAN_LIMIT:
        folder, depth = frontier.pop()
        try:
            children = sorted(c for c in folder.iterdir() if c.is_dir() and not c.is_symlink() and c.name[0] != ".")
        except OSError:
            continue
        for child in children:
            if depth == 0 and skip(child):
                continue
            seen += 1
            what = folder_holds(child)
            if what:
                found.append(f"{child} ({what})")
            elif depth + 1 < SCAN_DEPTH:
                frontier.append((child, depth + 1))
    return sorted(found)


def check_apart(
    output_dir: str | os.PathLike,
    inputs: list[tuple[str, str | os.PathLike | None]],
    where: str = "output_dir",
    own_runs: bool = True,
) -> None:
    """Raise :class:`ConfigError` (one line) when ``output_dir`` is, lies inside or contains one of ``inputs``
    (``(label, path)``; one that does not exist is left out) or another run's or export's folder. ``own_runs``:
    ``output_dir``'s own checkpoints are not another run."""
    out = Path(output_dir).expanduser().resolve()
    for label, path in ((label, path) for label, path in inputs if path and os.path.exists(path)):
        read = Path(path).expanduser().resolve()
        relation = {read == out: "is", read in out.parents: "lies inside", out in read.parents: "contains"}.get(True)
        if relation:
            raise ConfigError(
                f"{where} {output_dir} {relation} the {label} {os.fspath(path)}: a command never writes where it "
                "reads (an overwrite could delete it); choose an output folder apart from every input"
            )
    for parent in out.parents:
        what = folder_holds(parent)
        if what:
            raise ConfigError(
                f"{where} {output_dir} lies inside {parent}, which holds {what}; that folder belongs to the command "
                "that wrote it. Choose an output folder outside it"
            )
    if out.is_dir():
        below = _runs_below(out, is_own_checkpoint if own_runs else (lambda child: False))
        if below:
            raise ConfigError(
                f"{where} {output_dir} contains the folders of other runs or exports ({listed(below, 4)}); a command never "
                "writes over them. Choose an output folder beside them, not above them"
            )


def check_writable(output_dir: str) -> None:
    """Create ``output_dir`` and a file in it, or raise :class:`ConfigError`."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=output_dir, prefix=".write-test.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"output_dir {output_dir}: cannot write there ({e.strerror or e}); choose a folder you can write to"
        ) from None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@dataclass
class DiskEstimate:
    """Bytes a run writes: ``checkpoints`` kept at once of ``weights + optimizer`` each, and the final model."""

    weights: int
    optimizer: int
    checkpoints: int


def estimate_disk(args, model, start_step: int, end_step: int, per_epoch: int) -> DiskEstimate:
    """The bytes this run writes: weights in their dtype (a LoRA model saves its adapter only), AdamW's two moments
    per trainable parameter (none with ``save_only_model``), the checkpoints saved between ``start_step`` and
    ``end_step``, at most ``save_total_limit + 1`` at once (a new one is complete before the oldest is deleted)."""
    params = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in params)
    weights = trainable if hasattr(getattr(model, "model", None), "peft_config") else total
    optimizer = 0 if args.save_only_model else 2 * trainable
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if strategy == "no" or end_step <= start_step:
        saves = 0
    elif strategy == "epoch":
        saves = math.ceil(end_step / per_epoch) - start_step // per_epoch
    else:  # steps (and best): every save_steps, and at the end
        interval = args.save_steps if args.save_steps >= 1 else math.ceil(end_step * args.save_steps)
        interval = max(1, int(interval))
        saves = end_step // interval - start_step // interval + (1 if end_step % interval else 0)
    limit = args.save_total_limit
    kept = min(saves, limit + 1) if limit and limit > 0 else saves
    return DiskEstimate(weights, optimizer, kept)


def check_disk_space(output_dir: str, estimate: DiskEstimate, freed: list[Path]) -> None:
    """Refuse a run whose checkpoints and final model would not fit in the free space (plus what ``freed`` holds)."""
    where = Path(output_dir).absolute()
    while not where.exists() and where.parent != where:
        where = where.parent
    free = shutil.disk_usage(where).free
    free += sum(f.stat().st_size for p in freed for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    e = estimate
    total = e.checkpoints * (e.weights + e.optimizer) + e.weights
    if free < total:
        raise ConfigError(
            f"output_dir {output_dir}: {_size(free)} free, but this run writes about {_size(total)}: {e.checkpoints} "
            f"checkpoint(s) on disk at once of {_size(e.weights + e.optimizer)} each (weights {_size(e.weights)} + "
            f"optimizer state {_size(e.optimizer)}) and the final model ({_size(e.weights)}). Free some space, choose "
            "another --output_dir, or save less: a smaller save_total_limit, a larger save_steps, or save_only_model "
            "true (checkpoints without optimizer state; they cannot be resumed exactly)"
        )
