"""Training data from Hugging Face ``datasets``, memory-mapped: ``dataset_name: hf`` (docs/data.md).

Each entry of ``dataset_file_path`` is one source: a ``save_to_disk`` folder, a ``.parquet`` / ``.arrow`` /
``.json`` / ``.jsonl`` file, or a dataset id in the local cache (read offline). Columns are mapped to
:data:`ROLES`; rows follow the JSON-lines loader's rules, checked in one vectorised scan, a bad row refused
naming the dataset, row and field. The loader keeps integers only and arranges the rows as the JSON-lines
loader arranges the same rows.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import operator
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..config_values import strict_booleans
from ..io import MAX_LINE_BYTES, iter_jsonl, sha256_file
from .base import SourceStats, TrainDataset, arrange_positions, held_out_positions, record_counts
from .records import DataError, FileReport, TrainExample, warn_suspect_pairs

logger = logging.getLogger(__name__)

ROLES = ("query", "positive", "negative", "instruction")
DEFAULT_COLUMNS = {  # a role's columns without a mapping; "anchor" is sentence-transformers' query
    "query": ("query", "anchor"),
    "positive": ("positive",),
    "negative": ("negative",),
    "instruction": ("instruction",),
}
FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}
SCAN_ROWS = 8192  # rows per block of the checks: their memory is bounded by a block, not the dataset
FIX = "Fix or remove this row."
CONVERTED_FROM = "llm2vec-converted-from.json"  # beside a conversion: the SHA-256 of the file it was made from


def check_column_map(column_map: Any) -> None:
    """``column_map`` is ``{role: column}`` and/or ``{source: {role: column}}``; else ``ValueError`` naming why."""
    if column_map is None:
        return
    if not isinstance(column_map, Mapping):
        raise ValueError(f"column_map must be a JSON object of role: column, got {type(column_map).__name__}")
    for key, value in column_map.items():
        entries, where = (
            (value.items(), f"column_map[{key!r}]") if isinstance(value, Mapping) else ([(key, value)], "column_map")
        )
        for role, column in entries:
            if role not in ROLES:
                raise ValueError(
                    f"{where}: {role!r} is not a role (nor, at the top, an object of a source's roles); the roles "
                    f"are {', '.join(ROLES)}"
                )
            if not isinstance(column, str) or not column:
                raise ValueError(f"{where}[{role!r}]: give a column name, got {column!r}")


def source_column_maps(column_map: Mapping | None, names: Sequence[str]) -> dict[str, dict[str, str]]:
    """``name -> {role: column}``: the shared roles, a source's own over them; a source entry must name a source."""
    check_column_map(column_map)
    shared = {k: v for k, v in (column_map or {}).items() if not isinstance(v, Mapping)}
    own = {k: dict(v) for k, v in (column_map or {}).items() if isinstance(v, Mapping)}
    unknown = [k for k in own if k not in names]
    if unknown:
        raise DataError(
            f"column_map: {', '.join(map(repr, unknown))} names no source; the sources are: {', '.join(names)}"
        )
    return {name: {**shared, **own.get(name, {})} for name in names}


# ---------------------------------------------------------------------------------------------- the sources


class Spec:
    """One entry of ``dataset_file_path``: a local ``path``, or a cached dataset id (``repo``, ``config``)."""

    def __init__(self, given: str):
        self.given, self.path, self.repo, self.config = given, None, None, None
        looks_local = Path(given).suffix in FILE_BUILDERS or given.startswith(("/", "./", "../", "~"))
        if os.path.exists(given) or looks_local or given.count("/") > 1:  # an id is owner/name[:config]
            self.path, self.name = given, Path(given).name if os.path.isdir(given) else Path(given).stem
            return
        self.repo, _, config = given.partition(":")
        self.config, self.name = config or None, given
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES as builders

        if self.repo.lower() in builders:
            raise DataError(
                f"dataset_file_path {given!r}: the name of a datasets builder, which would read every matching "
                f"file under {os.getcwd()}; give the data files themselves ({', '.join(FILE_BUILDERS)}) or a "
                "save_to_disk folder"
            )


