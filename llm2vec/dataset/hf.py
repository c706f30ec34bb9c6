"""Training data from Hugging Face ``datasets`` (``dataset_name: hf``, docs/data.md): each source's columns mapped
to :data:`ROLES`, its rows checked by the JSON-lines loader's rules in one vectorised scan that names a bad row."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..io import MAX_LINE_BYTES
from ..keywords import strict_booleans
from .arrow import BUILDERS, FILES, SCAN_ROWS, open_dataset
from .base import SourceStats, TrainDataset, arrange_positions, held_out_positions, record_counts
from .records import DataError, FileReport, TrainExample, check_report

logger = logging.getLogger(__name__)

ROLES = ("query", "positive", "negative", "instruction")
DEFAULT_COLUMNS = {role: (role,) for role in ROLES} | {"query": ("query", "anchor")}  # anchor: sentence-transformers'


def check_column_map(column_map) -> None:
    """``column_map`` is ``{role: column}`` and/or ``{source: {role: column}}``; else ``ValueError`` naming why."""
    if column_map is not None and not isinstance(column_map, Mapping):
        raise ValueError(f"column_map must be a JSON object of role: column, got {type(column_map).__name__}")
    for key, value in (column_map or {}).items():
        own = isinstance(value, Mapping)
        for role, column in value.items() if own else [(key, value)]:
            where = f"column_map[{key!r}]" if own else "column_map"
            if role not in ROLES:
                raise ValueError(
                    f"{where}: {role!r} is not a role (nor, at the top, an object of a source's roles); the roles "
                    f"are {', '.join(ROLES)}"
                )
            if not isinstance(column, str) or not column:
                raise ValueError(f"{where}[{role!r}]: give a column name, got {column!r}")


def open_sources(paths, column_map, split, cache_dir, default_instruction="", require_negative=False) -> dict:
    """``name -> Source`` of ``paths`` (joined by ``,`` or a list), opened and their columns resolved; refuses
    none, two of one name, missing paths (all listed) and a ``column_map`` entry that names no source."""
    given = [p.strip() for p in paths.split(",")] if isinstance(paths, str) else [os.fspath(p) for p in paths]
    sources: dict[str, Source] = {}
    for source in [Source(p) for p in given if p]:
        if source.name in sources:
            raise DataError(
                f"dataset_file_path: {sources[source.name].label} and {source.label} have the same name "
                f"'{source.name}', which names the source of their examples; rename one, or merge them."
            )
        sources[source.name] = source
    if not sources:
        raise DataError("dataset_file_path: no datasets given")
    if missing := [s.label for s in sources.values() if s.path is not None and not os.path.exists(s.path)]:
        listed = "".join(f"\n  - {p}" for p in missing)
        where = f"relative paths are resolved from {os.getcwd()}"
        raise DataError(f"{len(missing)} of {len(sources)} datasets not found:{listed}\nCheck the paths ({where}).")
    check_column_map(column_map)
    own = {k: v for k, v in (column_map or {}).items() if isinstance(v, Mapping)}
    shared = {k: v for k, v in (column_map or {}).items() if k not in own}
    if unknown := [k for k in own if k not in sources]:
        raise DataError(
            f"column_map: {', '.join(map(repr, unknown))} names no source; the sources are: {', '.join(sources)}"
        )
    for name, source in sources.items():
        source.dataset, source.notes = open_dataset(
            source.label, source.path, source.repo, source.config, split, cache_dir
        )
        source.resolve({**shared, **own.get(name, {})}, default_instruction.strip(), require_negative)
    return sources


class Source:
    """One entry of ``dataset_file_path``: a local ``path`` or a cached dataset id (``repo``, ``config``); once
    opened and resolved, its memory-mapped ``dataset`` and the column of each role (``None``: no such field)."""

    def __init__(self, given: str):
        self.label, self.path, self.repo, self.config = given, None, None, None
        local = Path(given).suffix in FILES or given.startswith(("/", "./", "../", "~")) or given.count("/") > 1
        if os.path.exists(given) or local:  # a dataset id is owner/name[:config]
            self.path, self.name = given, Path(given).name if os.path.isdir(given) else Path(given).stem
            return
        self.repo, _, config = given.partition(":")
        self.config, self.name = config or None, given
        if self.repo.lower() in BUILDERS:
            raise DataError(
                f"dataset_file_path {given!r}: the name of a datasets builder, which would read every matching "
                f"file under {os.getcwd()}; give the data files themselves ({', '.join(FILES)}) or a "
                "save_to_disk folder"
            )

    def resolve(self, column_map: dict[str, str], default_instruction: str, require_negative: bool) -> None:
        """The column of each role (``column_map``'s, else :data:`DEFAULT_COLUMNS`), refusing a mapped column the
        dataset lacks, an ambiguous or missing required one (listing the columns), or one that is not of text."""
        self.default_instruction = default_instruction
        self.required = ("query", "positive", "negative")[: 3 if require_negative else 2]
        available = list(self.dataset.column_names)
        listing = f"its columns are: {', '.join(available) or '(none)'}"
        hint = 'map one with column_map, e.g. {"%s": "<column>"}'
        for role, column in column_map.items():
            if column not in available:
                raise DataError(
                    f'{self.label}: column_map maps "{role}" to "{column}", which is not a column; {listing}'
                )
        self.columns: dict[str, str | None] = {}
        for role in ROLES:
            found = [column_map[role]] if role in column_map else [c for c in DEFAULT_COLUMNS[role] if c in available]
            if len(found) > 1:
                raise DataError(f'{self.label}: both {" and ".join(found)} could be the "{role}" column; {hint % role}')
            if not found and role in self.required:
                looked = " or ".join(f'"{c}"' for c in DEFAULT_COLUMNS[role])
                why = " (Stage II with require_negative: every row needs a hard negative)" if role == "negative" else ""
                raise DataError(
                    f'{self.label}: no column for field "{role}"{why}: looked for {looked}; {listing}; {hint % role}'
                )
            self.columns[role] = found[0] if found else None
            if found:
                self._check_type(role)

    def _check_type(self, role: str) -> None:
        """Raise at the first row of the role's column that holds no string; nulls only: no such field, if optional."""
        column = self.columns[role]
        feature, array = self.dataset.features[column], self.dataset.data.column(column)
        if column in self.notes.get("not_text", {}):
            row, text = self.notes["not_text"][column]
            self.fail(row, f"{self.field(role)} must be a string, got JSON {text}")
        if getattr(feature, "dtype", None) not in ("string", "large_string"):
            if (row := pc.index(pc.is_valid(array), True).as_py()) >= 0:
                got = f"{getattr(feature, 'dtype', feature)} ({repr(array[row].as_py())[:60]})"
                self.fail(row, f"{self.field(role)} must be a string, got {got}")
            if role not in self.required:
                self.columns[role] = None

    def field(self, role: str) -> str:
        column = self.columns[role]
        return f'field "{role}"' + (f' (column "{column}")' if column != role else "")

    def fail(self, row: int, problem: str):
        """Raise :class:`DataError` naming the row (and, converted from JSON lines, its line)."""
        line = row + 1
        for blank in self.notes.get("blank", ()):  # in order: each blank line up to the row's moves it one down
            line += blank <= line
        where = f" (line {line})" if "blank" in self.notes else ""
        raise DataError(f"{self.label}, row {row}{where}: {problem}. Fix or remove this row.")

    def example(self, row: int) -> TrainExample:
        """The training example of table row ``row``, as the JSON-lines loader builds it from the same record."""
        query, positive, negative, instruction = (self._text(role, row) for role in ROLES)
        instruction = self.default_instruction if instruction is None else instruction
        return TrainExample(query, positive, negative or None, instruction, self.name, f"{self.label}, row {row}")

    def _text(self, role: str, row: int) -> str | None:
        column = self.columns[role]
        value = None if column is None else self.dataset.data.column(column)[row].as_py()
        return None if value is None else value.strip()

    def _stripped(self, role: str, array, offset: int):
        """``array`` (rows from ``offset``) stripped of exactly what ``str.strip`` removes; refuses a null required
        text, a text that is not UTF-8 or one longer than :data:`~llm2vec.io.MAX_LINE_BYTES`."""
        if role in self.required and array.null_count:
            self.fail(
                offset + pc.index(pc.is_null(array), True).as_py(), f"required {self.field(role)} is missing or null"
            )
        try:
            array.validate(full=True)
        except pa.ArrowInvalid:
            for i, raw in enumerate(array.cast(pa.large_binary()).to_pylist()):
                try:
                    (raw or b"").decode()
                except UnicodeDecodeError as e:
                    self.fail(offset + i, f"{self.field(role)} is not valid UTF-8 ({e.reason})")
        sizes = pc.binary_length(array)
        if (row := pc.index(pc.greater(sizes, MAX_LINE_BYTES), True).as_py()) >= 0:
            self.fail(
                offset + row,
                f"{self.field(role)} holds {sizes[row].as_py():,} bytes, more than {MAX_LINE_BYTES:,} (llm2vec.io."
                "MAX_LINE_BYTES, the longest JSON-lines line read), more than any text a model reads; it is not read",
            )
        return pc.utf8_trim_whitespace(array)

    def scan(self, limit: int | None) -> tuple[SourceStats, np.ndarray]:
        """Check every row and keep those whose required texts are not empty (at most ``limit``, the first);
        warns as the JSON-lines loader does. Returns the counts and the rows kept."""
        roles = [r for r in ROLES if self.columns[r] is not None]
        table = self.dataset.data.table.select([self.columns[r] for r in roles])
        kept, skipped, hashes, same, records = [], [], [], [np.empty(0, np.int64)], 0
        for batch in table.to_batches(max_chunksize=SCAN_ROWS):
            texts = {role: self._stripped(role, array, records) for role, array in zip(roles, batch.columns)}
            empty = [pc.equal(pc.binary_length(texts[r]), 0).to_numpy(zero_copy_only=False) for r in self.required]
            skip, left = np.logical_or.reduce(empty), None if limit is None else limit - sum(map(len, kept))
            rows = np.flatnonzero(~skip)[:left]
            full = left is not None and len(rows) == left
            end = int(rows[-1]) + 1 if full else batch.num_rows
            skipped.append(np.flatnonzero(skip[:end]) + records)
            pairs = zip(texts["query"].take(rows).to_pylist(), texts["positive"].take(rows).to_pylist())
            hashes.append(np.fromiter(map(hash, pairs), np.int64, len(rows)))
            if "negative" in texts:
                equal = pc.fill_null(pc.equal(texts["negative"], texts["positive"]), False)
                same.append(rows[equal.to_numpy(zero_copy_only=False)[rows]] + records)
            kept.append(rows + records)
            records += end
            if full:
                break
        kept, skipped, same = np.concatenate(kept), np.concatenate(skipped), np.concatenate(same)
        repeats = np.ones(len(kept), bool)
        repeats[np.unique(np.concatenate(hashes), return_index=True)[1]] = False  # all but the first row of each pair
        dup, same = kept[repeats].tolist(), same.tolist()
        report = FileReport(self.label, records, len(kept), len(skipped), duplicates=dup, negative_is_positive=same)
        first = next(r for r in self.required if not self._text(r, int(skipped[0]))) if len(skipped) else None
        where = f" (the first: row {skipped[0]}, {self.field(first)})" if first else ""
        check_report(report, self.required, "row", where)
        local = self.path is not None and os.path.isfile(self.path)
        files = [self.path] if local else [f["filename"] for f in self.dataset.cache_files]
        return SourceStats(self.name, files, records=records, skipped_empty=len(skipped)), kept

    def instruction_codes(self) -> tuple[np.ndarray, list[str]]:
        """``(codes, instructions)``: each row's query instruction (stripped, the default for none) as an integer."""
        if self.columns["instruction"] is None:
            return np.zeros(self.dataset.num_rows, np.int32), [self.default_instruction]
        column = self.dataset.data.column(self.columns["instruction"])
        encoded = pc.dictionary_encode(column, null_encoding="encode")  # one dictionary for every chunk
        values = pc.fill_null(pc.utf8_trim_whitespace(encoded.chunk(0).dictionary), self.default_instruction)
        return pa.chunked_array([chunk.indices for chunk in encoded.chunks]).to_numpy(), values.to_pylist()


class ArrowTrainDataset(TrainDataset):
    """A :class:`TrainDataset` over memory-mapped tables, holding integers (the source of each global batch, the
    table row of each example); item ``i`` is built when read, and ``examples`` is the dataset itself."""

    def __init__(self, tables: list[Source], batch_sources, rows, stats, global_batch_size, seed, held_out):
        super().__init__(self, stats, global_batch_size, seed, held_out)
        self.tables, self._batch_sources, self._rows = tables, batch_sources, rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # from the end if negative; IndexError out of range
        return self.tables[self._batch_sources[index // self.global_batch_size]].example(int(self._rows[index]))

    def instruction_examples(self) -> list[TrainExample]:
        """The first training example, then one of each other distinct query instruction: its first trained row in
        each source's table order (found with ``pyarrow``, not by building every example)."""
        found = {self[0].query_instruction: self[0]}
        per_example = np.repeat(self._batch_sources, self.global_batch_size)
        for s, source in enumerate(self.tables):
            rows = np.sort(self._rows[per_example == s])
            codes, values = source.instruction_codes()
            for i in np.sort(np.unique(codes[rows], return_index=True)[1]):  # each code's first row, in table order
                found.setdefault(values[codes[rows[i]]], source.example(int(rows[i])))
        return list(found.values())


@strict_booleans
def load_hf(
    paths: str | Sequence[str],
    global_batch_size: int,
    seed: int = 42,
    *,
    column_map: Mapping | None = None,
    split: str = "train",
    default_instruction: str = "",
    require_negative: bool = False,
    validation_size: float = 0,
    max_per_source: int | None = None,
    cache_dir: str | None = None,
) -> ArrowTrainDataset:
    """Load the datasets of ``paths`` (module docstring), one source each, into single-source global batches, in
    :func:`~llm2vec.dataset.jsonl.load_jsonl`'s order for the same rows; ``split``: of a ``DatasetDict`` or an id;
    ``max_per_source``: the first rows of each source that pass the checks; ``cache_dir``: ``datasets``' cache."""
    if max_per_source is not None and max_per_source < 1:
        raise ValueError(f"max_per_source must be positive or None, got {max_per_source}")
    sources = open_sources(paths, column_map, split, cache_dir, default_instruction, require_negative)
    stats, kept = {}, {}
    for name, source in sources.items():
        stats[name], kept[name] = source.scan(max_per_source)
    chosen = held_out_positions({n: len(k) for n, k in kept.items()}, validation_size, seed)
    held_out = [sources[name].example(int(kept[name][i])) for name, i in chosen]
    order = sorted(kept) if chosen else list(kept)  # the order in which hold_out leaves the sources
    kept = {name: np.delete(kept[name], [i for n, i in chosen if n == name]) for name in order}
    plan = arrange_positions(sizes := {n: len(k) for n, k in kept.items()}, global_batch_size, seed)
    record_counts(sizes, plan.dropped, stats, global_batch_size)
    names = sorted(sources)  # record_counts has refused a plan without chunks
    batch_sources = np.array([names.index(n) for n, _ in plan.chunks], dtype=np.int32)
    rows = np.concatenate([kept[n][np.frombuffer(plan.positions(n, k), np.int64)] for n, k in plan.chunks])
    tables = [sources[n] for n in names]
    return ArrowTrainDataset(tables, batch_sources, rows, stats, global_batch_size, seed, held_out)


def instruction_counts(paths, column_map=None, split="train", default_instruction="", cache_dir=None) -> Counter[str]:
    """``instruction -> rows`` of the datasets as :func:`load_hf` reads them (stripped; ``default_instruction``
    where a row has none): what an export reads back for its query prompt."""
    counts: Counter[str] = Counter()
    for source in open_sources(paths, column_map, split, cache_dir, default_instruction).values():
        codes, values = source.instruction_codes()
        for value, n in zip(values, np.bincount(codes, minlength=len(values)).tolist()):
            counts[value] += n
    return counts
