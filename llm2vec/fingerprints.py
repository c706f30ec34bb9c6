"""Fingerprints of files and model folders: what runs, adapter checks and stored results record of their inputs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .io import sha256_file
from .keywords import strict_booleans

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
    """``{"name", "files": {file: fingerprint}}`` of a model folder or cached hub snapshot (top-level files but the
    model card; with ``content``, each file's whole ``sha256`` too); ``{"name"}`` alone when it is not here."""
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
    """``{"files": {file: {"size", "sha256"}}}`` of a model folder; ``{"hub_id": name}`` if not here; None for none."""
    fingerprint = fingerprint_model(name, content=True)
    if fingerprint is None:
        return None
    if "files" not in fingerprint:
        return {"hub_id": fingerprint["name"]}
    return {"files": {f: {"size": v["size"], "sha256": v["sha256"]} for f, v in fingerprint["files"].items()}}