def parse_specs(paths: str | Sequence[str]) -> list[Spec]:
    """The sources of ``paths`` (joined by ``,`` or a list); refuses none, two of one name, and missing paths."""
    given = [p.strip() for p in paths.split(",")] if isinstance(paths, str) else [os.fspath(p) for p in paths]
    specs = [Spec(p) for p in given if p]
    if not specs:
        raise DataError("dataset_file_path: no datasets given")
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.name in seen:
            raise DataError(
                f"dataset_file_path: {seen[spec.name]} and {spec.given} have the same name '{spec.name}', which "
                "names the source of their examples; rename one, or merge them."
            )
        seen[spec.name] = spec.given
    missing = [s.given for s in specs if s.path is not None and not os.path.exists(s.path)]
    if missing:
        raise DataError(
            f"{len(missing)} of {len(specs)} datasets not found:\n"
            + "\n".join(f"  - {p}" for p in missing)
            + f"\nCheck the paths (relative paths are resolved from {os.getcwd()})."
        )
    return specs


@contextlib.contextmanager
def _offline():
    import datasets
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def open_source(spec: Spec, split: str, cache_dir: str | None = None):
    """The memory-mapped ``datasets.Dataset`` of ``spec`` (read offline) and the files it reads."""
    import datasets

    try:
        with _offline():
            if spec.repo is not None:
                dataset = datasets.load_dataset(spec.repo, spec.config, split=split, cache_dir=cache_dir)
            elif os.path.isdir(spec.path):
                dataset = _from_disk(spec.path, split)
            else:
                dataset = _from_file(spec.path, cache_dir)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever datasets raises: one line naming the source
        if spec.repo is not None:
            raise DataError(
                f"dataset {spec.given}: no local file or folder of that name, and not readable from the local "
                f"datasets cache as a dataset id ({_first_line(e)}). Download it once where there is network "
                "(datasets.load_dataset), or give a local file or save_to_disk folder"
            ) from e
        if _has_no_rows(spec.path, split):
            raise DataError(f"{spec.given}: the dataset has no rows; give one with (query, positive) rows") from None
        if spec.path.endswith(".jsonl"):
            _find_bad_line(spec.path)
        raise DataError(f"{spec.given}: cannot read it as a dataset ({_first_line(e.__cause__ or e)})") from e
    files = [spec.path] if spec.path and os.path.isfile(spec.path) else [f["filename"] for f in dataset.cache_files]
    return dataset, files


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _has_no_rows(path: str, split: str) -> bool:
    """Whether the local dataset ``path``, which ``datasets`` failed to read, holds no rows."""
    with contextlib.suppress(Exception):
        if os.path.isdir(path):
            state = next(f for f in (Path(path, split, "state.json"), Path(path, "state.json")) if f.is_file())
            return not json.loads(state.read_text()).get("_data_files")
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows == 0
        return os.path.getsize(path) < 1 << 20 and not Path(path).read_bytes().strip()
    return False


def _find_bad_line(path: str) -> None:
    """Raise at the first line of a JSON-lines file that is not a JSON object of text (a lone surrogate is none)."""
    fix = FIX.replace("row", "line")
    for line_no, obj in iter_jsonl(path, error=DataError, fix=fix):
        for key, value in (obj or {}).items():
            try:
                isinstance(value, str) and value.encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(
                    f'{path}:{line_no}: field "{key}" holds half of a UTF-16 surrogate pair, which is not a '
                    f"character (a broken \\uXXXX escape). {fix}"
                ) from None


def _from_disk(folder: str, split: str):
    import datasets

    state, listing = datasets.config.DATASET_STATE_JSON_FILENAME, datasets.config.DATASETDICT_JSON_FILENAME
    if not any(os.path.isfile(os.path.join(folder, name)) for name in (state, listing)):
        raise DataError(
            f"{folder} is a folder but not one written by save_to_disk (no {state} or {listing}); give its data "
            "files, joined by ','"
        )
    loaded = datasets.load_from_disk(folder, keep_in_memory=False)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{folder}: no split {split!r}; its splits are: {', '.join(loaded)} (set dataset_split)")
        return loaded[split]
    return loaded


