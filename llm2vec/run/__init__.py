"""A run's output folder, owned by :class:`RunManager`; the rest is what the trainer and the export need."""

from .folder import RUN_CONFIG_NAME, CheckpointError, newest_checkpoint
from .lock import RunLocked
from .plan import RunManager, without_resume
from .saves import staged_checkpoint
from .target import ExportFolderError, check_export_target, claim_export_folder, folder_holds

__all__ = [
    "RUN_CONFIG_NAME",
    "CheckpointError",
    "ExportFolderError",
    "RunLocked",
    "RunManager",
    "check_export_target",
    "claim_export_folder",
    "folder_holds",
    "newest_checkpoint",
    "staged_checkpoint",
    "without_resume",
]
