"""Training data: the paper's E5 data, a user's own JSON-lines files, and Hugging Face datasets."""

from .base import SourceStats, TrainDataset, arrange_global_batches, hold_out
from .e5 import E5_SOURCES, load_e5
from .hf import ArrowTrainDataset, load_hf
from .jsonl import load_jsonl
from .records import DataError, TrainExample, read_jsonl_pairs

__all__ = [
    "ArrowTrainDataset",
    "DataError",
    "E5_SOURCES",
    "SourceStats",
    "TrainDataset",
    "TrainExample",
    "arrange_global_batches",
    "hold_out",
    "load_e5",
    "load_hf",
    "load_jsonl",
    "read_jsonl_pairs",
]
