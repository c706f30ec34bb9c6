"""Training data from Hugging Face ``datasets``, memory-mapped: ``dataset_name: hf``.

Each entry of ``dataset_file_path`` (joined by ``,``) is one source, so each global batch comes from one of them
(as the paper's E5 mix comes from one file at a time):

* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read with ``load_from_disk``; of a
  ``DatasetDict``, the split ``split``);
* a ``.parquet``, ``.arrow``, ``.json`` or ``.jsonl`` file (an ``.arrow`` file written by ``datasets`` is mapped as
  it is; the others are converted once into ``datasets``' cache, reused while the file's SHA-256 is unchanged);
* a dataset id already in the local ``datasets`` cache, ``owner/name`` or ``owner/name:config`` (read with
  ``datasets.load_dataset`` in offline mode: nothing is downloaded); a builder's name (``text``, ``json``), which
  would read the working folder, is refused.

A source's name is its file's stem or folder's name (``data/fiqa.parquet`` is ``fiqa``), or the id as written.

**Columns** are mapped by name to the roles ``query``, ``positive``, ``negative`` and ``instruction``
(:data:`ROLES`). Without a mapping a role takes the column of its own name; ``query`` also takes
sentence-transformers' ``anchor`` (:data:`DEFAULT_COLUMNS`). ``column_map`` maps roles to columns for every
source (``{"query": "question"}``) and, under a source's name, for that source only
(``{"nq": {"query": "question"}}``). A mapped column that the dataset lacks is refused with its columns listed.

**Rows** follow the JSON-lines loader's rules (:mod:`llm2vec.dataset.records`), checked with vectorised ``pyarrow``
compute over blocks of :data:`SCAN_ROWS` rows: a text column that is not of strings, a ``query`` or
``positive`` (or, where required, ``negative``) that is null, or a text that is not valid UTF-8, stops loading
with the dataset, the row (0-based, as ``dataset[row]``; for a ``.jsonl`` file its line as well) and the field;
a row whose required text is empty after stripping whitespace (Python's ``str.strip``) is skipped and counted;
a null ``instruction`` means ``default_instruction`` and ``""`` none.

**Memory.** The tables stay memory-mapped; the loader keeps integers only: the rows kept, and the arranged order
of :func:`llm2vec.dataset.base.arrange_positions` (the same order the JSON-lines loader gives the same rows).
:class:`ArrowTrainDataset` builds each :class:`~llm2vec.dataset.records.TrainExample` when it is read.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import operator
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..config_values import strict_booleans
from ..io import MAX_LINE_BYTES
from .base import SourceStats, TrainDataset, arrange_positions, held_out_positions, record_counts
from .records import DataError, FileReport, TrainExample, warn_suspect_pairs

logger = logging.getLogger(__name__)

ROLES = ("query", "positive", "negative", "instruction")
DEFAULT_COLUMNS: dict[str, tuple[str, ...]] = {
    "query": ("query", "anchor"),  # this project's name, sentence-transformers'
    "positive": ("positive",),
    "negative": ("negative",),
    "instruction": ("instruction",),
}
FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}
SCAN_ROWS = 65_536  # rows per block of the row checks: their memory is bounded by a block, not the dataset
PAIR_ROWS = 4096  # rows per block of the repeated-pair check, whose texts it holds as Python strings
FIX = "Fix or remove this row."


# ---------------------------------------------------------------------------------------------- configuration


def check_column_map(column_map: Any) -> None:
    """``column_map`` is ``{role: column}`` and/or ``{source: {role: column}}``; raises ``ValueError`` naming what
    is wrong (the source names are checked when the data loads)."""
    if column_map is None:
        return
    if not isinstance(column_map, Mapping):
        raise ValueError(f"column_map must be a JSON object of role: column, got {type(column_map).__name__}")
    for key, value in column_map.items():
        if isinstance(value, Mapping):
            for role, column in value.items():
                _check_role(role, column, f"column_map[{key!r}]")
        else:
            _check_role(key, value, "column_map")


def _check_role(role: Any, column: Any, where: str) -> None:
    if role not in ROLES:
        raise ValueError(
            f"{where}: {role!r} is not a role (nor, at the top, an object of a source's roles); the roles are "
            f"{', '.join(ROLES)}"
        )
    if not isinstance(column, str) or not column:
        raise ValueError(f"{where}[{role!r}]: give a column name, got {column!r}")


def source_column_maps(column_map: Mapping | None, names: Sequence[str]) -> dict[str, dict[str, str]]:
    """``name -> {role: column}``: the top-level roles of ``column_map`` for every source, a source's own entry
    over them. Raises :class:`DataError` for an entry that names no source."""
    check_column_map(column_map)
    column_map = column_map or {}
    shared = {k: v for k, v in column_map.items() if not isinstance(v, Mapping)}
    own = {k: dict(v) for k, v in column_map.items() if isinstance(v, Mapping)}
    unknown = [k for k in own if k not in names]
    if unknown:
        raise DataError(
            f"column_map: {', '.join(map(repr, unknown))} names no source; the sources are: {', '.join(names)}"
        )
    return {name: {**shared, **own.get(name, {})} for name in names}


# ---------------------------------------------------------------------------------------------- the sources


class Spec:
    """One entry of ``dataset_file_path``: a local path (``path``) or a cached dataset id (``repo``, ``config``)."""

    def __init__(self, given: str):
        self.given = given
        self.path: str | None = None
        self.repo: str | None = None
        self.config: str | None = None
        if os.path.exists(given) or _looks_like_a_path(given):
            self.path = given
            p = Path(given)
            self.name = p.name if p.is_dir() else p.stem
        else:
            self.repo, _, config = given.partition(":")
            self.config = config or None
            self.name = given
            if self.repo.lower() in _builder_names():
                raise DataError(
                    f"dataset_file_path {given!r}: the name of a datasets builder, which would read every matching "
                    f"file under {os.getcwd()}; give the data files themselves ({', '.join(FILE_BUILDERS)}) or a "
                    "save_to_disk folder"
                )

    @property
    def is_jsonl(self) -> bool:
        return self.path is not None and self.path.endswith(".jsonl")


def _builder_names() -> set[str]:
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    return set(_PACKAGED_DATASETS_MODULES)


def _looks_like_a_path(given: str) -> bool:
    """A name that cannot be a dataset id (``owner/name[:config]``): a data file's suffix, an absolute or
    relative-looking start, or more than one ``/``."""
    return Path(given).suffix in FILE_BUILDERS or given.startswith(("/", "./", "../", "~")) or given.count("/") > 1


def parse_specs(paths: str | Sequence[str]) -> list[Spec]:
    """The sources of ``paths`` (a string joined by ``,`` or a list); refuses none, two of one name, and local
    paths that do not exist (all listed in one error)."""
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
    """``datasets`` and ``huggingface_hub`` in offline mode (``HF_HUB_OFFLINE=1``) for the block: a dataset id is
    read from the local cache or refused, never downloaded."""
    import datasets
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def open_source(spec: Spec, split: str, cache_dir: str | None = None):
    """The memory-mapped ``datasets.Dataset`` of ``spec`` and the files it reads (what a run fingerprints)."""
    import datasets

    try:
        with _offline():
            if spec.repo is not None:
                dataset = datasets.load_dataset(spec.repo, spec.config, split=split, cache_dir=cache_dir)
            elif os.path.isdir(spec.path):
                dataset = _from_disk(spec, split)
            else:
                dataset = _from_file(spec, cache_dir)
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
        if spec.is_jsonl:
            _find_bad_line(spec.path)  # raises naming the line, if the file's lines show the problem
        raise DataError(f"{spec.given}: cannot read it as a dataset ({_first_line(e.__cause__ or e)})") from e
    if spec.path is not None and os.path.isfile(spec.path):
        files = [spec.path]
    else:
        files = [f["filename"] for f in dataset.cache_files]
    return dataset, files


def _has_no_rows(path: str, split: str) -> bool:
    """Whether the local dataset ``path`` (whose load failed) holds no rows: ``datasets`` fails on those obscurely."""
    try:
        if os.path.isdir(path):
            state = next(f for f in (Path(path, split, "state.json"), Path(path, "state.json")) if f.is_file())
            return not json.loads(state.read_text()).get("_data_files")
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows == 0
        return os.path.getsize(path) < 1 << 20 and not Path(path).read_bytes().strip()
    except Exception:  # noqa: BLE001 - unreadable: the caller's line says so
        return False


def _from_disk(spec: Spec, split: str):
    import datasets

    folder = spec.path
    if not (
        os.path.isfile(os.path.join(folder, datasets.config.DATASET_STATE_JSON_FILENAME))
        or os.path.isfile(os.path.join(folder, datasets.config.DATASETDICT_JSON_FILENAME))
    ):
        raise DataError(
            f"{folder} is a folder but not one written by save_to_disk (no {datasets.config.DATASET_STATE_JSON_FILENAME} "
            f"or {datasets.config.DATASETDICT_JSON_FILENAME}); give its data files, joined by ','"
        )
    loaded = datasets.load_from_disk(folder, keep_in_memory=False)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{folder}: no split {split!r}; its splits are: {', '.join(loaded)} (set dataset_split)")
        return loaded[split]
    return loaded


def _from_file(spec: Spec, cache_dir: str | None):
    import datasets

    suffix = Path(spec.path).suffix
    if suffix not in FILE_BUILDERS:
        raise DataError(
            f"{spec.path}: not a file datasets reads here; give a {', '.join(FILE_BUILDERS)} file, a save_to_disk "
            "folder or a cached dataset id"
        )
    if suffix == ".arrow":
        with contextlib.suppress(Exception):  # an Arrow stream written by datasets: mapped as it is
            return datasets.Dataset.from_file(spec.path, in_memory=False)
    options = {}
    if suffix == ".parquet":
        import pyarrow.dataset as pds

        # pyarrow's pre-buffering keeps the bytes of every row group read so far until the file is done: the
        # conversion's memory would grow with the file (measured: 0.7 GB of 2 M pairs, 0.4 GB without it)
        options["fragment_scan_options"] = pds.ParquetFragmentScanOptions(pre_buffer=False)
    return _converted(FILE_BUILDERS[suffix], spec.path, cache_dir, options)


CONVERTED_FROM = "llm2vec-converted-from.json"
"""Beside a conversion in ``datasets``' cache: the SHA-256 of the file it was made from. ``datasets`` keys its cache
by the file's path and modification time only, so a file rewritten with its old time would be served as before."""


