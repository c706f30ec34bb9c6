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

**Folders as saved.** A local model or adapter folder whose file links outside it is refused (a Hugging Face cache
snapshot's links to its blobs aside), so a ``chat_template.jinja`` linked to a private file is never read; a run's
final model or an export is checked against the sizes and SHA-256 its save recorded last
(:func:`llm2vec.io.saved_folder_problem`).

**Pickled adapters.** ``adapter_model.bin`` is a pickle: loading it can run code, and when ``torch.load``
refuses to (``weights_only``) the result is a long traceback. :func:`check_adapter_weights` refuses a local
adapter folder that holds only that file (peft reads ``adapter_model.safetensors`` first when both exist).

**Adapters that do not belong to the base.** :func:`check_adapter` is the one check every adapter load goes through
(training's ``peft_model_name_or_path``, :meth:`llm2vec.LLM2Vec.load` and so ``from_pretrained``, evaluation,
the export), before anything loads: a folder without ``adapter_config.json`` (a full model given as an adapter
is named as such), an adapter whose LoRA matrices do not fit the base model's layers (another hidden size: read
from the safetensors headers of both, no weights loaded), and an adapter whose ``run_config.json`` records
the fingerprint of another base model (:mod:`llm2vec.run.inputs`: the size and the SHA-256 of the first MiB of
each weights file, so a copy of the right base passes and a base of the same shape with other weights does not).
``accept_other_base`` turns the last refusal into a warning; the first two cannot be loaded at all.

A hub id is checked from its files in the local cache, downloading ``config.json`` and
``tokenizer_config.json`` when they are not there (the load would fetch them anyway); when they cannot be
had (offline), the check is left to transformers, which refuses custom code since ``trust_remote_code`` is
passed as ``False``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .config_values import strict_booleans
from .fingerprints import fingerprint_model, model_folder
from .io import saved_folder_problem

logger = logging.getLogger("llm2vec")

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


@strict_booleans
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


ADAPTER_CONFIG = "adapter_config.json"
RUN_CONFIG = "run_config.json"
WEIGHT_PATTERN = "*.safetensors"


def _shapes(files: list[Path]) -> dict[str, list[int]]:
    """Tensor name -> shape, from the headers of safetensors ``files`` (nothing else is read)."""
    shapes = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        except (OSError, ValueError):
            continue  # a damaged file: the load itself reports it
        if isinstance(header, dict):
            shapes.update({k: v.get("shape") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)})
    return shapes


def _shape_problem(adapter: Path, base: Path) -> str | None:
    """Where the adapter's LoRA matrices do not fit the base's linear layers (``A``: rank x inputs, ``B``: outputs x
    rank, against the base weight's outputs x inputs), else ``None``."""
    lora = _shapes([adapter / SAFE_ADAPTER])
    weights = _shapes(sorted(base.glob(WEIGHT_PATTERN)))
    if not lora or not weights:
        return None
    modules = {}
    for key, shape in weights.items():
        if key.endswith(".weight") and shape and len(shape) == 2:
            module = key[: -len(".weight")]
            modules.setdefault(module, shape)
            modules.setdefault(module.removeprefix("model."), shape)
    for key, shape in sorted(lora.items()):
        for part, index, what in ((".lora_A.weight", 1, "inputs"), (".lora_B.weight", 0, "outputs")):
            if not key.endswith(part) or not shape or len(shape) != 2:
                continue
            module = key[: -len(part)].removeprefix("base_model.model.")
            found = modules.get(module) or modules.get(module.removeprefix("model."))
            if found is None:
                return f"its layer {module} does not exist in the base model"
            if found[index] != shape[index]:
                return f"its layer {module} has {shape[index]} {what}, the base model's {found[index]}"
    return None