def _from_file(path: str, cache_dir: str | None):
    """A ``datasets``-written Arrow stream mapped as it is; other files converted into the cache, again unless
    the cached conversion was made from these bytes (``datasets`` keys it by path and modification time only)."""
    import datasets

    suffix = Path(path).suffix
    if suffix not in FILE_BUILDERS:
        raise DataError(
            f"{path}: not a file datasets reads here; give a {', '.join(FILE_BUILDERS)} file, a save_to_disk "
            "folder or a cached dataset id"
        )
    if suffix == ".arrow":
        with contextlib.suppress(Exception):
            return datasets.Dataset.from_file(path, in_memory=False)
    options = {}
    if suffix == ".parquet":  # pyarrow's pre-buffering would hold every row group read until the file is done
        import pyarrow.dataset as pds

        options["fragment_scan_options"] = pds.ParquetFragmentScanOptions(pre_buffer=False)
    before, digest = os.stat(path), sha256_file(path)
    builder = datasets.load_dataset_builder(FILE_BUILDERS[suffix], data_files=path, cache_dir=cache_dir, **options)
    record = Path(builder.cache_dir) / CONVERTED_FROM
    try:
        same = json.loads(record.read_text()).get("sha256") == digest
    except (OSError, ValueError, AttributeError):
        same = False
    builder.download_and_prepare(download_mode=None if same else datasets.DownloadMode.FORCE_REDOWNLOAD)
    after = os.stat(path)
    if any(getattr(before, a) != getattr(after, a) for a in ("st_size", "st_mtime_ns", "st_ctime_ns")):
        raise DataError(f"{path}: the file changed while it was read; run again once it is written")
    record.write_text(json.dumps({"path": os.path.realpath(path), "sha256": digest}))
    return builder.as_dataset(split="train")


# ---------------------------------------------------------------------------------------------- one source


