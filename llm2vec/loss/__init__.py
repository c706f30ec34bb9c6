"""Training losses, one per file, each documented by its equation."""

from .infonce import InfoNCELoss  # noqa: F401  (the package's face)
from .linear_cross_entropy import linear_cross_entropy_sum  # noqa: F401
from .reconstruction import ReconstructionLoss, reconstruction_nll  # noqa: F401
