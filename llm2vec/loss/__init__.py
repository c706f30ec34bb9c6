"""Training losses, one per file, each documented by its equation."""

from .infonce import InfoNCELoss
from .reconstruction import reconstruction_nll

__all__ = ["InfoNCELoss", "reconstruction_nll"]
