"""What a stored evaluation result was computed from, and when it is reused."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..io import atomic_write, json_sha256

FIELD = "llm2vec_computed_from"  # the field of a result file (mteb's TaskResult JSON) that holds it

_PATHS = ("base_model_name_or_path", "peft_model_name_or_path")


def task_source(task) -> dict[str, Any]:
    """The ``task`` part of the key (docs/design.md)."""
    from .local_task import LocalRetrievalTask, mteb_registry, read_beir_files

    name = task.metadata.name
    if isinstance(task, LocalRetrievalTask):
        if task.file_sha256 is None:  # made without local_retrieval_task: hashed now
            task.file_sha256 = read_beir_files(task.data_dir)[1]
        return {"name": name, "source": "local folder", "files": dict(task.file_sha256)}
    dataset = task.metadata.dataset or {}
    source = {"name": name, "dataset": {"path": dataset.get("path"), "revision": dataset.get("revision")}}
    if type(task) is mteb_registry().get(name):
        return {**source, "source": "mteb"}
    cls = type(task)
    return {**source, "source": f"class {cls.__module__}.{cls.__qualname__}"}


def computed_from(encoder, task, batch_size: int) -> dict[str, Any]:
    """``{"key", "compared", "recorded"}`` of ``task`` evaluated by ``encoder`` (an ``LLM2VecMTEBEncoder``)."""
    import mteb

    compared = {
        "task": task_source(task),
        "instruction": encoder.resolve_instruction(task.metadata.name, task.metadata),
        "model": encoder.model_files,
        "settings": {k: v for k, v in encoder.identity.items() if k not in _PATHS},
    }
    recorded: dict[str, Any] = {k: encoder.identity.get(k) for k in _PATHS}
    if compared["task"]["source"] == "local folder":
        recorded["folder"] = os.path.abspath(task.data_dir)
    recorded.update(batch_size=int(batch_size), mteb_version=mteb.__version__)
    return {"key": json_sha256(compared), "compared": compared, "recorded": recorded}


def why_not_reused(path: str | os.PathLike, record: Mapping[str, Any]) -> str | None:
    """Why the result stored at ``path`` must not be served for ``record`` (:func:`computed_from`), in words; None
    when nothing is stored there or it records the same key."""
    path = Path(path)
    if not path.exists():
        return None
    if record["compared"]["model"] is None:
        return "the model is not known by its files (an encoder made from a model in memory)"
    try:
        stored = json.loads(path.read_text(encoding="utf-8")).get(FIELD)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        return f"it cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if not isinstance(stored, Mapping) or not isinstance(stored.get("compared"), Mapping):
        return "it records nothing of what it was computed from (written by mteb itself or an earlier version)"
    if stored.get("key") == record["key"] and json_sha256(stored["compared"]) == record["key"]:
        return None
    found = differences(stored["compared"], record["compared"]) or ["its key is not that of what it records"]
    return "it was computed from other inputs: " + "; ".join(found)


def differences(old: Mapping[str, Any], new: Mapping[str, Any], where: str = "") -> list[str]:
    """Each leaf that differs between two ``compared`` parts, by its dotted path: ``path was <old>, now <new>``."""
    found = []
    for key in sorted(set(old) | set(new), key=str):
        a, b, name = old.get(key), new.get(key), f"{where}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            found += differences(a, b, f"{name}.")
        elif a != b:
            found.append(f"{name} was {_short(a)}, now {_short(b)}")
    return found


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def write_record(path: str | os.PathLike, record: Mapping[str, Any]) -> None:
    """Add ``record`` to the result file at ``path`` under :data:`FIELD` (atomically) unless it records that key."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    stored = data.get(FIELD)
    if isinstance(stored, Mapping) and stored.get("key") == record["key"]:
        return
    data[FIELD] = dict(record)
    with atomic_write(path) as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