def _converted(builder_name: str, path: str, cache_dir: str | None, options: dict):
    """``path`` converted by ``builder_name`` into the cache, converted again unless the cache was made from these bytes."""
    import datasets

    from ..io import sha256_file

    before = os.stat(path)
    digest = sha256_file(path)
    builder = datasets.load_dataset_builder(builder_name, data_files=path, cache_dir=cache_dir, **options)
    record = Path(builder.cache_dir) / CONVERTED_FROM
    try:
        same = json.loads(record.read_text()).get("sha256") == digest
    except (OSError, ValueError, AttributeError):
        same = False
    mode = None if same else datasets.DownloadMode.FORCE_REDOWNLOAD
    builder.download_and_prepare(download_mode=mode)
    after = os.stat(path)
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
        before.st_size,
        before.st_mtime_ns,
        before.st_ctime_ns,
    ):
        raise DataError(f"{path}: the file changed while it was read; run again once it is written")
    record.write_text(json.dumps({"path": os.path.realpath(path), "sha256": digest}))
    return builder.as_dataset(split="train")


def _find_bad_line(path: str) -> None:
    """Raise :class:`DataError` at the first line of a JSON-lines file that is not UTF-8, not JSON, not an object, or
    holds a string that is not text (half of a surrogate pair); read line by line, nothing kept."""
    from ..io import iter_jsonl

    for line_no, obj in iter_jsonl(path, error=DataError, fix=FIX.replace("row", "line")):
        for key, value in (obj or {}).items():
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise DataError(
                        f'{path}:{line_no}: field "{key}" holds half of a UTF-16 surrogate pair, which is not a '
                        f"character (a broken \\uXXXX escape). {FIX.replace('row', 'line')}"
                    ) from None


