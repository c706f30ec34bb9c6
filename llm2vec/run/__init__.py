"""A run's output folder: :class:`RunManager` owns it (lock, inspection, plan, input fingerprints, disk and path
checks, staged saves, completion marker; see :mod:`llm2vec.run.manager`). The other names are what the trainer,
the command line and the export need: the staged checkpoint, the newest complete checkpoint, the errors, and the
claim of a folder written whole (:mod:`llm2vec.run.claim`: the export's folder, under the same lock and rules)."""

from .claim import ExportFolderError, check_export_target, claim_export_folder
from .folder import RUN_CONFIG_NAME, CheckpointError, newest_checkpoint
from .lock import RunLocked
from .plan import RunManager
from .saves import staged_checkpoint

__all__ = [
    "RUN_CONFIG_NAME",
    "CheckpointError",
    "ExportFolderError",
    "RunLocked",
    "RunManager",
    "check_export_target",
    "claim_export_folder",
    "newest_checkpoint",
    "staged_checkpoint",
]
