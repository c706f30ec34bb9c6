"""A run's output folder, owned by :class:`RunManager`; the rest is what the trainer and the export need."""

from .folder import RUN_CONFIG_NAME, CheckpointError, newest_checkpoint  # noqa: F401  (the package's face)
from .lock import RunLocked  # noqa: F401
from .plan import RunManager, without_resume  # noqa: F401
from .saves import staged_checkpoint  # noqa: F401
from .target import ExportFolderError, check_export_target, claim_export_folder, folder_holds  # noqa: F401