def _line_of_row(path: str, row: int) -> int | None:
    """The line of row ``row`` of a JSON-lines file (blank lines hold no row); read only to name a bad row."""
    with open(path, "rb") as f:
        seen = -1
        for line_no, raw in enumerate(f, start=1):
            if raw.strip():
                seen += 1
                if seen == row:
                    return line_no
    return None


# ---------------------------------------------------------------------------------------------- one source


@functools.cache
def python_whitespace() -> str:
    """The characters Python's ``str.strip()`` removes (``str.isspace``), for ``pyarrow``'s trim and regex."""
    return "".join(chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace())


@functools.cache
def _whitespace_only() -> str:
    """An RE2 pattern matching a string that ``str.strip()`` empties."""
    return "^[" + "".join(f"\\x{{{ord(c):x}}}" for c in python_whitespace()) + "]*$"


class Source:
    """One dataset: its memory-mapped table, the column of each role and the rows kept (after the checks)."""

    def __init__(self, spec: Spec, dataset, files: list[str], columns: dict[str, str | None], default_instruction):
        self.name, self.label, self.spec = spec.name, spec.given, spec
        self.dataset = dataset
        self.files = files
        self.columns = columns
        self.default_instruction = default_instruction
        self.kept = np.empty(0, dtype=np.int64)  # the rows that passed the checks, until they are arranged
        self._arrays: dict[str, Any] = {}

    def __getstate__(self):  # the cached column objects are rebuilt after unpickling
        return {**self.__dict__, "_arrays": {}}

    def _array(self, role: str):
        if role not in self._arrays:
            self._arrays[role] = self.dataset.data.column(self.columns[role])
        return self._arrays[role]

    def _text(self, role: str, row: int) -> str | None:
        if self.columns[role] is None:
            return None
        value = self._array(role)[row].as_py()
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

    def where(self, row: int) -> str:
        """``label, row N`` (and the line, for a JSON-lines file, found by reading it): a bad row, in an error."""
        line = _line_of_row(self.spec.path, row) if self.spec.is_jsonl and os.path.isfile(self.spec.path) else None
        return f"{self.label}, row {row}" + (f" (line {line})" if line else "")

    def field(self, role: str) -> str:
        column = self.columns[role]
        return f'field "{role}"' + (f' (column "{column}")' if column != role else "")

    # -------------------------------------------------------------------------------------- the checks

    def resolve_columns(self, column_map: dict[str, str], require_negative: bool) -> None:
        """The column of each role: ``column_map``'s, else :data:`DEFAULT_COLUMNS`; refuses a mapped column the
        dataset lacks, a missing or ambiguous ``query`` / ``positive``, and (with ``require_negative``) a missing
        ``negative``, each with the dataset's columns."""
        available = list(self.dataset.column_names)
        listing = f"its columns are: {', '.join(available) or '(none)'}"
        hint = 'map one with column_map, e.g. {"%s": "<column>"}'
        for role, column in column_map.items():
            if column not in available:
                raise DataError(
                    f'{self.label}: column_map maps "{role}" to "{column}", which is not a column; {listing}'
                )
        for role in ROLES:
            if role in column_map:
                self.columns[role] = column_map[role]
                continue
            present = [c for c in DEFAULT_COLUMNS[role] if c in available]
            if len(present) > 1:
                raise DataError(
                    f'{self.label}: both {" and ".join(present)} could be the "{role}" column; {hint % role}'
                )
            self.columns[role] = present[0] if present else None
            required = role in ("query", "positive") or (role == "negative" and require_negative)
            if self.columns[role] is None and required:
                looked = " or ".join(f'"{c}"' for c in DEFAULT_COLUMNS[role])
                why = " (Stage II with require_negative: every row needs a hard negative)" if role == "negative" else ""
                raise DataError(
                    f'{self.label}: no column for field "{role}"{why}: looked for {looked}; {listing}; {hint % role}'
                )

    def check_types(self) -> None:
        """Every mapped column holds strings (nulls allowed); else the first row whose value is not a string."""
        import datasets
        import pyarrow as pa
        import pyarrow.compute as pc

        for role, column in list(self.columns.items()):
            if column is None:
                continue
            feature = self.dataset.features[column]
            if isinstance(feature, datasets.Value) and feature.dtype == "null" and role == "instruction":
                self.columns[role] = None  # a column of nulls only (a DataFrame's None): no row has one
                continue
            if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null"):
                continue
            array = self.dataset.data.column(column)
            if isinstance(array.type, pa.BaseExtensionType):  # e.g. datasets' JSON text of a column of mixed types
                array = pa.chunked_array([chunk.storage for chunk in array.chunks], array.type.storage_type)
            if isinstance(feature, getattr(datasets, "Json", ())):  # a JSON file whose column mixes types
                bad = pc.invert(pc.fill_null(pc.starts_with(array, '"'), True))
                kind = "JSON"
            else:
                bad = pc.is_valid(array)
                kind = str(getattr(feature, "dtype", type(feature).__name__))
            row = pc.index(bad, True).as_py()
            if row < 0:
                raise DataError(f"{self.label}: {self.field(role)} must hold strings, its type is {feature}")
            value = array[row].as_py()
            shown = (value if isinstance(value, str) else repr(value))[:60]
            got = f"JSON {shown}" if kind == "JSON" else f"{kind} ({shown})"
            raise DataError(f"{self.where(row)}: {self.field(role)} must be a string, got {got}. {FIX}")

    def scan(self, require_negative: bool, limit: int | None = None) -> SourceStats:
        """Check the rows in blocks of :data:`SCAN_ROWS` and keep those whose required texts are not empty (at most
        ``limit``, the first); returns the counts. Raises :class:`DataError` at a null required text or a text
        that is not valid UTF-8, naming the row and field."""
        import pyarrow as pa
        import pyarrow.compute as pc

        required = ["query", "positive"] + (["negative"] if require_negative else [])
        roles = [r for r in ROLES if self.columns[r] is not None]
        table = self.dataset.data.table.select([self.columns[r] for r in roles])
        kept: list[np.ndarray] = []
        n_kept = records = skipped = 0
        first_skip: tuple[int, str] | None = None
        offset = 0
        for batch in table.to_batches(max_chunksize=SCAN_ROWS):
            empties = []
            for i, role in enumerate(roles):
                array = batch.column(i)
                if array.null_count and role in required:
                    row = offset + pc.index(pc.is_null(array), True).as_py()
                    raise DataError(f"{self.where(row)}: required {self.field(role)} is missing or null. {FIX}")
                self._check_utf8(array, role, offset)
                self._check_size(array, role, offset)
                if role in required and not pa.types.is_null(array.type):
                    empties.append((role, pc.match_substring_regex(array, _whitespace_only()).to_numpy(False)))
            skip = np.logical_or.reduce([e for _, e in empties]) if empties else np.zeros(batch.num_rows, bool)
            if first_skip is None and skip.any():
                row = int(np.argmax(skip))
                first_skip = (offset + row, next(role for role, e in empties if e[row]))
            rows = np.flatnonzero(~skip) + offset
            if limit is not None and n_kept + len(rows) >= limit:
                rows = rows[: limit - n_kept]
                end = int(rows[-1]) + 1 if len(rows) else offset
                kept.append(rows)
                n_kept += len(rows)
                records = end
                skipped += (end - offset) - len(rows)
                break
            kept.append(rows)
            n_kept += len(rows)
            skipped += batch.num_rows - len(rows)
            offset += batch.num_rows
            records = offset
        self.kept = np.concatenate(kept) if kept else np.empty(0, dtype=np.int64)
        stats = SourceStats(name=self.name, files=list(self.files), records=records, skipped_empty=skipped)
        if skipped:
            needed = "query, positive or negative" if require_negative else "query or positive"
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
        self._warn_suspect_pairs(records)
        return stats

    def _check_size(self, array, role: str, offset: int) -> None:
        """No text longer than a JSON-lines line may be (:data:`llm2vec.io.MAX_LINE_BYTES`): tokenizing one costs
        seconds and gigabytes, though the collator keeps ``max_seq_length`` tokens of it."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if pa.types.is_null(array.type):
            return
        sizes = pc.binary_length(array)
        row = pc.index(pc.greater(sizes, MAX_LINE_BYTES), True).as_py()
        if row >= 0:
            raise DataError(
                f"{self.where(offset + row)}: {self.field(role)} holds {sizes[row].as_py():,} bytes, more than "
                f"{MAX_LINE_BYTES:,} (llm2vec.io.MAX_LINE_BYTES, the longest JSON-lines line read), more than any "
                f"text a model reads; it is not read. {FIX}"
            )

    def _warn_suspect_pairs(self, records: int) -> None:
        """The JSON-lines loader's warnings (:func:`~llm2vec.dataset.records.warn_suspect_pairs`) about kept rows that
        repeat an earlier row's query and positive or whose negative is the positive, by row; the pairs' hashes are
        held in one array, the texts a block at a time."""
        report, hashes = FileReport(path=self.label, records=records), np.empty(len(self.kept), np.int64)
        roles = ("query", "positive", "negative")
        for start in range(0, len(self.kept), PAIR_ROWS):
            rows = self.kept[start : start + PAIR_ROWS]
            texts = [self._array(r).take(rows).to_pylist() if self.columns[r] else [None] * len(rows) for r in roles]
            for i, (row, query, positive, negative) in enumerate(zip(rows.tolist(), *texts)):
                hashes[start + i] = hash((query.strip(), positive.strip()))
                if negative is not None and negative.strip() == positive.strip():
                    report.negative_is_positive.append(row)
        order = np.argsort(hashes, kind="stable")  # equal hashes in row order: all but the first repeat it
        repeats = np.zeros(len(hashes), bool)
        repeats[order[1:]] = hashes[order[1:]] == hashes[order[:-1]]
        report.duplicates = self.kept[repeats].tolist()
        warn_suspect_pairs(self.label, report, unit="row")

    def _check_utf8(self, array, role: str, offset: int) -> None:
        import pyarrow as pa

        try:
            array.validate(full=True)
        except pa.ArrowInvalid:
            for i in range(len(array)):  # one block, on the way to an error
                try:
                    array[i].as_py()
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{self.where(offset + i)}: {self.field(role)} is not valid UTF-8 ({e.reason}). {FIX}"
                    ) from None
            raise


# ---------------------------------------------------------------------------------------------- the dataset


class ArrangedExamples(Sequence):
    """The training examples of an :class:`ArrowTrainDataset` in training order, each built when read."""

    def __init__(self, dataset: ArrowTrainDataset):
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._dataset[i] for i in range(*index.indices(len(self)))]
        return self._dataset[index]


class ArrowTrainDataset(TrainDataset):
    """A :class:`TrainDataset` over memory-mapped tables: the arranged order is two integer arrays (the source of
    each global batch, the table row of each example), and item ``i`` is built from its row when read."""

    def __init__(
        self,
        sources: dict[str, Source],
        batch_sources: np.ndarray,
        rows: np.ndarray,
        stats: dict[str, SourceStats],
        global_batch_size: int,
        seed: int,
        held_out: list[TrainExample],
    ):
        super().__init__(ArrangedExamples(self), stats, global_batch_size, seed, held_out)
        self.tables = sources
        self._names = sorted(sources)
        self._batch_sources = batch_sources  # index into _names, one per global batch
        self._rows = rows  # the table row of each example, in training order

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> TrainExample:
        n = len(self._rows)
        index = operator.index(index)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"index {index} out of range for {n} examples")
        name = self._names[self._batch_sources[index // self.global_batch_size]]
        return self.tables[name].example(int(self._rows[index]))

    def instruction_examples(self) -> list[TrainExample]:
        """The first training example, then one of each other distinct query instruction: its first trained row in
        each source's table order (found with ``pyarrow`` in blocks, not by building every example)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        first = self[0]
        found = {first.query_instruction: first}
        per_example = np.repeat(self._batch_sources, self.global_batch_size)
        for s, name in enumerate(self._names):
            source = self.tables[name]
            mine = per_example == s
            if not mine.any():
                continue
            if source.columns["instruction"] is None:
                found.setdefault(source.default_instruction, self[int(np.argmax(mine))])
                continue
            rows = np.sort(self._rows[mine])
            column = source.dataset.data.column(source.columns["instruction"])
            for start in range(0, len(rows), SCAN_ROWS):
                block = rows[start : start + SCAN_ROWS]
                values = pc.utf8_trim(column.take(pa.array(block)), python_whitespace())  # str.strip()
                values = pc.fill_null(values, source.default_instruction).combine_chunks().dictionary_encode()
                distinct, first = np.unique(values.indices.to_numpy(zero_copy_only=False), return_index=True)
                for code, position in zip(distinct, first):
                    if values.dictionary[int(code)].as_py() not in found:
                        example = source.example(int(block[position]))
                        found[example.query_instruction] = example
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
    """Load Hugging Face datasets (memory-mapped) and arrange them into single-source global batches.

    Args:
        paths: the datasets, one source each: ``save_to_disk`` folders, ``.parquet`` / ``.arrow`` / ``.json`` /
            ``.jsonl`` files, or ids in the local cache (``owner/name[:config]``); a string joined by ``,`` or a list.
        global_batch_size: examples per optimisation step over all devices.
        seed: seed of the shuffles (the same order as :func:`~llm2vec.dataset.jsonl.load_jsonl` on the same rows).
        column_map: ``{role: column}`` for every source and/or ``{source: {role: column}}`` (module docstring).
        split: the split of a ``DatasetDict`` folder or of a dataset id.
        default_instruction: query instruction of rows without one (no ``instruction`` column, or null).
        require_negative: every row must have a non-empty ``negative``.
        validation_size: examples held out for validation (:func:`llm2vec.dataset.base.hold_out`).
        max_per_source: keep at most this many rows of each source (the first ones that pass the checks).
        cache_dir: ``datasets``' cache folder (default: its own, ``HF_DATASETS_CACHE``).

    Raises:
        DataError: a missing path, an id not in the local cache, an unknown column, a bad row (dataset, row and
            field named), or not enough data for one global batch.
    """
    if max_per_source is not None and max_per_source < 1:
        raise ValueError(f"max_per_source must be positive or None, got {max_per_source}")
    specs = parse_specs(paths)
    maps = source_column_maps(column_map, [s.name for s in specs])
    default_instruction = default_instruction.strip()
    sources: dict[str, Source] = {}
    stats: dict[str, SourceStats] = {}
    for spec in specs:
        dataset, files = open_source(spec, split, cache_dir)
        source = Source(spec, dataset, files, {}, default_instruction)
        source.resolve_columns(maps[spec.name], require_negative)
        source.check_types()
        stats[spec.name] = source.scan(require_negative, max_per_source)
        sources[spec.name] = source
    return _arrange_sources(sources, stats, global_batch_size, seed, validation_size)


