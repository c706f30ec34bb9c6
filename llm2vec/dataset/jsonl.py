"""A user's own training data: one or more JSON-lines files."""

from __future__ import annotations

import os
from pathlib import Path

from ..keywords import strict_booleans
from .base import SourceStats, TrainDataset, examples_from_records
from .records import DataError, TrainExample, check_path_kind, missing_files, read_jsonl_pairs


@strict_booleans
def load_jsonl(
    paths: str | list[str],
    global_batch_size: int,
    seed: int = 42,
    default_instruction: str = "",
    require_negative: bool = False,
    validation_size: float = 0,
) -> TrainDataset:
    """Load JSON-lines files and arrange them into single-source global batches.

    Args:
        paths: one file or a list of files with distinct stems.
        global_batch_size, seed: examples per optimisation step over all devices; seed of the shuffles.
        default_instruction: query instruction of lines without an ``instruction`` field.
        require_negative: every line must have a non-empty ``negative``.
        validation_size: examples held out for validation (:func:`llm2vec.dataset.base.hold_out`).

    Raises:
        ValueError: no paths, or two files with the same stem.
        DataError: a folder for a file, missing files (all in one error), a malformed line, or too little data.
    """
    path_list = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    path_list = [os.fspath(p) for p in path_list]
    if not path_list:
        raise DataError("dataset_file_path: no training files given")
    by_stem: dict[str, str] = {}
    for p in path_list:
        stem = Path(p).stem
        if stem in by_stem:
            raise DataError(
                f"dataset_file_path: {by_stem[stem]} and {p} have the same stem '{stem}', which names the "
                "source of their examples; rename one, or merge them into one file."
            )
        by_stem[stem] = p
    for p in path_list:
        check_path_kind(p, "jsonl")
    if missing := missing_files(path_list):
        listed, where = "".join(f"\n  - {p}" for p in missing), f"relative paths are resolved from {os.getcwd()}"
        raise DataError(
            f"{len(missing)} of {len(path_list)} training files not found:{listed}\nCheck the paths ({where})."
        )

    default_instruction = default_instruction.strip()
    examples_by_source: dict[str, list[TrainExample]] = {}
    stats: dict[str, SourceStats] = {}
    for stem, path in by_stem.items():
        records, report = read_jsonl_pairs(path, require_negative=require_negative, read_instruction=True)
        stats[stem] = SourceStats(name=stem)
        stats[stem].add_report(report)
        examples_by_source[stem] = examples_from_records(
            records, stem, lambda r: r.instruction if r.instruction is not None else default_instruction
        )
    return TrainDataset.from_sources(examples_by_source, global_batch_size, seed, stats, validation_size)
