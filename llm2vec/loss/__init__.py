"""Training losses, one per file, each documented by its equation."""

from .infonce import InfoNCELoss
from .linear_cross_entropy import linear_cross_entropy_sum
from .reconstruction import ReconstructionLoss, reconstruction_nll

__all__ = ["InfoNCELoss", "ReconstructionLoss", "linear_cross_entropy_sum", "reconstruction_nll"]