def instruction_counts(
    paths: str | Sequence[str],
    column_map: Mapping | None = None,
    split: str = "train",
    default_instruction: str = "",
    cache_dir: str | None = None,
) -> Counter[str]:
    """``instruction -> rows`` of the datasets as :func:`load_hf` reads them (stripped; ``default_instruction``
    where a row has none), counted with ``pyarrow`` in blocks (what an export reads back: the query prompt)."""
    import pyarrow.compute as pc

    specs = parse_specs(paths)
    maps = source_column_maps(column_map, [s.name for s in specs])
    default_instruction = default_instruction.strip()
    counts: Counter[str] = Counter()
    for spec in specs:
        dataset, _ = open_source(spec, split, cache_dir)
        source = Source(spec, dataset, [], {}, default_instruction)
        source.resolve_columns(maps[spec.name], require_negative=False)
        source.check_types()
        if source.columns["instruction"] is None:
            counts[default_instruction] += dataset.num_rows
            continue
        table = dataset.data.table.select([source.columns["instruction"]])
        for batch in table.to_batches(max_chunksize=SCAN_ROWS):
            values = pc.fill_null(pc.utf8_trim(batch.column(0), python_whitespace()), default_instruction)
            for item in pc.value_counts(values).to_pylist():
                counts[item["values"]] += item["counts"]
    return counts


