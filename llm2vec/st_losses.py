"""The sentence-transformers losses Stage II trains (:data:`TRAINABLE_LOSSES`), checked by name and
``loss_kwargs`` before any model loads, and built on the model (scale and temperature from ``loss_scale``)."""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .arguments import ConfigError, RunConfig
from .st_model import sentence_transformer

DEFAULT_LOSS = "CachedMultipleNegativesRankingLoss"
_IN_BATCH = ("MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss", "GISTEmbedLoss")
TRAINABLE_LOSSES = tuple(name for loss in _IN_BATCH for name in (loss, f"Cached{loss}"))
"""The losses this path trains (each also cached): in-batch negatives over (query, positive[, negative]) rows."""
WRAPPING_LOSSES = ("MatryoshkaLoss",)
"""Losses that modify another loss: ``loss_kwargs["loss"]`` names it, ``loss_kwargs["loss_kwargs"]`` its arguments."""
GUIDED_LOSSES = ("GISTEmbedLoss", "CachedGISTEmbedLoss")
SIMILARITIES = ("cos_sim", "dot_score", "euclidean_sim", "manhattan_sim")
"""The ``similarity_fct`` names of ``sentence_transformers.util`` a loss may take (JSON holds no functions)."""


def _check_value(loss: str, key: str, value: Any, default: Any) -> None:
    """A ``loss_kwargs`` value of the type its default (or name) implies; else one :class:`ConfigError` line."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    number = (whole or isinstance(value, float)) and math.isfinite(value)
    if key.startswith("mini_batch") or key == "n_dims_per_step":
        ok = (whole and value >= 1) or (value is None and default is None) or (value == -1 == default)
        want = "a whole number of at least 1" + (" (or null)" if default is None else "")
    elif key == "matryoshka_dims":
        ok = isinstance(value, list) and bool(value) and all(isinstance(d, int) and d >= 1 for d in value)
        want = "a list of whole numbers of at least 1"
    elif callable(default):
        ok, want = value in SIMILARITIES, f"one of {', '.join(SIMILARITIES)}"
    elif isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, (int, float)):
        ok = number and (value > 0 or key not in ("scale", "temperature"))
        want = "a positive number" if key in ("scale", "temperature") else "a finite number"
    else:
        return
    if not ok:
        raise ConfigError(f"loss_kwargs.{key} of {loss}: {json.dumps(value, default=str)[:60]}; give {want}")


def check_loss_arguments(name: str, kwargs: Mapping[str, Any], wrapped: bool = False) -> None:
    """``name`` and its ``loss_kwargs`` (a wrapper's inner loss and arguments too) as this path trains them, before any
    model loads; one :class:`ConfigError` line naming the field and what to give."""
    from sentence_transformers.sentence_transformer import losses

    choices = TRAINABLE_LOSSES if wrapped else (*TRAINABLE_LOSSES, *WRAPPING_LOSSES)
    if name not in choices:
        what = (
            "a loss this path trains"
            if name.endswith("Loss") and isinstance(getattr(losses, name, None), type)
            else "a sentence-transformers loss"
        )
        raise ConfigError(
            f"{'loss_kwargs.loss' if wrapped else 'loss'}={name!r}: not {what} (its rows are query, positive[, "
            f"negative], without labels); choose one of {', '.join(choices)}"
        )
    params = inspect.signature(getattr(losses, name).__init__).parameters
    accepted = [p for p in params if p not in ("self", "model")]
    extra = ("loss_kwargs",) if name in WRAPPING_LOSSES else ()
    unknown = [k for k in kwargs if (k not in params and k not in extra) or k == "model"]
    if unknown:
        raise ConfigError(
            f"loss_kwargs: {name} takes no argument {', '.join(map(repr, unknown))}; its arguments: {', '.join(accepted)}"
        )
    for key, value in kwargs.items():
        if key in params and key not in ("loss", "guide"):
            _check_value(name, key, value, params[key].default)
    if name in WRAPPING_LOSSES:
        inner, inner_kwargs = kwargs.get("loss", DEFAULT_LOSS), kwargs.get("loss_kwargs") or {}
        if not isinstance(inner, str) or not isinstance(inner_kwargs, Mapping):
            raise ConfigError(f"loss_kwargs of {name}: loss is the name of the loss it wraps, loss_kwargs an object")
        check_loss_arguments(inner, inner_kwargs, wrapped=True)
    elif "loss_kwargs" in kwargs:
        raise ConfigError(f"loss_kwargs: {name} wraps no other loss, so it takes no loss_kwargs of its own")
    guide = kwargs.get("guide")
    if guide is not None and not isinstance(guide, str):
        raise ConfigError(f"loss_kwargs.guide of {name}: give a model folder or a cached hub id")


def model_paths(kwargs: Mapping[str, Any], prefix: str = "loss_kwargs") -> Iterator[tuple[str, str]]:
    """``(field, value)`` of every text in ``kwargs`` (at any depth) that names a model: a guide, a
    ``*name_or_path`` argument, or any existing folder."""
    for key, value in kwargs.items():
        if isinstance(value, Mapping):
            yield from model_paths(value, f"{prefix}.{key}")
        elif isinstance(value, str) and (key == "guide" or key.endswith("name_or_path") or os.path.isdir(value)):
            yield f"{prefix}.{key}", value


def check_model_paths(config: RunConfig) -> None:
    """Each model ``loss_kwargs`` names (:func:`model_paths`) is a folder here or a model in the local hub cache, not
    ``output_dir``'s, not in use, and runs no code of its own without ``trust_remote_code``; one line each."""
    from .fingerprints import model_folder
    from .model_files import ModelFilesError, check_exists, check_not_in_use, check_remote_code

    out = Path(config.training.output_dir).expanduser().resolve()
    for field_name, path in model_paths(config.stage.loss_kwargs or {}):
        if os.path.isfile(path):
            raise ConfigError(f"{field_name} {path}: a file; give a model folder (or a cached hub id)")
        try:
            check_exists(path, field_name)
            folder = model_folder(path)
            if folder is None:
                raise ModelFilesError(
                    f"{field_name} {path}: not a folder here, nor a model in the local hub cache; run `hf download "
                    f"{path}` first, or give a folder"
                )
            check_not_in_use(path, field_name)
            check_remote_code(path, config.model.trust_remote_code, field_name)
        except ModelFilesError as e:
            raise ConfigError(str(e)) from None
        read = folder.resolve()
        if read == out or read in out.parents or out in read.parents:
            raise ConfigError(f"{field_name} {path} and output_dir {out} overlap: a run never writes where it reads")


def build_loss(name: str, kwargs: Mapping[str, Any], model, loss_scale: float = 20.0):
    """The loss ``name`` on ``model`` (docs/design.md), after :func:`check_loss_arguments`; a GIST guide given as a
    folder is loaded as :func:`sentence_transformer` (an export's folder as it is), a ``SentenceTransformer`` used."""
    from sentence_transformers import util
    from sentence_transformers.sentence_transformer import losses

    check_loss_arguments(name, {k: v for k, v in (kwargs or {}).items() if k != "guide" or isinstance(v, str)})
    cls, kwargs = getattr(losses, name), dict(kwargs or {})
    params = inspect.signature(cls.__init__).parameters
    if isinstance(kwargs.get("similarity_fct"), str):
        kwargs["similarity_fct"] = getattr(util, kwargs["similarity_fct"])
    if name in WRAPPING_LOSSES:
        inner, inner_kwargs = kwargs.pop("loss", DEFAULT_LOSS), kwargs.pop("loss_kwargs", {})
        kwargs["loss"] = build_loss(inner, inner_kwargs, model, loss_scale)
    if "scale" in params and "scale" not in kwargs:
        kwargs["scale"] = loss_scale
    if name in GUIDED_LOSSES:
        if "temperature" not in kwargs:
            kwargs["temperature"] = 1.0 / loss_scale
        guide = kwargs.get("guide")
        if guide is None:
            kwargs["guide"] = model  # self-guided: the model being trained, without gradient, picks the negatives
        elif isinstance(guide, (str, os.PathLike)):
            kwargs["guide"] = _load_guide(str(guide), model.max_seq_length)
    try:
        return cls(model, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"loss_kwargs of {name}: {str(e).splitlines()[0]}") from None


def _load_guide(path: str, max_length: int):
    from sentence_transformers import SentenceTransformer

    if (Path(path) / "modules.json").exists():  # a sentence-transformers folder (an export)
        return SentenceTransformer(path, device="cpu", local_files_only=True)
    return sentence_transformer(path, max_length=max_length)
