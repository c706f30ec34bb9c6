"""Training data: the paper's E5 data, a user's own JSON-lines files, and Hugging Face datasets."""

from .base import SourceStats, TrainDataset, arrange_global_batches, hold_out  # noqa: F401  (the package's face)
from .e5 import E5_SOURCES, load_e5  # noqa: F401
from .hf import ArrowTrainDataset, load_hf  # noqa: F401
from .jsonl import load_jsonl  # noqa: F401
from .records import DataError, TrainExample, read_jsonl_pairs  # noqa: F401