class Source:
    """One dataset: its memory-mapped table and the column of each role (checked to hold strings)."""

    def __init__(self, spec: Spec, dataset, files, column_map: dict, default_instruction: str, require_negative: bool):
        self.name, self.label, self.spec, self.dataset, self.files = spec.name, spec.given, spec, dataset, files
        self.default_instruction = default_instruction
        self.required = ("query", "positive", "negative") if require_negative else ("query", "positive")
        self._arrays: dict[str, Any] = {}
        available = list(dataset.column_names)
        listing = f"its columns are: {', '.join(available) or '(none)'}"
        hint = 'map one with column_map, e.g. {"%s": "<column>"}'
        for role, column in column_map.items():
            if column not in available:
                raise DataError(
                    f'{self.label}: column_map maps "{role}" to "{column}", which is not a column; {listing}'
                )
        self.columns: dict[str, str | None] = {}
        for role in ROLES:
            present = [column_map[role]] if role in column_map else [c for c in DEFAULT_COLUMNS[role] if c in available]
            if len(present) > 1:
                raise DataError(
                    f'{self.label}: both {" and ".join(present)} could be the "{role}" column; {hint % role}'
                )
            if not present and role in self.required:
                looked = " or ".join(f'"{c}"' for c in DEFAULT_COLUMNS[role])
                why = " (Stage II with require_negative: every row needs a hard negative)" if role == "negative" else ""
                raise DataError(
                    f'{self.label}: no column for field "{role}"{why}: looked for {looked}; {listing}; {hint % role}'
                )
            self.columns[role] = present[0] if present else None
            if present:
                self.columns[role] = self._check_type(role, present[0])

    def _check_type(self, role: str, column: str) -> str | None:
        """``column`` if it holds strings (a column of nulls only: ``None`` for an optional role); else an error
        naming the first row that holds something else."""
        import datasets

        feature = self.dataset.features[column]
        dtype = getattr(feature, "dtype", None)
        if dtype in ("string", "large_string", "null"):
            return None if dtype == "null" and role not in self.required else column
        array = self.dataset.data.column(column)
        is_json = isinstance(feature, getattr(datasets, "Json", ()))  # a JSON file's column of mixed types
        if is_json:
            array = pa.chunked_array([chunk.storage for chunk in array.chunks], array.type.storage_type)
        row = pc.index(pc.invert(pc.starts_with(array, '"')) if is_json else pc.is_valid(array), True).as_py()
        if row < 0:
            raise DataError(f"{self.label}: {self.field(role)} must hold strings, its type is {feature}")
        value = array[row].as_py()
        shown = (value if isinstance(value, str) else repr(value))[:60]
        self.fail(
            row,
            f"{self.field(role)} must be a string, got "
            + (f"JSON {shown}" if is_json else f"{dtype or type(feature).__name__} ({shown})"),
        )

    def __getstate__(self):  # the cached columns are rebuilt after unpickling
        return {**self.__dict__, "_arrays": {}}

    def _text(self, role: str, row: int) -> str | None:
        if self.columns[role] is None:
            return None
        if role not in self._arrays:
            self._arrays[role] = self.dataset.data.column(self.columns[role])
        value = self._arrays[role][row].as_py()
        return None if value is None else value.strip()

    def example(self, row: int) -> TrainExample:
        """The training example of table row ``row``, as the JSON-lines loader builds it from the same record."""
        instruction = self._text("instruction", row)
        return TrainExample(
            query=self._text("query", row),
            positive=self._text("positive", row),
            negative=self._text("negative", row) or None,
            query_instruction=self.default_instruction if instruction is None else instruction,
            source=self.name,
            origin=f"{self.label}, row {row}",
        )

    def field(self, role: str) -> str:
        column = self.columns[role]
        return f'field "{role}"' + (f' (column "{column}")' if column != role else "")

    def fail(self, row: int, problem: str):
        """Raise :class:`DataError` at ``row`` (``label, row N``, with its line in a JSON-lines file)."""
        line = None
        if self.spec.path and self.spec.path.endswith(".jsonl") and os.path.isfile(self.spec.path):
            with open(self.spec.path, "rb") as f:  # blank lines hold no row
                line = next(itertools.islice((n for n, raw in enumerate(f, 1) if raw.strip()), row, None), None)
        raise DataError(f"{self.label}, row {row}" + (f" (line {line})" if line else "") + f": {problem}. {FIX}")

    def _check_block(self, batch, roles: list[str], offset: int) -> dict[str, Any]:
        """The stripped texts of a block of rows, refusing a null required text, bad UTF-8 or an oversize text."""
        stripped = {}
        for role, array in zip(roles, batch.columns):
            if role in self.required and array.null_count:
                self.fail(
                    offset + pc.index(pc.is_null(array), True).as_py(),
                    f"required {self.field(role)} is missing or null",
                )
            try:
                array.validate(full=True)
            except pa.ArrowInvalid:
                for i, raw in enumerate(array.cast(pa.binary()).to_pylist()):
                    try:
                        raw is None or raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        self.fail(offset + i, f"{self.field(role)} is not valid UTF-8 ({e.reason})")
            sizes = pc.binary_length(array)
            row = pc.index(pc.greater(sizes, MAX_LINE_BYTES), True).as_py()
            if row >= 0:
                self.fail(
                    offset + row,
                    f"{self.field(role)} holds {sizes[row].as_py():,} bytes, more than {MAX_LINE_BYTES:,} "
                    "(llm2vec.io.MAX_LINE_BYTES, the longest JSON-lines line read), more than any text a model "
                    "reads; it is not read",
                )
            stripped[role] = pc.utf8_trim_whitespace(array)  # exactly what str.strip() removes
        return stripped

    def scan(self, limit: int | None = None) -> tuple[SourceStats, np.ndarray]:
        """Check every row and keep those whose required texts are not empty (at most ``limit``, the first);
        returns the counts and the rows kept, and warns as the JSON-lines loader does."""
        roles = [r for r in ROLES if self.columns[r] is not None]
        table = self.dataset.data.table.select([self.columns[r] for r in roles])
        kept, hashes, same = [np.empty(0, np.int64)], [np.empty(0, np.int64)], [np.empty(0, np.int64)]
        records = skipped = n_kept = 0
        first_skip = None
        for batch in table.to_batches(max_chunksize=SCAN_ROWS):
            texts = self._check_block(batch, roles, records)
            empty = [(r, pc.equal(pc.binary_length(texts[r]), 0).to_numpy(zero_copy_only=False)) for r in self.required]
            skip = np.logical_or.reduce([e for _, e in empty])
            rows = np.flatnonzero(~skip)
            end = batch.num_rows
            if limit is not None and n_kept + len(rows) >= limit:
                rows = rows[: limit - n_kept]
                end = int(rows[-1]) + 1
            if first_skip is None and skip[:end].any():
                row = int(np.argmax(skip))
                first_skip = (records + row, next(r for r, e in empty if e[row]))
            pairs = zip(texts["query"].take(rows).to_pylist(), texts["positive"].take(rows).to_pylist())
            hashes.append(np.fromiter(map(hash, pairs), np.int64, len(rows)))
            if "negative" in texts:
                equal = pc.fill_null(pc.equal(texts["negative"], texts["positive"]), False)
                same.append(rows[equal.to_numpy(zero_copy_only=False)[rows]] + records)
            kept.append(rows + records)
            n_kept, skipped, records = n_kept + len(rows), skipped + end - len(rows), records + end
            if end < batch.num_rows or n_kept == limit:
                break
        if skipped:
            needed = ", ".join(self.required[:-1]) + " or " + self.required[-1]
            row, role = first_skip
            logger.warning(
                "%s: skipped %d of %d rows whose %s is empty or whitespace only (the first: row %d, %s)",
                self.label,
                skipped,
                records,
                needed,
                row,
                self.field(role),
            )
        if not n_kept:
            if records == 0:
                raise DataError(f"{self.label}: the dataset holds no rows. Check that it is the right one.")
            raise DataError(
                f"{self.label}: all {records} rows were skipped because a required text is empty or whitespace "
                "only. Check the dataset's columns and column_map."
            )
        kept_rows, pair_hashes = np.concatenate(kept), np.concatenate(hashes)
        order = np.argsort(pair_hashes, kind="stable")  # equal hashes in row order: all but the first repeat it
        repeats = np.zeros(len(order), bool)
        repeats[order[1:]] = pair_hashes[order[1:]] == pair_hashes[order[:-1]]
        report = FileReport(self.label, records, duplicates=kept_rows[repeats].tolist())
        report.negative_is_positive = np.concatenate(same).tolist()
        warn_suspect_pairs(self.label, report, unit="row")
        return SourceStats(name=self.name, files=list(self.files), records=records, skipped_empty=skipped), kept_rows


