"""What a model or adapter folder is checked for before it loads: code it would run, and pickled adapter weights.

**Code from a model folder.** A ``config.json`` or ``tokenizer_config.json`` whose ``auto_map`` names classes
asks transformers to import Python files of the folder (or of another hub repository) and run them. Without
``trust_remote_code``, transformers asks on standard input, where a piped ``y`` runs the code. The project
runs no such code unless the user says so: every load passes ``trust_remote_code`` explicitly (``False`` by
default), and :func:`check_remote_code` refuses a model whose files name custom code in one line, before
anything loads, even where transformers has a class of its own for the ``model_type`` (it would then load
that class instead of the one the folder's author wrote, silently). ``trust_remote_code=True`` (the
``trust_remote_code`` field of a run config, ``--trust_remote_code`` of evaluation and export) lets the code
run.

**Pickled adapters.** ``adapter_model.bin`` is a pickle: loading it can run code, and when ``torch.load``
refuses to (``weights_only``) the result is a long traceback. :func:`check_adapter_weights` refuses a local
adapter folder that holds only that file (peft reads ``adapter_model.safetensors`` first when both exist).

A hub id is checked from its files in the local cache, downloading ``config.json`` and
``tokenizer_config.json`` when they are not there (the load would fetch them anyway); when they cannot be
had (offline), the check is left to transformers, which refuses custom code since ``trust_remote_code`` is
passed as ``False``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CODE_FILES = ("config.json", "tokenizer_config.json")
"""The files whose ``auto_map`` names code that ``AutoConfig`` / ``AutoModel*`` / ``AutoTokenizer`` would run."""

PICKLED_ADAPTER = "adapter_model.bin"
SAFE_ADAPTER = "adapter_model.safetensors"


class ModelFilesError(ValueError):
    """A model or adapter folder that would run code or unpickle weights (one line: the folder, what, the fix)."""


def _json_file(name_or_path: str, filename: str) -> dict[str, Any] | None:
    """The JSON object ``filename`` of a local folder or a hub repository; ``None`` when it cannot be had."""
    if os.path.isdir(name_or_path):
        path: str | None = os.path.join(name_or_path, filename)
        if not os.path.isfile(path):
            return None
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(name_or_path, filename)
        except (OSError, ValueError):  # not a hub id, offline and not cached, no such file
            return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):  # unreadable or not JSON: the loader's own error says so
        return None
    return value if isinstance(value, dict) else None


def custom_code(name_or_path: str | os.PathLike) -> dict[str, list[str]]:
    """File name -> the ``auto_map`` entries (``"AutoModel": "modeling_x.XModel"``) that name code to run."""
    found = {}
    for filename in CODE_FILES:
        config = _json_file(os.fspath(name_or_path), filename)
        auto_map = config.get("auto_map") if config else None
        if auto_map:
            entries = auto_map.items() if isinstance(auto_map, dict) else [("auto_map", auto_map)]
            found[filename] = [f"{key}: {value}" for key, value in entries]
    return found


def check_remote_code(name_or_path: str | os.PathLike, trust_remote_code: bool = False, what: str = "model") -> None:
    """Refuse a model whose files name custom code (:class:`ModelFilesError`), unless ``trust_remote_code``."""
    if trust_remote_code:
        return
    found = custom_code(name_or_path)
    if found:
        filename, entries = next(iter(found.items()))
        raise ModelFilesError(
            f"{what} {os.fspath(name_or_path)}: its {filename} names custom code to run ({'; '.join(entries)}); "
            "this project runs no code from a model folder unless told to: pass --trust_remote_code (run config: "
            '"trust_remote_code": true) if you trust that code, or remove "auto_map" to load transformers\' own '
            "class for the model_type"
        )


def check_adapter_weights(path: str | os.PathLike | None) -> None:
    """Refuse a local adapter folder whose weights are only a pickle (``adapter_model.bin``)."""
    if path is None or not os.path.isdir(path):
        return
    folder = Path(path)
    if (folder / PICKLED_ADAPTER).is_file() and not (folder / SAFE_ADAPTER).is_file():
        raise ModelFilesError(
            f"adapter {folder}: its weights are {PICKLED_ADAPTER}, a pickle, which can run code when loaded; this "
            f"project loads adapters from {SAFE_ADAPTER} only. Convert it where you trust the file (peft's "
            "save_pretrained with safe_serialization=True writes it) and delete the .bin"
        )


def check_model_files(
    base_model_name_or_path: str | os.PathLike,
    peft_model_name_or_path: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
) -> None:
    """Every check of this module on a base model and its adapter (if any), before anything loads."""
    check_remote_code(base_model_name_or_path, trust_remote_code, "model")
    check_adapter_weights(peft_model_name_or_path)  # an adapter's own config and tokenizer files are not loaded
