"""Training losses, one per file, each documented by its equation."""

from .reconstruction import reconstruction_nll

__all__ = ["reconstruction_nll"]