def _arrange_sources(
    sources: dict[str, Source], stats: dict[str, SourceStats], global_batch_size: int, seed: int, validation_size
) -> ArrowTrainDataset:
    """Hold out, arrange and count as :meth:`TrainDataset.from_sources` does, on each source's kept rows."""
    chosen = held_out_positions({n: len(s.kept) for n, s in sources.items()}, validation_size, seed)
    held_out = [sources[name].example(int(sources[name].kept[i])) for name, i in chosen]
    remaining = {}
    for name in sorted(sources) if chosen else sources:
        keep = np.ones(len(sources[name].kept), dtype=bool)
        keep[[i for n, i in chosen if n == name]] = False
        remaining[name] = sources[name].kept[keep]
    plan = arrange_positions({n: len(r) for n, r in remaining.items()}, global_batch_size, seed)
    record_counts({n: len(r) for n, r in remaining.items()}, plan.dropped, stats, global_batch_size)
    names = sorted(sources)
    g = global_batch_size
    batch_sources = np.fromiter((names.index(n) for n, _ in plan.chunks), dtype=np.int32, count=len(plan.chunks))
    rows = np.empty(len(plan.chunks) * g, dtype=np.int64)
    within = np.arange(g)
    for s, name in enumerate(names):
        mine = np.flatnonzero(batch_sources == s)
        if not len(mine):
            continue
        ks = np.fromiter((plan.chunks[c][1] for c in mine), dtype=np.int64, count=len(mine))
        order = np.frombuffer(plan.order[name], dtype=np.int64)
        rows[(mine[:, None] * g + within).ravel()] = remaining[name][order[(ks[:, None] * g + within).ravel()]]
    for source in sources.values():  # what is trained on is in ``rows`` now
        source.kept = np.empty(0, dtype=np.int64)
    return ArrowTrainDataset(sources, batch_sources, rows, stats, global_batch_size, seed, held_out)


__all__ = ["ArrowTrainDataset", "DEFAULT_COLUMNS", "ROLES", "check_column_map", "instruction_counts", "load_hf"]
