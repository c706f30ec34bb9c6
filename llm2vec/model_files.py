"""What a model or adapter folder is checked for before it loads (docs/design.md)."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from .fingerprints import fingerprint_model, model_folder
from .io import FINAL_SAVE_RECORD, RUN_CONFIG_NAME, missing_local_path, saved_folder_problem
from .keywords import strict_booleans

logger = logging.getLogger("llm2vec")


CONFIG_NAME = "llm2vec_config.json"
DEFAULTS = {"pooling_mode": "eos_token", "max_length": 512, "template": None, "prompts": None}  # its only fields


def read_llm2vec_config(path: str | os.PathLike | None) -> dict[str, Any]:
    """The ``llm2vec_config.json`` of a local folder, or ``{}`` (hub ids and folders without one)."""
    if path is None or not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return {}
    file = os.path.join(path, CONFIG_NAME)
    try:
        with open(file) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e}); fix or delete the file") from None
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"{file}: unknown field(s) {sorted(unknown)}; known fields: {sorted(DEFAULTS)}")
    return config


CODE_FILES = ("config.json", "tokenizer_config.json")  # whose auto_map names code transformers would run

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


@strict_booleans
def check_remote_code(name_or_path: str | os.PathLike, trust_remote_code: bool = False, what: str = "model") -> None:
    """Refuse a model whose files' ``auto_map`` names custom code (:class:`ModelFilesError`), unless
    ``trust_remote_code``."""
    if trust_remote_code:
        return
    for filename in CODE_FILES:
        config = _json_file(os.fspath(name_or_path), filename)
        auto_map = config.get("auto_map") if config else None
        if not auto_map:
            continue
        entries = auto_map.items() if isinstance(auto_map, dict) else [("auto_map", auto_map)]
        raise ModelFilesError(
            f"{what} {os.fspath(name_or_path)}: its {filename} names custom code to run "
            f"({'; '.join(f'{key}: {value}' for key, value in entries)}); "
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


@strict_booleans
def adapter_problem(folder: Path, base: Path, trust_remote_code: bool) -> str | None:
    """How the adapter's tensors differ from those peft creates for its ``adapter_config.json`` on the base model
    (built on the meta device from the base's ``config.json``: no weights are read), else ``None``: a tensor the
    config implies that the weights lack, a tensor no created module uses, or a tensor of another shape (the base's
    layers another size: "does not fit"; the rank or the layer another size: the config and the weights disagree)."""
    import torch
    from peft import PeftConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoConfig, AutoModel

    from .compat import peft_reads_deprecated_property

    try:
        config = PeftConfig.from_pretrained(os.fspath(folder))
        base_config = AutoConfig.from_pretrained(os.fspath(base), trust_remote_code=trust_remote_code)
        with torch.device("meta"), peft_reads_deprecated_property(), warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*base_model_name_or_path", category=UserWarning
            )  # checked below
            model = get_peft_model(AutoModel.from_config(base_config, trust_remote_code=trust_remote_code), config)
    except Exception as e:  # noqa: BLE001 - peft or transformers cannot read the folders: one line, the reason
        reason = " ".join(str(e).split())[:200]
        return f"peft cannot build it on the base model ({type(e).__name__}: {reason})"
    expected = {k: list(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    saved = _shapes([folder / SAFE_ADAPTER])
    layers = {name for name, _ in model.get_base_model().named_modules()}
    fix = (
        f"the adapter is incomplete or its {ADAPTER_CONFIG} is not the one saved with these weights; use the "
        "folder as its run saved it"
    )
    missing = sorted(set(expected) - set(saved))
    if missing:
        return (
            f"{SAFE_ADAPTER} has no tensor {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f", which its {ADAPTER_CONFIG} implies (target_modules {_targets(config)}); {fix}"
        )
    for key in sorted(set(saved) - set(expected)):
        layer = key.removeprefix("base_model.model.").split(".lora_")[0]
        if layer not in layers:
            return f"does not fit: its layer {layer} does not exist in the base model"
        unused = len(set(saved) - set(expected))
        return (
            f"{SAFE_ADAPTER} holds {unused} tensor(s) that no module of its {ADAPTER_CONFIG} uses (first: {key}; "
            f"target_modules {_targets(config)}); {fix}"
        )
    for key in sorted(saved):
        shape, wanted = saved[key], expected[key]
        if shape == wanted:
            continue
        layer = key.removeprefix("base_model.model.").split(".lora_")[0]
        if key.endswith(".lora_A.weight") and shape[1:] != wanted[1:]:
            return f"does not fit: its layer {layer} has {shape[1]} inputs, the base model's {wanted[1]}"
        if key.endswith(".lora_B.weight") and shape[:1] != wanted[:1]:
            return f"does not fit: its layer {layer} has {shape[0]} outputs, the base model's {wanted[0]}"
        return f"its tensor {key} has shape {shape}, its {ADAPTER_CONFIG} implies {wanted} (r={config.r}); {fix}"
    return None


def _targets(config) -> str:
    modules = config.target_modules
    return json.dumps(sorted(modules) if isinstance(modules, (set, list, tuple)) else modules)


def _weights(fingerprint: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The weights files (``*.safetensors``) of a :func:`~llm2vec.fingerprints.fingerprint_model` record."""
    return {k: v for k, v in ((fingerprint or {}).get("files") or {}).items() if Path(k).match(WEIGHT_PATTERN)}


def _content_problem(recorded: dict[str, Any], base: Path) -> str | None:
    """How the weights files of the base model folder ``base`` differ (by SHA-256, else the first MiB's) from a
    recorded base (a :func:`~llm2vec.fingerprints.fingerprint_model` record), else ``None``."""
    old, new = _weights(recorded), _weights(fingerprint_model(str(base)))
    if set(old) != set(new):
        return f"its weights files are {', '.join(sorted(new)) or 'none'}, the recorded base's {', '.join(sorted(old))}"
    for name in sorted(old):
        a, b = old[name], new[name]
        if a.get("size") != b.get("size"):
            return f"its {name} differs from the recorded base's ({b.get('size')} bytes, recorded {a.get('size')})"
        key = "sha256" if "sha256" in a else "head_sha256"
        if a.get(key) != b.get(key):
            return f"its {name} differs from the recorded base's (other contents: its SHA-256 differs)"
    return None


def _recorded_base(folder: Path) -> tuple[str | None, dict[str, Any] | None, str]:
    """What the adapter folder says of its base model: ``(name, fingerprint, source)``, the fingerprint its
    ``run_config.json`` recorded, else that of the folder its ``adapter_config.json`` names (if here), else ``None``."""
    recorded = ((_json_file(os.fspath(folder), RUN_CONFIG_NAME) or {}).get("inputs") or {}).get("base_model") or {}
    if _weights(recorded):
        return recorded.get("name"), recorded, f"its {RUN_CONFIG_NAME} records the base's SHA-256"
    name = (_json_file(os.fspath(folder), ADAPTER_CONFIG) or {}).get("base_model_name_or_path") or recorded.get("name")
    if not name:
        return None, None, f"neither its {RUN_CONFIG_NAME} nor its {ADAPTER_CONFIG} names a base model"
    named = model_folder(str(name))
    if named is None:
        return str(name), None, f"its {ADAPTER_CONFIG} names the base model {name}, which is not here to compare"
    return str(name), fingerprint_model(str(named)), f"its {ADAPTER_CONFIG} names the base model {name}"


@strict_booleans
def check_adapter(
    base_model_name_or_path: str | os.PathLike,
    peft_model_name_or_path: str | os.PathLike | None,
    accept_other_base: bool = False,
    trust_remote_code: bool = False,
) -> None:
    """Refuse (:class:`ModelFilesError`, one line) a local adapter folder that is no LoRA adapter, whose tensors are
    not those peft creates on the base, or that was trained on another base (``accept_other_base``: a warning)."""
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
    if not (folder / SAFE_ADAPTER).is_file():
        raise ModelFilesError(
            f"adapter {folder} has no {SAFE_ADAPTER}: its weights are missing; give the folder as its run saved it"
        )
    local_base = model_folder(base)
    if local_base is None:
        return  # a hub id not in the cache: nothing to read before transformers downloads it
    problem = adapter_problem(folder, local_base, trust_remote_code)
    if problem and problem.startswith("does not fit: "):
        raise ModelFilesError(
            f"adapter {folder} does not fit the base model {base}: {problem.removeprefix('does not fit: ')} (it was "
            "trained on a model of another shape); give the base model it was trained on"
        )
    if problem:
        raise ModelFilesError(f"adapter {folder}: {problem}")
    name, recorded, source = _recorded_base(folder)
    if recorded is None:
        message = f"adapter {folder}: the base model it was trained on cannot be identified ({source})"
    else:
        problem = _content_problem(recorded, local_base)
        if problem is None:
            return
        message = (
            f"adapter {folder} was trained on the base model {name} ({source}), but the base model {base} is another "
            f"one: {problem}"
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


def check_not_in_use(name_or_path: str | os.PathLike | None, what: str = "model") -> None:
    """Refuse (:class:`ModelFilesError`, one line naming the holder) a local folder that is, or lies inside, the
    folder of a live run (its lock held: :mod:`llm2vec.run.lock`)."""
    if name_or_path is None or not os.path.isdir(name_or_path):
        return
    from .run.lock import LOCK_NAME, describe_holder, is_held

    folder = Path(name_or_path).resolve()
    for run_folder in (folder, *folder.parents):
        if is_held(run_folder / LOCK_NAME):
            raise ModelFilesError(
                f"{what} {os.fspath(name_or_path)}: {run_folder} is in use by a live run: "
                f"{describe_holder(run_folder / LOCK_NAME)}. Wait for the run to end (or stop it), or read a copy "
                "made after it ended"
            )


def check_exists(name_or_path: str | os.PathLike | None, what: str = "model") -> None:
    """Refuse (:class:`ModelFilesError`, one line) a name that is a local path (docs/design.md) to no folder."""
    if name_or_path is None or os.path.exists(name_or_path):
        return  # a file where a folder belongs is the other checks' and the loader's to report
    text = os.fspath(name_or_path)
    if missing_local_path(text):
        raise ModelFilesError(f"{what} {text}: no such folder")
    namespace, slash, _ = text.partition("/")
    if not slash or not os.path.isdir(namespace):
        return  # a hub id: transformers and peft read it from the hub or its cache
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(text, ADAPTER_CONFIG if what == "adapter" else "config.json")
    except ValueError:  # no valid hub id either
        cached = None
    if not isinstance(cached, str):
        raise ModelFilesError(
            f"{what} {text}: no such folder ({namespace}/ is a folder here, so {text} is read as a path, and no hub "
            f"model {text} is in the local hub cache; for a hub model of that id, run `hf download {text}` first)"
        )


@strict_booleans
def check_model_files(
    base_model_name_or_path: str | os.PathLike,
    peft_model_name_or_path: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    accept_other_base: bool = False,
) -> None:
    """Every check of this module on a base model and its adapter (if any), before anything loads."""
    check_exists(base_model_name_or_path, "model")
    check_exists(peft_model_name_or_path, "adapter")
    check_not_in_use(base_model_name_or_path, "model")
    check_not_in_use(peft_model_name_or_path, "adapter")
    for what, folder in (("model", base_model_name_or_path), ("adapter", peft_model_name_or_path)):
        problem = saved_folder_problem(folder)
        if problem:
            raise ModelFilesError(f"{what} {os.fspath(folder)}: {problem}")
    base = Path(base_model_name_or_path)
    names = {p.name for p in base.iterdir()} if base.is_dir() else {"config.json"}
    run = any(n in (RUN_CONFIG_NAME, FINAL_SAVE_RECORD) or n.startswith("checkpoint-") for n in names)
    # a run's folder (llm2vec.run.target.folder_holds's rule, by name: only run.lock is imported here) is left to
    # the run checks, finished or not
    if "config.json" not in names and not run:
        raise ModelFilesError(
            f"model {os.fspath(base_model_name_or_path)}: a folder without config.json, so no model transformers "
            "can load; give the folder a run or a model conversion wrote"
        )
    check_remote_code(base_model_name_or_path, trust_remote_code, "model")
    check_adapter_weights(peft_model_name_or_path)  # an adapter's own config and tokenizer files are not loaded
    check_adapter(base_model_name_or_path, peft_model_name_or_path, accept_other_base, trust_remote_code)
