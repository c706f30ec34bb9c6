"""What a model card shows (:class:`ModelCardInputs`): the stages that made a model (:func:`history_of`) and their
losses (:func:`loss_curve`). Missing or unreadable files leave their stage (or curve) out with a note, never raise."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io import RUN_CONFIG_NAME
from ..provenance import base_model_hub_id

TRAINER_STATE_NAME = "trainer_state.json"
MAX_CHAIN = 8  # stages followed back through run_config.json files
CURVE_POINTS = 6


@dataclass
class StageRecord:
    """One training run: its resolved config and logged history."""

    run_config: dict[str, Any]
    log_history: list[dict[str, Any]] = field(default_factory=list)
    folder: str | None = None  # where it was read from; None for the run being saved
    global_step: int | None = None


@dataclass
class ModelCardInputs:
    """Everything a card shows; build it with :meth:`for_export` or :meth:`for_training`."""

    kind: str  # "export", "model" (full weights) or "adapter" (a LoRA adapter)
    path: str  # the folder the card is written into, as the user named it
    base_model: str | None  # the hub id of the first model of the chain, when known
    base_path: str | None  # the first model of the chain as the run named it (a hub id or a local folder)
    history: list[StageRecord]
    embedding: dict[str, Any]  # pooling_mode, max_length, template, ...
    base_for_adapter: str | None = None  # an adapter's base model folder or id
    prompts: dict[str, str] = field(default_factory=dict)  # an export's prompts: name -> instruction
    query_source: str = ""  # where an export's query instruction came from
    adhoc_prompts: bool = False  # an export whose chat template maps any instruction passed as prompt=
    text_marker: str = ""  # an export's marker between prompt and text (llm2vec.export.TEXT_MARKER)
    mteb_results: Sequence[str | os.PathLike] = ()  # the result folders the table was read from
    mteb_table: str = ""  # their category table, rendered (Markdown); "" for none
    notes: list[str] = field(default_factory=list)

    @classmethod
    def for_training(
        cls,
        output_dir: str | os.PathLike,
        run_config: Mapping[str, Any],
        log_history: Sequence[Mapping[str, Any]],
        encoder,
        global_step: int | None = None,
    ) -> ModelCardInputs:
        """The card of a checkpoint or final save of the run being trained (the trainer's ``_save``)."""
        current = StageRecord(dict(run_config), [dict(e) for e in log_history], None, global_step)
        notes: list[str] = []
        history = _upstream(current, notes) + [current]
        adapter = hasattr(encoder.model, "peft_config")
        embedding = dict(encoder.llm2vec_config())
        return cls(
            kind="adapter" if adapter else "model",
            path=str(output_dir),
            base_model=base_model_hub_id(history[0].run_config if history else None),
            base_path=_root_model(history),
            history=history,
            embedding=embedding,
            base_for_adapter=run_config.get("model_name_or_path") if adapter else None,
            notes=notes,
        )

    @classmethod
    def for_export(
        cls,
        base_model_name_or_path: str,
        peft_model_name_or_path: str | None,
        *,
        encoder,
        normalize: bool,
        dtype,
        output_dir: str | os.PathLike | None = None,
        **shown: Any,
    ) -> ModelCardInputs:
        """The card of a sentence-transformers export of ``base`` (+ ``peft``); ``shown``: its other fields."""
        notes: list[str] = []
        history = history_of([p for p in (base_model_name_or_path, peft_model_name_or_path) if p], notes)
        embedding = dict(
            encoder.llm2vec_config(),
            normalize=normalize,
            dtype=str(dtype).replace("torch.", ""),
            dimensions=encoder.model.config.hidden_size,
        )
        first = history[0].run_config if history else None
        return cls(
            kind="export",
            path=str(output_dir) if output_dir else "path/to/export",
            base_model=base_model_hub_id(first, fallback=base_model_name_or_path),
            base_path=_root_model(history) or base_model_name_or_path,
            history=history,
            embedding=embedding,
            notes=notes,
            **shown,
        )


def read_stage(folder: str | os.PathLike, notes: list[str]) -> StageRecord | None:
    """The run saved in ``folder`` (its run config and trainer state), or None; what cannot be read goes to ``notes``."""
    folder = Path(folder)
    config_path = folder / RUN_CONFIG_NAME
    if not config_path.is_file():
        return None
    try:
        run_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        notes.append(f"{config_path} could not be read ({e}); that stage is left out.")
        return None
    log_history, step = [], None
    state_path = folder / TRAINER_STATE_NAME
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
            log_history, step = list(state.get("log_history", [])), state.get("global_step")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            notes.append(f"{state_path} could not be read ({e}); no loss curve for that stage.")
    return StageRecord(run_config, log_history, str(folder), step)


def _upstream(record: StageRecord, notes: list[str], depth: int = 0) -> list[StageRecord]:
    """The stages before ``record`` (oldest first), through the local folders its config names."""
    if depth >= MAX_CHAIN:
        return []
    out: list[StageRecord] = []
    for key in ("model_name_or_path", "peft_model_name_or_path"):
        source = record.run_config.get(key)
        if not source or not os.path.isdir(source):
            continue
        previous = read_stage(source, notes)
        if previous is not None:
            out += _upstream(previous, notes, depth + 1) + [previous]
    return out


def history_of(paths: Sequence[str | os.PathLike], notes: list[str] | None = None) -> list[StageRecord]:
    """The stages that made the models in ``paths`` (a base and an adapter), oldest first, no repeats."""
    notes = notes if notes is not None else []
    out: list[StageRecord] = []
    seen: set[str] = set()
    for path in paths:
        if not os.path.isdir(path):
            continue
        record = read_stage(path, notes)
        if record is None:
            continue
        for r in _upstream(record, notes) + [record]:
            key = os.path.abspath(r.folder) if r.folder else id(r)
            if key not in seen:
                seen.add(key)
                out.append(r)
    return out


def _root_model(history: Sequence[StageRecord]) -> str | None:
    return history[0].run_config.get("model_name_or_path") if history else None


def loss_curve(log_history: Sequence[Mapping[str, Any]], points: int = CURVE_POINTS) -> dict[str, Any] | None:
    """A summary of the logged training losses (None without any): ``rows`` (``points`` evenly spaced, first and
    last included) of ``columns``, ``min``, ``last``, ``n`` and ``train_loss``."""
    logged = [e for e in log_history if "loss" in e and "step" in e]
    if not logged:
        return None
    if len(logged) <= points:
        picked = list(range(len(logged)))
    else:
        picked = sorted({round(i * (len(logged) - 1) / (points - 1)) for i in range(points)})
    parts = sorted({k for e in logged for k in e if k.startswith("loss_")})
    columns = ["step", "loss", *parts, "learning_rate"]
    rows = [{k: logged[i].get(k) for k in columns} for i in picked]
    best = min(logged, key=lambda e: e["loss"])
    summary = next((e for e in log_history if "train_loss" in e), None)
    return {
        "columns": columns,
        "rows": rows,
        "n": len(logged),
        "min": (best["step"], best["loss"]),
        "last": (logged[-1]["step"], logged[-1]["loss"]),
        "train_loss": summary.get("train_loss") if summary else None,
    }
