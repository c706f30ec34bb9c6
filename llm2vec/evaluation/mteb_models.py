"""``mteb.get_model`` and ``mteb.get_model_meta`` for this package's models (an export, a trained folder, a hub id)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mteb.models.model_meta import ModelMeta

from ..io import short_hash
from ..llm2vec import read_llm2vec_config
from .mteb_wrapper import default_model_name, load_encoder, model_meta, path_or_id


def register(
    model: str | os.PathLike,
    peft_model_name_or_path: str | os.PathLike | None = None,
    *,
    name: str | None = None,
    instructions: Mapping[str, str] | str | os.PathLike | None = None,
    **settings: Any,
) -> ModelMeta:
    """Register ``model`` (+ adapter) with mteb under ``name`` (default: :func:`default_model_name`) and return its
    ``ModelMeta``; ``settings`` (keywords of ``LLM2VecMTEBEncoder.from_pretrained``) become its ``loader_kwargs``."""
    from mteb.models.model_implementations import MODEL_REGISTRY

    base, peft = path_or_id(model), path_or_id(peft_model_name_or_path)
    loader_kwargs: dict[str, Any] = {"base_model_name_or_path": base, "peft_model_name_or_path": peft, **settings}
    if instructions is not None:
        loader_kwargs["instructions"] = (
            os.path.abspath(instructions) if isinstance(instructions, (str, os.PathLike)) else dict(instructions)
        )
    config = _read_json(Path(base) / "config.json") if os.path.isdir(base) else {}
    meta = model_meta(
        loader_kwargs=loader_kwargs,
        name=name or default_model_name(base, peft),
        revision=short_hash(loader_kwargs, n=10),
        max_tokens=(read_llm2vec_config(base) if os.path.isdir(base) else {}).get("max_length"),
        embed_dim=config.get("hidden_size"),
    )
    keys = {meta.name, os.fspath(model), base}
    if peft_model_name_or_path is not None:
        keys |= {os.fspath(peft_model_name_or_path), peft}
    for key in keys:
        MODEL_REGISTRY[key] = meta
    return meta


def register_results(model_meta_file: str | os.PathLike) -> ModelMeta:
    """Register the model of a ``model_meta.json`` mteb wrote beside this package's results, so that
    ``mteb.get_model(<its name>)`` loads it again."""
    from mteb.models.model_implementations import MODEL_REGISTRY

    data = _read_json(Path(model_meta_file))
    if data.get("loader") != load_encoder.__name__:
        raise ValueError(
            f"{model_meta_file}: loader {data.get('loader')!r} is not this package's {load_encoder.__name__!r}; "
            "only model_meta.json files of LLM2VecMTEBEncoder results can be registered"
        )
    meta = ModelMeta.model_validate({**data, "loader": load_encoder})
    MODEL_REGISTRY[meta.name] = meta
    return meta


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