# ---------------------------------------------------------------------------------------------- the dataset


class ArrowTrainDataset(TrainDataset):
    """A :class:`TrainDataset` over memory-mapped tables: the source of each global batch and the table row of each
    example (integers); item ``i`` is built from its row when read, and ``examples`` is the dataset itself."""

    def __init__(self, sources: dict[str, Source], batch_sources, rows, stats, global_batch_size, seed, held_out):
        super().__init__(self, stats, global_batch_size, seed, held_out)
        self.tables, self._names = sources, sorted(sources)
        self._batch_sources, self._rows = batch_sources, rows  # index into _names per global batch; row per example

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n, index = len(self._rows), operator.index(index)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} examples")
        index %= n
        name = self._names[self._batch_sources[index // self.global_batch_size]]
        return self.tables[name].example(int(self._rows[index]))

    def instruction_examples(self) -> list[TrainExample]:
        """The first training example, then one of each other distinct query instruction (its first trained row
        in each source's table order), found with ``pyarrow`` rather than by building every example."""
        found = {self[0].query_instruction: self[0]}
        per_example = np.repeat(self._batch_sources, self.global_batch_size)
        for s, name in enumerate(self._names):
            source, rows = self.tables[name], np.sort(self._rows[per_example == s])
            if not len(rows):
                continue
            if source.columns["instruction"] is None:
                found.setdefault(source.default_instruction, source.example(int(rows[0])))
                continue
            column = source.dataset.data.column(source.columns["instruction"])
            for start in range(0, len(rows), SCAN_ROWS):
                block = rows[start : start + SCAN_ROWS]
                values = pc.fill_null(pc.utf8_trim_whitespace(column.take(block)), source.default_instruction)
                values = values.combine_chunks().dictionary_encode()
                codes, first = np.unique(values.indices.to_numpy(zero_copy_only=False), return_index=True)
                for code, i in zip(codes, first):
                    if values.dictionary[int(code)].as_py() not in found:
                        found[values.dictionary[int(code)].as_py()] = source.example(int(block[i]))
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
    """Load Hugging Face datasets (memory-mapped), one source each, into single-source global batches.

    ``paths``: ``save_to_disk`` folders, data files or cached ids (joined by ``,`` or a list); ``column_map``:
    ``{role: column}`` and/or ``{source: {role: column}}``; ``split``: of a ``DatasetDict`` folder or an id;
    ``max_per_source``: the first rows of each source that pass the checks; ``cache_dir``: ``datasets``' cache.
    The rest as :func:`~llm2vec.dataset.jsonl.load_jsonl`, whose order it gives for the same rows. Raises
    :class:`DataError` for a missing or unreadable dataset, an unknown column, a bad row, or too little data.
    """
    if max_per_source is not None and max_per_source < 1:
        raise ValueError(f"max_per_source must be positive or None, got {max_per_source}")
    specs = parse_specs(paths)
    maps = source_column_maps(column_map, [s.name for s in specs])
    sources, stats, kept = {}, {}, {}
    for spec in specs:
        dataset, files = open_source(spec, split, cache_dir)
        source = Source(spec, dataset, files, maps[spec.name], default_instruction.strip(), require_negative)
        sources[spec.name] = source
        stats[spec.name], kept[spec.name] = source.scan(max_per_source)
    chosen = held_out_positions({n: len(k) for n, k in kept.items()}, validation_size, seed)
    held_out = [sources[name].example(int(kept[name][i])) for name, i in chosen]
    for name in sorted(kept) if chosen else list(kept):  # the order hold_out gives the remaining sources
        kept[name] = np.delete(kept.pop(name), [i for n, i in chosen if n == name])
    plan = arrange_positions({n: len(k) for n, k in kept.items()}, global_batch_size, seed)
    record_counts({n: len(k) for n, k in kept.items()}, plan.dropped, stats, global_batch_size)
    names, g = sorted(sources), global_batch_size
    batch_sources = np.array([names.index(n) for n, _ in plan.chunks], dtype=np.int32)
    chunk = np.array([k for _, k in plan.chunks], dtype=np.int64)
    rows = np.empty((len(plan.chunks), g), dtype=np.int64)
    for s, name in enumerate(names):
        shuffled = kept[name][np.frombuffer(plan.order[name], dtype=np.int64)]
        rows[batch_sources == s] = shuffled[: len(shuffled) // g * g].reshape(-1, g)[chunk[batch_sources == s]]
    return ArrowTrainDataset(sources, batch_sources, rows.ravel(), stats, g, seed, held_out)


def instruction_counts(
    paths: str | Sequence[str],
    column_map: Mapping | None = None,
    split: str = "train",
    default_instruction: str = "",
    cache_dir: str | None = None,
) -> Counter[str]:
    """``instruction -> rows`` of the datasets as :func:`load_hf` reads them (stripped; ``default_instruction``
    where a row has none): what an export reads back for its query prompt."""
    specs = parse_specs(paths)
    maps = source_column_maps(column_map, [s.name for s in specs])
    default_instruction = default_instruction.strip()
    counts: Counter[str] = Counter()
    for spec in specs:
        dataset, _ = open_source(spec, split, cache_dir)
        column = Source(spec, dataset, [], maps[spec.name], default_instruction, False).columns["instruction"]
        if column is None:
            counts[default_instruction] += dataset.num_rows
            continue
        for batch in dataset.data.table.select([column]).to_batches(max_chunksize=SCAN_ROWS):
            values = pc.fill_null(pc.utf8_trim_whitespace(batch.column(0)), default_instruction)
            counts.update({item["values"]: item["counts"] for item in pc.value_counts(values).to_pylist()})
    return counts


__all__ = ["ArrowTrainDataset", "DEFAULT_COLUMNS", "ROLES", "check_column_map", "instruction_counts", "load_hf"]
