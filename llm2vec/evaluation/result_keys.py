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
    return "it was computed from other inputs: " + "; ".join(differences(stored["compared"], record["compared"]))


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What differs between two ``compared`` parts, one phrase each (old -> new)."""
    found = []
    old_task, new_task = old.get("task") or {}, new.get("task") or {}
    if old_task.get("source") != new_task.get("source") or old_task.get("name") != new_task.get("name"):
        found.append(f"the task was {_describe(old_task)}, now {_describe(new_task)}")
    elif old_task.get("files") != new_task.get("files"):
        found.append(f"the local folder's {', '.join(_changed(old_task.get('files'), new_task.get('files')))} changed")
    elif old_task != new_task:
        found.append(f"the task's dataset was {old_task.get('dataset')}, now {new_task.get('dataset')}")
    if old.get("instruction") != new.get("instruction"):
        found.append(f"the instruction was {_short(old.get('instruction'))}, now {_short(new.get('instruction'))}")
    old_model, new_model = old.get("model") or {}, new.get("model") or {}
    for part, what in (("base", "the base model"), ("adapter", "the adapter")):
        a, b = old_model.get(part), new_model.get(part)
        if a != b:
            found.append(f"{what}'s files changed" + _changed_files(a, b))
    old_settings, new_settings = old.get("settings") or {}, new.get("settings") or {}
    for name in _changed(old_settings, new_settings):
        found.append(f"{name} was {old_settings.get(name)!r}, now {new_settings.get(name)!r}")
    return found or ["a part of the key that this version does not name"]


def _changed(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> list[str]:
    """The keys whose values differ between ``a`` and ``b`` (None: empty), sorted."""
    a, b = a or {}, b or {}
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _describe(task: Mapping[str, Any]) -> str:
    source = task.get("source")
    where = "a local folder" if source == "local folder" else "mteb's task" if source == "mteb" else source
    return f"{where} named {task.get('name')!r}"


def _short(text: Any, n: int = 60) -> str:
    return repr(text if not isinstance(text, str) or len(text) <= n else text[:n] + "...")


def _changed_files(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> str:
    changed = _changed((a or {}).get("files"), (b or {}).get("files"))
    if changed:
        return f" ({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''})"
    return f" ({'none' if a is None else a.get('hub_id', 'a folder')} -> {'none' if b is None else b.get('hub_id', 'a folder')})"


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
