"""The path and disk checks of a run's ``output_dir``: it can be written (:func:`check_writable`, before the folder
is locked), and it has room for the checkpoints and the final model the run will write (:func:`estimate_disk`,
:func:`check_disk_space`, once the model is built and before anything is deleted or trained).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..arguments import ConfigError


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
    """Bytes a run will write: ``checkpoints`` kept at once of ``weights + optimizer`` each, and the final model."""

    weights: int
    optimizer: int
    checkpoints: int

    @property
    def total(self) -> int:
        return self.checkpoints * (self.weights + self.optimizer) + self.weights

    def describe(self) -> str:
        return (
            f"about {_size(self.total)}: {self.checkpoints} checkpoint(s) on disk at once of "
            f"{_size(self.weights + self.optimizer)} each (weights {_size(self.weights)} + optimizer state "
            f"{_size(self.optimizer)}) and the final model ({_size(self.weights)})"
        )


def estimate_disk(args, model, start_step: int, end_step: int, per_epoch: int) -> DiskEstimate:
    """The bytes this run writes: weights in their dtype (a LoRA model saves its adapter only), AdamW's two
    moments per trainable parameter (none with ``save_only_model``), the checkpoints saved between
    ``start_step`` and ``end_step`` of which at most ``save_total_limit + 1`` exist at once (a new one is
    complete before the oldest is deleted)."""
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


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def bytes_under(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total


def check_disk_space(output_dir: str, estimate: DiskEstimate, freed: int = 0) -> None:
    free = shutil.disk_usage(_nearest_existing(Path(output_dir))).free + freed
    if free < estimate.total:
        raise ConfigError(
            f"output_dir {output_dir}: {_size(free)} free, but this run writes {estimate.describe()}. "
            "Free some space, choose another --output_dir, or save less: a smaller save_total_limit, "
            "a larger save_steps, or save_only_model true (checkpoints without optimizer state; "
            "they cannot be resumed exactly)"
        )
