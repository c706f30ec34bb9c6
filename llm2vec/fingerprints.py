"""Fingerprints of files and model folders: what a run records of its inputs (:mod:`llm2vec.run.plan`), what
an adapter's load compares with the base it was trained on (:func:`llm2vec.model_files.check_adapter`) and what a
stored evaluation result records of its model (:mod:`llm2vec.evaluation.result_keys`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .config_values import strict_booleans
from .io import sha256_file

HEAD_BYTES = 1 << 20


def fingerprint_file(path: str | os.PathLike) -> dict[str, Any]:
    """Size, modification time (ns) and SHA-256 of the first MiB of ``path``."""
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head_sha256": sha256_file(path, HEAD_BYTES)}


def model_folder(name: str) -> Path | None:
    """A local folder, or a hub id's snapshot in the local cache; ``None`` when neither."""
    if os.path.isdir(name):
        return Path(name)
    try:  # a hub id: its snapshot in the local cache, if there is one
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a hub id: recorded by name only
        return None


@strict_booleans
def fingerprint_model(name: str | None, content: bool = True) -> dict[str, Any] | None:
    """``{"name", "files": {file: fingerprint}}`` of a model folder or cached hub snapshot (top-level files;
    the model card aside, which a save may rewrite); ``{"name"}`` alone when it cannot be found locally. With
    ``content`` each file's fingerprint holds its whole contents' ``sha256`` too."""
    if not name:
        return None
    folder = model_folder(str(name))
    if folder is None:
        return {"name": str(name)}
    files = {
        p.name: {**fingerprint_file(p), **({"sha256": sha256_file(p)} if content else {})}
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.name.startswith(".") and p.name != "README.md"
    }
    return {"name": str(name), "files": files}


def model_content(name: str | None) -> dict[str, Any] | None:
    """What a model folder holds: ``{"files": {file: {"size", "sha256"}}}`` (whole contents, :func:`llm2vec.io.sha256_file`;
    no modification times, so a copy of the folder gives the same value); ``{"hub_id": name}`` for a hub id that is
    not in the local cache; ``None`` for no model."""
    fingerprint = fingerprint_model(name, content=True)
    if fingerprint is None:
        return None
    if "files" not in fingerprint:
        return {"hub_id": fingerprint["name"]}
    return {"files": {f: {"size": v["size"], "sha256": v["sha256"]} for f, v in fingerprint["files"].items()}}
