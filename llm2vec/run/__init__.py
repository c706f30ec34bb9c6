"""A run's output folder: :class:`RunManager` owns it (lock, inspection, plan, input fingerprints, disk and path
checks, staged saves, completion marker; see :mod:`llm2vec.run.manager`). The other names are what the trainer
and the command line need: the staged checkpoint, the newest complete checkpoint, the errors."""

from .folder import RUN_CONFIG_NAME, CheckpointError, newest_checkpoint
from .lock import RunLocked
from .manager import RunManager
from .saves import staged_checkpoint

__all__ = ["RUN_CONFIG_NAME", "CheckpointError", "RunLocked", "RunManager", "newest_checkpoint", "staged_checkpoint"]
