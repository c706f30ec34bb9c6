"""Single-source global batches: the dataset the loaders (``e5.py``, ``jsonl.py``, ``hf.py``) return."""

from __future__ import annotations

import bisect
import itertools
import logging
import random
from array import array
from dataclasses import dataclass, field

import torch

from .records import DataError, FileReport, TrainExample

logger = logging.getLogger(__name__)


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


@dataclass
class Arrangement:
    """Where each example of each source goes, by position: ``order[name]`` the shuffled positions (chunk ``k``:
    :meth:`positions`), ``chunks`` the ``(name, k)`` in training order, ``dropped[name]`` the tail."""

    order: dict[str, array]
    chunks: list[tuple[str, int]]
    dropped: dict[str, int]
    global_batch_size: int

    def positions(self, name: str, k: int) -> array:
        """The positions of chunk ``k`` of source ``name``."""
        g = self.global_batch_size
        return self.order[name][k * g : (k + 1) * g]


def arrange_positions(sizes: dict[str, int], global_batch_size: int, seed: int) -> Arrangement:
    """Arrange ``sizes[name]`` examples of each source into single-source chunks of ``global_batch_size``, depending
    only on the sizes and ``seed``."""
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    rng = random.Random(seed)
    order: dict[str, array] = {}
    chunks: list[tuple[str, int]] = []
    dropped: dict[str, int] = {}
    # Sorted, so the result does not depend on the dict's insertion order.
    for name in sorted(sizes):
        positions = array("q", range(sizes[name]))
        rng.shuffle(positions)
        n_full = sizes[name] // global_batch_size
        chunks.extend((name, k) for k in range(n_full))
        dropped[name] = sizes[name] - n_full * global_batch_size
        order[name] = positions
    rng.shuffle(chunks)
    return Arrangement(order, chunks, dropped, global_batch_size)


def arrange_global_batches(
    examples_by_source: dict[str, list[TrainExample]], global_batch_size: int, seed: int
) -> list[TrainExample]:
    """The examples ordered so that each consecutive block of ``global_batch_size`` is single-source (docs/design.md);
    the tails that fill no block are dropped and logged."""
    plan = arrange_positions({n: len(e) for n, e in examples_by_source.items()}, global_batch_size, seed)
    _log_dropped(plan.dropped, global_batch_size)
    return [examples_by_source[name][i] for name, k in plan.chunks for i in plan.positions(name, k)]


def _log_dropped(dropped: dict[str, int], global_batch_size: int) -> None:
    total = sum(dropped.values())
    if total:
        detail = ", ".join(f"{name}: {n}" for name, n in dropped.items() if n)
        logger.info("dropped %d examples that do not fill a global batch of %d (%s)", total, global_batch_size, detail)


def record_counts(
    sizes: dict[str, int], dropped: dict[str, int], stats: dict[str, SourceStats], global_batch_size: int
):
    """Log the dropped tails and fill each source's counts; a :class:`DataError` when no source has enough examples
    for one global batch."""
    _log_dropped(dropped, global_batch_size)
    for name, n in sizes.items():
        s = stats.setdefault(name, SourceStats(name=name))
        s.loaded = n
        s.dropped_tail = dropped[name]
        s.kept = n - dropped[name]
        if s.kept == 0:
            logger.warning(
                "source %s has %d examples, fewer than one global batch of %d; none of it is used",
                name,
                n,
                global_batch_size,
            )
    if not any(n - dropped[name] for name, n in sizes.items()):
        counts = ", ".join(f"{n}: {size}" for n, size in sorted(sizes.items()))
        raise DataError(
            f"no source has enough examples for one global batch of {global_batch_size} "
            f"({counts or 'no sources'}). Lower the global batch size or add data."
        )


class TrainDataset(torch.utils.data.Dataset):
    """The arranged training examples, to be read with a sequential sampler; build it with :meth:`from_sources`."""

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
        """``examples_by_source`` in single-source global batches after the validation slice (``held_out``,
        :func:`hold_out`) is carved out; a :class:`DataError` when no source fills one global batch."""
        stats = dict(stats or {})
        examples_by_source, held_out = hold_out(examples_by_source, validation_size, seed)
        sizes = {n: len(e) for n, e in examples_by_source.items()}
        plan = arrange_positions(sizes, global_batch_size, seed)
        record_counts(sizes, plan.dropped, stats, global_batch_size)
        arranged = [examples_by_source[name][i] for name, k in plan.chunks for i in plan.positions(name, k)]
        return cls(arranged, stats, global_batch_size, seed, held_out)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> TrainExample:
        return self.examples[index]

    @property
    def num_global_batches(self) -> int:
        return len(self.examples) // self.global_batch_size

    def instruction_examples(self) -> list[TrainExample]:
        """The first training example of each distinct query instruction, in training order."""
        first: dict[str, TrainExample] = {}
        for example in self.examples:
            first.setdefault(example.query_instruction, example)
        return list(first.values())

    def summary(self) -> str:
        """A table of counts per source (records, skipped, dropped tail, kept)."""
        header = ("source", "records", "skipped_empty", "dropped_tail", "kept")
        rows = [
            (s.name, s.records, s.skipped_empty, s.dropped_tail, s.kept)
            for s in (self.sources[n] for n in sorted(self.sources))
        ]
        table = [header, *rows, ("total", *(sum(r[i] for r in rows) for i in range(1, len(header))))]
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


def held_out_positions(sizes: dict[str, int], size: float, seed: int) -> list[tuple[str, int]]:
    """``(source, position)`` of the validation slice (:func:`validation_count` of all examples) of sources of
    ``sizes[name]`` examples, drawn with its own generator: it depends only on the sizes and ``seed``."""
    names = sorted(sizes)
    ends = list(itertools.accumulate(sizes[name] for name in names))
    total = ends[-1] if ends else 0
    count = validation_count(size, total)
    if count == 0:
        return []
    if count >= total:
        raise DataError(
            f"validation_size {size:g} holds out {count} of the {total} training examples; "
            "leave some to train on (a smaller count or fraction)"
        )
    chosen = random.Random(seed ^ HOLD_OUT_SALT).sample(range(total), count)
    out = []
    for index in chosen:
        s = bisect.bisect_right(ends, index)
        out.append((names[s], index - (ends[s - 1] if s else 0)))
    return out


def hold_out(
    examples_by_source: dict[str, list[TrainExample]], size: float, seed: int
) -> tuple[dict[str, list[TrainExample]], list[TrainExample]]:
    """The examples without a validation slice (:func:`held_out_positions`) by source, and the slice."""
    chosen = held_out_positions({n: len(e) for n, e in examples_by_source.items()}, size, seed)
    if not chosen:
        return examples_by_source, []
    taken = set(chosen)
    remaining = {
        name: [ex for i, ex in enumerate(examples_by_source[name]) if (name, i) not in taken]
        for name in sorted(examples_by_source)
    }
    return remaining, [examples_by_source[name][i] for name, i in chosen]


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
