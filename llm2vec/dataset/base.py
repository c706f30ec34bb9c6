"""Training examples, JSON-lines parsing and single-source global batches.

Everything the two loaders (``e5.py`` for the paper's E5 data, ``jsonl.py`` for a
user's own files) have in common lives here:

* :class:`TrainExample`, the unit the collator receives;
* :func:`read_jsonl_pairs`, the one parser of a JSON-lines file, with its error
  and skip rules;
* :func:`arrange_global_batches`, which orders the examples so that every global
  batch comes from a single source (in-batch negatives are then from the same
  dataset, as in LLM2Vec and the paper);
* :class:`TrainDataset`, the ``torch`` dataset over the arranged list.

Parsing rules (both loaders):

* a line that is not valid JSON, not a JSON object, or lacks a required field,
  or has a required field that is not a string, raises :class:`DataError`
  naming ``file:line``;
* surrounding whitespace of every text is stripped;
* a record whose query or positive (or negative, where required) is empty after
  stripping is skipped; skips are counted per file, logged as a warning with
  the file name, and reported in :meth:`TrainDataset.summary`;
* blank lines are not records; they are counted and reported too;
* a file in which no record survives is an error.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..io import iter_jsonl

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A problem with training data; the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class TrainExample:
    """One training triple.

    ``query_instruction`` is prepended to the query only (by the template code);
    documents (positive, negative) never get an instruction. ``negative`` is
    ``None`` when the example has no hard negative. ``source`` names the dataset
    the example comes from; a global batch never mixes sources.
    """

    query: str
    positive: str
    negative: str | None
    query_instruction: str
    source: str
    origin: str = field(default="", compare=False)  # "file:line" it was read from ("" when built in code)


@dataclass(frozen=True)
class RawRecord:
    """A parsed, non-empty record of a JSON-lines file, before an instruction is chosen.

    ``index`` is the 0-based position of the record among the file's records
    (blank lines excluded, skipped-empty records included), so that choices made
    by position (the alternating NLI / Quora instructions) do not shift when a
    record is skipped. ``line`` is the 1-based line number.
    """

    index: int
    line: int
    query: str
    positive: str
    negative: str | None
    instruction: str | None
    path: str = ""


@dataclass
class FileReport:
    """What reading one file produced."""

    path: str
    records: int = 0  # non-blank lines read
    kept: int = 0
    skipped_empty: int = 0  # records with an empty text, not used
    blank_lines: int = 0
    truncated: bool = False  # stopped early because of a limit


def _fail(path: str, line: int, problem: str, fix: str) -> DataError:
    return DataError(f"{path}:{line}: {problem}. {fix}")


def _text_field(obj: dict, name: str, path: str, line: int, fix: str, required: bool) -> str | None:
    """Return the stripped string ``obj[name]``; ``None`` when optional and absent or null."""
    value = obj.get(name)
    if value is None:
        if required:
            present = "is null" if name in obj else "is missing"
            raise _fail(path, line, f'required field "{name}" {present}', fix)
        return None
    if not isinstance(value, str):
        raise _fail(
            path,
            line,
            f'field "{name}" must be a string, got {type(value).__name__}',
            fix,
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate (JSON "\ud800"): no tokenizer can read it
        raise _fail(
            path,
            line,
            f'field "{name}" holds {value[err.start]!r} at character {err.start}, half of a UTF-16 surrogate '
            "pair, which is not a character (a broken \\uXXXX escape)",
            fix,
        ) from None
    return value.strip()


def read_jsonl_pairs(
    path: str,
    *,
    require_negative: bool,
    read_instruction: bool,
    limit: int | None = None,
    fix: str = "Fix or remove this line.",
) -> tuple[list[RawRecord], FileReport]:
    """Read one JSON-lines file of ``{"query", "positive", "negative"?, "instruction"?}`` objects.

    Args:
        path: the file.
        require_negative: ``negative`` must be present and non-empty; otherwise it
            is optional (absent, null or empty all mean "no negative").
        read_instruction: take the optional per-line ``instruction`` field;
            when False the field is ignored and ``RawRecord.instruction`` is None.
        limit: stop after this many kept records (the rest of the file is not read).
        fix: what to tell the user to do about a malformed line.

    Returns:
        The kept records in file order, and a :class:`FileReport`.

    Raises:
        DataError: on a malformed line, a file that cannot be decoded as UTF-8,
            or a file in which no record survives.
    """
    report = FileReport(path=path)
    records: list[RawRecord] = []
    for line_no, obj in iter_jsonl(path, error=DataError, fix=fix):
        if limit is not None and len(records) >= limit:
            report.truncated = True
            break
        if obj is None:
            report.blank_lines += 1
            continue
        index = report.records
        report.records += 1
        query = _text_field(obj, "query", path, line_no, fix, required=True)
        positive = _text_field(obj, "positive", path, line_no, fix, required=True)
        negative = _text_field(obj, "negative", path, line_no, fix, required=require_negative)
        instruction = _text_field(obj, "instruction", path, line_no, fix, required=False) if read_instruction else None
        if not query or not positive or (require_negative and not negative):
            report.skipped_empty += 1
            continue
        records.append(
            RawRecord(
                index=index,
                line=line_no,
                query=query,
                positive=positive,
                negative=negative or None,
                instruction=instruction,
                path=path,
            )
        )
    report.kept = len(records)
    if report.skipped_empty:
        needed = "query, positive or negative" if require_negative else "query or positive"
        logger.warning(
            "%s: skipped %d of %d records whose %s is empty or whitespace only",
            path,
            report.skipped_empty,
            report.records,
            needed,
        )
    if report.blank_lines:
        logger.warning("%s: ignored %d blank lines", path, report.blank_lines)
    if not records:
        if report.records == 0:
            raise DataError(f"{path}: the file holds no records. Check that it is the right file.")
        raise DataError(
            f"{path}: all {report.records} records were skipped because a required text "
            "is empty or whitespace only. Check the file's field names and contents."
        )
    return records, report


@dataclass
class SourceStats:
    """Per-source counts, for logging and :meth:`TrainDataset.summary`."""

    name: str
    files: list[str] = field(default_factory=list)
    records: int = 0  # records read from the files
    skipped_empty: int = 0  # records skipped because a required text is empty
    blank_lines: int = 0
    loaded: int = 0  # examples handed to arrange_global_batches
    dropped_tail: int = 0  # examples cut off because they did not fill a global batch
    kept: int = 0  # examples in the dataset

    def add_report(self, report: FileReport) -> None:
        self.files.append(report.path)
        self.records += report.records
        self.skipped_empty += report.skipped_empty
        self.blank_lines += report.blank_lines


def _arrange(
    examples_by_source: dict[str, list[TrainExample]], global_batch_size: int, seed: int
) -> tuple[list[TrainExample], dict[str, int]]:
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    rng = random.Random(seed)
    chunks: list[list[TrainExample]] = []
    dropped: dict[str, int] = {}
    # Sorted, so the result does not depend on the dict's insertion order.
    for name in sorted(examples_by_source):
        items = list(examples_by_source[name])
        rng.shuffle(items)
        n_full = len(items) // global_batch_size
        for k in range(n_full):
            chunks.append(items[k * global_batch_size : (k + 1) * global_batch_size])
        dropped[name] = len(items) - n_full * global_batch_size
    rng.shuffle(chunks)
    return [example for chunk in chunks for example in chunk], dropped


def arrange_global_batches(
    examples_by_source: dict[str, list[TrainExample]], global_batch_size: int, seed: int
) -> list[TrainExample]:
    """Order examples so that each consecutive block of ``global_batch_size`` is single-source.

    Each source is shuffled, cut into full chunks of ``global_batch_size`` (the
    incomplete tail of each source is dropped and the count logged), the chunks
    of all sources are shuffled together, and concatenated. Deterministic for a
    given seed and input.

    The trainer must read the result in order (sequential sampler); with
    ``global_batch_size = per_device_batch_size * world_size * gradient_accumulation_steps``
    every optimisation step then sees examples of a single source.
    """
    arranged, dropped = _arrange(examples_by_source, global_batch_size, seed)
    _log_dropped(dropped, global_batch_size)
    return arranged


def _log_dropped(dropped: dict[str, int], global_batch_size: int) -> None:
    total = sum(dropped.values())
    if total:
        detail = ", ".join(f"{name}: {n}" for name, n in dropped.items() if n)
        logger.info(
            "dropped %d examples that do not fill a global batch of %d (%s)",
            total,
            global_batch_size,
            detail,
        )


class TrainDataset(torch.utils.data.Dataset):
    """The arranged training examples; item ``i`` is a :class:`TrainExample`.

    Read it with a sequential sampler: the order is what keeps each global batch
    single-source. Build it with :meth:`from_sources`.
    """

    def __init__(
        self,
        examples: list[TrainExample],
        sources: dict[str, SourceStats],
        global_batch_size: int,
        seed: int,
        held_out: list[TrainExample] | None = None,
    ):
        self.examples = examples
        self.sources = sources
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.held_out = held_out or []  # the validation slice (:func:`hold_out`), never in ``examples``

    @classmethod
    def from_sources(
        cls,
        examples_by_source: dict[str, list[TrainExample]],
        global_batch_size: int,
        seed: int,
        stats: dict[str, SourceStats] | None = None,
        validation_size: float = 0,
    ) -> TrainDataset:
        """Arrange ``examples_by_source`` into single-source global batches, after carving out the
        validation slice (``validation_size``, :func:`hold_out`), kept as ``held_out``.

        Raises:
            DataError: when no source has enough examples for one global batch.
        """
        stats = dict(stats or {})
        examples_by_source, held_out = hold_out(examples_by_source, validation_size, seed)
        arranged, dropped = _arrange(examples_by_source, global_batch_size, seed)
        _log_dropped(dropped, global_batch_size)
        for name, examples in examples_by_source.items():
            s = stats.setdefault(name, SourceStats(name=name))
            s.loaded = len(examples)
            s.dropped_tail = dropped[name]
            s.kept = len(examples) - dropped[name]
            if s.kept == 0:
                logger.warning(
                    "source %s has %d examples, fewer than one global batch of %d; none of it is used",
                    name,
                    len(examples),
                    global_batch_size,
                )
        if not arranged:
            counts = ", ".join(f"{n}: {len(e)}" for n, e in sorted(examples_by_source.items()))
            raise DataError(
                f"no source has enough examples for one global batch of {global_batch_size} "
                f"({counts or 'no sources'}). Lower the global batch size or add data."
            )
        return cls(arranged, stats, global_batch_size, seed, held_out)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> TrainExample:
        return self.examples[index]

    @property
    def num_global_batches(self) -> int:
        return len(self.examples) // self.global_batch_size

    def summary(self) -> str:
        """A table of counts per source (records, skipped, dropped tail, kept)."""
        header = ("source", "records", "skipped_empty", "dropped_tail", "kept")
        rows = [
            (s.name, s.records, s.skipped_empty, s.dropped_tail, s.kept)
            for s in (self.sources[n] for n in sorted(self.sources))
        ]
        total = (
            "total",
            sum(r[1] for r in rows),
            sum(r[2] for r in rows),
            sum(r[3] for r in rows),
            sum(r[4] for r in rows),
        )
        table = [header, *rows, total]
        widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
        lines = [
            "  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
            for row in table
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        lines.append(
            f"{self.num_global_batches} global batches of {self.global_batch_size} "
            f"(seed {self.seed}); each batch from a single source"
        )
        return "\n".join(lines)


HOLD_OUT_SALT = 0x5EED  # the carve's own random stream, apart from the batch arrangement's


def validation_count(size: float, available: int) -> int:
    """Pairs held out for ``size``: a count (a whole number >= 1) or a fraction of ``available`` (0 < size < 1)."""
    if size <= 0:
        return 0
    return int(size) if size >= 1 else max(1, round(size * available))


def hold_out(
    examples_by_source: dict[str, list[TrainExample]], size: float, seed: int
) -> tuple[dict[str, list[TrainExample]], list[TrainExample]]:
    """Carve a validation slice out of the training examples before anything is arranged or trained.

    ``size`` is a count (>= 1) or a fraction (0 < size < 1) of all examples; 0 carves nothing. The slice is
    drawn with its own generator seeded by ``seed``, over the sources in sorted order and each source's
    examples in file order, so it depends only on the data and the seed: the same on a resume and in
    every process of a run. Returns the remaining examples by source and the slice, in a shuffled order
    (so that the batches of the slice mix sources and topics).
    """
    names = sorted(examples_by_source)
    everything = [(name, i) for name in names for i in range(len(examples_by_source[name]))]
    count = validation_count(size, len(everything))
    if count == 0:
        return examples_by_source, []
    if count >= len(everything):
        raise DataError(
            f"validation_size {size:g} holds out {count} of the {len(everything)} training examples; "
            "leave some to train on (a smaller count or fraction)"
        )
    chosen = random.Random(seed ^ HOLD_OUT_SALT).sample(everything, count)
    taken = set(chosen)
    remaining = {
        name: [ex for i, ex in enumerate(examples_by_source[name]) if (name, i) not in taken] for name in names
    }
    return remaining, [examples_by_source[name][i] for name, i in chosen]


def _listing(folder: str, n: int = 2) -> str:
    """``folder/a.jsonl,folder/b.jsonl``: the first ``n`` JSON-lines files of ``folder`` (for a hint)."""
    try:
        names = sorted(name for name in os.listdir(folder) if name.endswith(".jsonl"))[:n]
    except OSError:
        names = []
    return ",".join(os.path.join(folder, name) for name in names) or os.path.join(folder, "<name>.jsonl")


def check_path_kind(path: str, dataset_name: str, what: str = "dataset_file_path") -> None:
    """A data path that exists is of the kind its reader needs: E5's is a folder of ``<source>.jsonl`` files,
    every other (``jsonl`` training files, ``validation_file``: ``dataset_name`` ``"jsonl"``) a file. Raises
    :class:`DataError` naming ``what``, the path and what to give instead; a missing path is left to the reader."""
    if dataset_name == "E5" and os.path.isfile(path):
        raise DataError(
            f"{what} {path} is a file; dataset_name E5 reads the folder that holds the E5 <source>.jsonl files: give "
            "that folder, or set dataset_name jsonl to train on this file"
        )
    if dataset_name != "E5" and os.path.isdir(path):
        raise DataError(
            f"{what} {path} is a folder; a JSON-lines file is expected here: name the files, joined by ',' "
            f"(e.g. {_listing(path)})"
            + (
                ", or set dataset_name E5 if it holds the E5 <source>.jsonl files"
                if what == "dataset_file_path"
                else ""
            )
        )


def missing_files(paths: Iterable[str]) -> list[str]:
    """The paths in ``paths`` that are not existing files, in order."""
    return [p for p in paths if not os.path.isfile(p)]


def examples_from_records(records, source: str, instruction_of) -> list[TrainExample]:
    """``TrainExample``s of one source; ``instruction_of(record)`` gives each query's instruction."""
    return [
        TrainExample(
            query=r.query,
            positive=r.positive,
            negative=r.negative,
            query_instruction=instruction_of(r),
            source=source,
            origin=f"{r.path}:{r.line}" if r.path else "",
        )
        for r in records
    ]
