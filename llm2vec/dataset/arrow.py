"""One source of ``dataset_name: hf`` as a memory-mapped ``datasets.Dataset``, read offline: a ``save_to_disk``
folder, an Arrow stream as it is, another file converted once into an Arrow stream named by its SHA-256, or a
dataset id in the local cache."""

from __future__ import annotations

import contextlib
import json
import os
import pkgutil
import tempfile
from pathlib import Path

import datasets
import datasets.packaged_modules
import huggingface_hub.constants as hub
import pyarrow as pa
import pyarrow.parquet as pq

from ..io import atomic_write, iter_jsonl, sha256_file
from .records import DataError

FILES = (".parquet", ".arrow", ".json", ".jsonl")
BUILDERS = {m.name for m in pkgutil.iter_modules(datasets.packaged_modules.__path__)}  # load_dataset("json"), ...
SCAN_ROWS = 8192  # rows per block of the checks and conversions: their memory is bounded by a block
NO_ROWS = "the dataset has no rows; give one with (query, positive) rows"


def open_dataset(label: str, path: str | None, repo: str | None, config: str | None, split: str, cache_dir):
    """``(dataset, notes)`` of the local ``path``, else of the cached id ``repo`` (``config``), nothing downloaded;
    ``notes``: :func:`_jsonl_table`'s. Refuses a dataset without rows; whatever ``datasets`` raises is one line."""
    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    notes = {}
    try:
        if repo is not None:
            dataset = datasets.load_dataset(repo, config, split=split, cache_dir=cache_dir)
        elif os.path.isdir(path):
            dataset = _from_disk(path, split)
        else:
            dataset, notes = _from_file(path, cache_dir)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever datasets raises: one line naming the source
        cause = (str(e.__cause__ or e).strip().splitlines() or [type(e).__name__])[0]
        if repo is None:
            raise DataError(f"{label}: cannot read it as a dataset ({cause})") from e
        raise DataError(
            f"dataset {label}: no local file or folder of that name, and not readable from the local datasets cache "
            f"as a dataset id ({cause}). Download it once where there is network (datasets.load_dataset), or give a "
            "local file or save_to_disk folder"
        ) from e
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved
    if not dataset.num_rows:
        raise DataError(f"{label}: {NO_ROWS}")
    return dataset, notes


def _from_disk(folder: str, split: str):
    state, listing = datasets.config.DATASET_STATE_JSON_FILENAME, datasets.config.DATASETDICT_JSON_FILENAME
    if not any(os.path.isfile(os.path.join(folder, name)) for name in (state, listing)):
        raise DataError(
            f"{folder} is a folder but not one written by save_to_disk (no {state} or {listing}); give its data "
            "files, joined by ','"
        )
    saved, files = Path(folder, split if os.path.isfile(os.path.join(folder, listing)) else "", state), True
    with contextlib.suppress(OSError, ValueError, AttributeError):  # unreadable: load_from_disk says why
        files = json.loads(saved.read_text()).get("_data_files")
    if not files:  # a dataset without rows is saved without data files
        raise DataError(f"{folder}: {NO_ROWS}")
    loaded = datasets.load_from_disk(folder, keep_in_memory=False)
    if isinstance(loaded, datasets.DatasetDict) and split not in loaded:
        raise DataError(f"{folder}: no split {split!r}; its splits are: {', '.join(loaded)} (set dataset_split)")
    return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded


def _from_file(path: str, cache_dir: str | None):
    """An Arrow stream mapped as it is; another file converted once into an Arrow stream named by its SHA-256 in
    ``cache_dir`` (default: ``datasets``' cache), then mapped."""
    if Path(path).suffix not in FILES:
        raise DataError(
            f"{path}: not a file datasets reads here; give a {', '.join(FILES)} file, a save_to_disk folder or a "
            "cached dataset id"
        )
    if path.endswith(".arrow"):
        with contextlib.suppress(pa.ArrowInvalid):  # an Arrow file, not a stream, is converted
            return datasets.Dataset.from_file(path, in_memory=False), {}
    digest = sha256_file(path)
    mapped = os.path.join(cache_dir or datasets.config.HF_DATASETS_CACHE, "llm2vec", f"{digest}.arrow")
    if not os.path.isfile(mapped):
        with atomic_write(mapped, "wb") as sink, tempfile.TemporaryDirectory(dir=os.path.dirname(mapped)) as blocks:
            if path.endswith(".parquet"):  # pyarrow's pre-buffering would keep every row group read till the end
                parquet = pq.ParquetFile(path, pre_buffer=False)
                schema, batches = parquet.schema_arrow, parquet.iter_batches(SCAN_ROWS)
            else:
                arrow = path.endswith(".arrow")
                table = pa.ipc.open_file(pa.memory_map(path)).read_all() if arrow else _jsonl_table(path, blocks)
                schema, batches = table.schema, table.to_batches()
            with pa.ipc.new_stream(sink, schema) as writer:
                for batch in batches:
                    writer.write_batch(batch)
            if sha256_file(path) != digest:  # hashed again only if its size or times changed: then not kept
                raise DataError(f"{path}: the file changed while it was read; run again once it is written")
    metadata = pa.ipc.open_stream(pa.memory_map(mapped)).schema.metadata or {}
    return datasets.Dataset.from_file(mapped, in_memory=False), json.loads(metadata.get(b"llm2vec", b"{}"))


def _jsonl_table(path: str, blocks: str) -> pa.Table:
    """The JSON-lines file ``path`` as :func:`~llm2vec.io.iter_jsonl` reads it, a text column a key (another value as
    its JSON text); the metadata notes the blank lines and each such key's first row. Blocks go through ``blocks``."""
    parts, rows, notes, fix = [], [], {"blank": [], "not_text": {}}, "Fix or remove this line."
    with open(path, "rb") as f:
        if f.read(4096).lstrip().startswith(b"["):
            raise DataError(
                f"{path}: a JSON array; a .json or .jsonl file is read as JSON lines, one object a line: write it so "
                "(datasets: Dataset.from_list(rows).to_json(path))"
            )

    def write_block():
        keys = dict.fromkeys(key for row in rows for key in row)
        table = pa.Table.from_pylist(rows, pa.schema([(key, pa.large_string()) for key in keys]))
        part = os.path.join(blocks, str(len(parts)))
        with pa.OSFile(part, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        parts.append(pa.ipc.open_stream(pa.memory_map(part)).read_all())
        rows.clear()

    for line, record in iter_jsonl(path, error=DataError, fix=fix):
        if record is None:
            notes["blank"].append(line)
            continue
        for key, value in record.items():
            if isinstance(value, str) and not value.isascii() and value.encode(errors="replace").decode() != value:
                raise DataError(
                    f'{path}:{line}: field "{key}" holds half of a UTF-16 surrogate pair, which is not a character '
                    f"(a broken \\uXXXX escape). {fix}"
                )
            if not isinstance(value, str) and value is not None:
                record[key] = json.dumps(value)  # ASCII: a half surrogate pair in it is escaped
                notes["not_text"].setdefault(key, (len(parts) * SCAN_ROWS + len(rows), record[key]))
        rows.append(record)
        if len(rows) == SCAN_ROWS:
            write_block()
    write_block()
    return pa.concat_tables(parts, promote_options="default").replace_schema_metadata({"llm2vec": json.dumps(notes)})