def _fingerprint_problem(recorded: dict[str, Any], base: Path | None) -> str | None:
    """How the base model folder ``base`` differs from the base an adapter's ``run_config.json`` recorded
    (``recorded``: its ``inputs.base_model``; the weights files' sizes and first-MiB hashes, names and
    modification times aside), else ``None`` (also when either is unknown: no record, or a hub id not in the
    cache)."""
    old = {k: v for k, v in (recorded.get("files") or {}).items() if Path(k).match(WEIGHT_PATTERN)}
    if not old or base is None:
        return None
    new = {k: v for k, v in (fingerprint_model(str(base)).get("files") or {}).items() if Path(k).match(WEIGHT_PATTERN)}
    if set(old) != set(new):
        return f"its weights files are {', '.join(sorted(new)) or 'none'}, the recorded base's {', '.join(sorted(old))}"
    for name in sorted(old):
        a, b = old[name], new[name]
        if (a.get("size"), a.get("head_sha256")) != (b.get("size"), b.get("head_sha256")):
            return f"its {name} differs from the recorded base's (" + (
                f"{b.get('size')} bytes, recorded {a.get('size')})"
                if a.get("size") != b.get("size")
                else "other contents)"
            )
    return None


@strict_booleans
def check_adapter(
    base_model_name_or_path: str | os.PathLike,
    peft_model_name_or_path: str | os.PathLike | None,
    accept_other_base: bool = False,
) -> None:
    """Refuse (:class:`ModelFilesError`, one line) an adapter that is no LoRA adapter folder, does not fit the base
    model's layers, or was trained on another base (its ``run_config.json``); with ``accept_other_base`` the
    last is a warning. A hub id that is not a local folder is left to peft."""
    if peft_model_name_or_path is None:
        return
    folder = Path(peft_model_name_or_path)
    base = os.fspath(base_model_name_or_path)
    if folder.is_file():
        raise ModelFilesError(f"adapter {folder} is a file; give the adapter's folder (it holds {ADAPTER_CONFIG})")
    if not folder.is_dir():
        return
    if not (folder / ADAPTER_CONFIG).is_file():
        full = [
            n for n in ("config.json", "model.safetensors", "model.safetensors.index.json") if (folder / n).is_file()
        ]
        if full:
            raise ModelFilesError(
                f"adapter {folder} holds a full model ({', '.join(full)}), not a LoRA adapter (no {ADAPTER_CONFIG}): "
                "give it as the base model (model_name_or_path / --base_model_name_or_path) and leave the adapter out"
            )
        raise ModelFilesError(
            f"adapter {folder} has no {ADAPTER_CONFIG}: it is not a LoRA adapter folder (a Stage II run's output or "
            "checkpoint is one)"
        )
    check_adapter_weights(folder)
    local_base = model_folder(base)
    problem = _shape_problem(folder, local_base) if local_base is not None else None
    if problem:
        raise ModelFilesError(
            f"adapter {folder} does not fit the base model {base}: {problem} (it was trained on a model of another "
            "shape); give the base model it was trained on"
        )
    recorded = ((_json_file(os.fspath(folder), RUN_CONFIG) or {}).get("inputs") or {}).get("base_model") or {}
    problem = _fingerprint_problem(recorded, local_base)
    if problem is None:
        return
    message = (
        f"adapter {folder} was trained on the base model {recorded.get('name', '?')} (its {RUN_CONFIG} records the "
        f"base's fingerprint), but the base model {base} is another one: {problem}"
    )
    if not accept_other_base:
        raise ModelFilesError(
            f"{message}. Load it on the base it was trained on, or pass --accept_other_base (run config: "
            '"accept_other_base": true; Python: accept_other_base=True) to load it anyway'
        )
    if (key := (os.fspath(folder), base)) not in _WARNED:
        _WARNED.add(key)
        logger.warning("accept_other_base: %s", message)


_WARNED: set[tuple[str, str]] = set()  # an accepted mismatch is logged once per adapter and base


@strict_booleans
def check_model_files(
    base_model_name_or_path: str | os.PathLike,
    peft_model_name_or_path: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    accept_other_base: bool = False,
) -> None:
    """Every check of this module on a base model and its adapter (if any), before anything loads; first that
    their local folders hold no link out of them and, when a run or export saved them, still hold what it wrote
    (:func:`llm2vec.io.saved_folder_problem`)."""
    for what, folder in (("model", base_model_name_or_path), ("adapter", peft_model_name_or_path)):
        problem = saved_folder_problem(folder)
        if problem:
            raise ModelFilesError(f"{what} {os.fspath(folder)}: {problem}")
    check_remote_code(base_model_name_or_path, trust_remote_code, "model")
    check_adapter_weights(peft_model_name_or_path)  # an adapter's own config and tokenizer files are not loaded
    check_adapter(base_model_name_or_path, peft_model_name_or_path, accept_other_base)
