"""Never lose a finished run: what an output folder holds, complete-or-absent saves, start-up checks.

A finished run's ``output_dir`` holds the final model (what :meth:`llm2vec.LLM2Vec.save` writes),
``run_config.json``, ``trainer_state.json``, the ``checkpoint-<step>`` folders the config asked for, and,
written last, the completion marker :data:`COMPLETE_MARKER`.

- **Checkpoints are complete or absent.** The Trainer writes a checkpoint into a staging folder
  ``.checkpoint-<step>.staging.tmp/``; once every process has written its part (weights, optimizer,
  scheduler, each rank's RNG state, ``trainer_state.json``), the files are fsynced and the folder is renamed
  to ``checkpoint-<step>`` in one atomic step. A run killed during a save leaves only the staging folder,
  which nothing reads and the next run deletes. Old checkpoints are rotated out (``save_total_limit``) by
  renaming them away before deleting them. A ``checkpoint-<step>`` folder without its weights or its
  ``trainer_state.json`` (made by other tools or older versions) is skipped with a warning.
- **The final model is finished when the marker exists.** The marker is removed before the final save starts
  and written (atomically) after every file of the final model is on disk.
- **A finished run is not overwritten.** A run refuses to start in a folder that holds a finished model or
  checkpoints, and says what is there and how its ``run_config.json`` differs from the new config:
  ``--resume_from_checkpoint true`` continues it, ``--overwrite_output_dir true`` replaces it.
- **A finished run is recognised.** ``--resume_from_checkpoint true`` on a finished run whose training-length
  fields (:func:`training_end_fields`) equal the new config's says so and does nothing (exit 0). If the new
  config trains further, the run continues from its newest complete checkpoint; if it ends earlier, it is
  refused. A resumed run whose newest complete checkpoint is at the end (a kill during the final save)
  writes the final model from that checkpoint without training another step.
- **Fail before the hours.** :func:`startup_checks` (output folder writable, model and its template) and
  :func:`prepare` (where training ends, free disk space) run before anything is deleted or trained.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from .arguments import ConfigError, RunConfig, argument_classes
from .io import atomic_write

logger = logging.getLogger("llm2vec")

COMPLETE_MARKER = "training_complete.json"  # written last by the final save: its presence marks a finished run
RUN_CONFIG_NAME = "run_config.json"
TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")

# The fields that decide at which optimizer step training ends. A field added later that stops training
# (e.g. after N steps of a longer schedule) is found by its metadata ``{"ends_training": True}`` or by
# being named here; its value is read as "stop after this many optimizer steps" when it is a positive int.
TRAINING_END_FIELDS = ("max_steps", "num_train_epochs", "stop_after_n_steps")
# Fields that say where or how a run is launched, not what it trains: left out of config comparisons.
NOT_COMPARED = (
    "output_dir",
    "resume_from_checkpoint",
    "overwrite_output_dir",
    "accept_changed_inputs",
    "config_file",
    "lr_schedule",
    "inputs",
    "batch_geometry",
    "resumed_with_changes",
)  # lr_schedule: derived from the compared fields and the data; inputs and batch: llm2vec.run_inputs
# Files of a final model that an interrupted final save may leave without a marker (removed on overwrite).
MODEL_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "adapter_config.json",
    "llm2vec_config.json",
    RUN_CONFIG_NAME,
    TRAINER_STATE_NAME,
)
# What a checkpoint holds beyond the model: not part of a final model built from a checkpoint.
TRAINING_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth", "checkpoint_files.json")
# Written last into every checkpoint (before it is renamed into place): each file's path and size.
CHECKPOINT_MANIFEST = "checkpoint_files.json"
# Names a saved model may have at the top of output_dir besides MODEL_FILE_PATTERNS (LLM2Vec.save, the card).
OWN_FILE_PATTERNS = (
    *MODEL_FILE_PATTERNS,
    COMPLETE_MARKER,
    "README.md",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


class CheckpointError(ConfigError):
    """A checkpoint or finished model that cannot be read back; the message names the file and what to do."""


# ---------------------------------------------------------------------------------------------- the folder


@dataclass
class Checkpoint:
    path: Path
    step: int
    problem: str | None = None  # why it cannot be resumed from; None: complete


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file ``path`` is damaged (its header unreadable, or its size not the one its header
    implies: a truncated file), else ``None``. Reads only the header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                return f"{path.name} is truncated ({size} bytes)"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return f"{path.name} has an unreadable header"
    if 8 + n + end != size:
        return f"{path.name} is {size} bytes but its header says {8 + n + end}"
    return None


def _torch_file_problem(path: Path) -> str | None:
    """A ``torch.save`` file is a zip archive; a truncated one has no readable central directory."""
    import zipfile

    return None if zipfile.is_zipfile(path) else f"{path.name} is damaged or truncated (not a torch.save archive)"


def state_files_problem(names: set[str]) -> str | None:
    """What a resumable checkpoint lacks among ``names`` (its files, relative paths): the optimizer state, the
    scheduler and the RNG state, without which a resumed run would silently restart them."""
    if not any(n.startswith("optimizer") for n in names):
        return "no optimizer state (optimizer.pt): resuming would restart AdamW from zero"
    if "scheduler.pt" not in names:
        return "no scheduler.pt: resuming would restart the learning-rate schedule"
    if not any(re.fullmatch(r"rng_state(_\d+)?\.pth", n) for n in names):
        return "no rng_state.pth: resuming would not replay the data order and dropout exactly"
    return None


def _manifest_problem(folder: Path, manifest: dict) -> str | None:
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"unreadable {CHECKPOINT_MANIFEST}"
    problems = []
    for rel, size in sorted(files.items()):
        path = folder / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{rel} is {path.stat().st_size} bytes, {size} when saved")
    if problems:
        return "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else "")
    return state_files_problem(set(files))


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` cannot be resumed from, or ``None`` when it can.

    A checkpoint saved by this version holds :data:`CHECKPOINT_MANIFEST`, every file's size at save time:
    each file must be there with that size. Every checkpoint must hold a readable ``trainer_state.json``,
    complete weights (each safetensors file as long as its header says), the optimizer, scheduler and RNG
    state (:func:`state_files_problem`), and readable ``torch.save`` archives (the zip directory, not the
    pickles: a file damaged inside is reported when it is loaded, :meth:`LLM2VecTrainer._load_guarded`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "not a folder"
    manifest_path = folder / CHECKPOINT_MANIFEST
    if manifest_path.exists():
        manifest = _read_json(manifest_path)
        problem = _manifest_problem(folder, manifest) if manifest else f"unreadable {CHECKPOINT_MANIFEST}"
        if problem:
            return problem
    if not (folder / TRAINER_STATE_NAME).is_file():
        return f"no {TRAINER_STATE_NAME}"
    if _read_json(folder / TRAINER_STATE_NAME) is None:
        return f"unreadable {TRAINER_STATE_NAME} (truncated or not JSON)"
    weights = [folder / "adapter_model.safetensors", folder / "model.safetensors"]
    if not any(p.is_file() for p in weights) and not any(folder.glob("pytorch_model_fsdp_*")):
        index = folder / "model.safetensors.index.json"
        if not index.is_file():
            return "no model.safetensors or adapter_model.safetensors"
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"unreadable {index.name}"
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            return f"missing {', '.join(missing[:3])}"
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem:
            return problem
    if not manifest_path.exists():
        problem = state_files_problem({str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()})
        if problem:
            return problem
    for path in sorted([*folder.glob("*.pt"), *folder.glob("*.pth")]):
        problem = _torch_file_problem(path)
        if problem:
            return problem
    return None


def write_checkpoint_manifest(folder: str | os.PathLike, step: int) -> None:
    """Record every file of the checkpoint ``folder`` (relative path and size), written last."""
    folder = Path(folder)
    files = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != CHECKPOINT_MANIFEST
    }
    with atomic_write(folder / CHECKPOINT_MANIFEST) as f:
        json.dump({"global_step": step, "files": files}, f, indent=2)


def marker_problem(folder: Path, marker: dict[str, Any]) -> str | None:
    """Why the finished model in ``folder`` does not match its completion marker (a file missing or of another
    size than when the run finished), else ``None``."""
    files = marker.get("files")
    if not isinstance(files, dict):
        return f"{COMPLETE_MARKER} lists no files"
    problems = []
    for name, size in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} is {path.stat().st_size} bytes, {size} when finished")
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem and path.name in files:
            problems.append(problem)
    return "; ".join(dict.fromkeys(problems[:3])) or None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def saved_run_config(checkpoint: str | os.PathLike | None) -> dict[str, Any] | None:
    """The ``run_config.json`` saved in ``checkpoint`` (``None``: no checkpoint, or none readable there)."""
    return _read_json(Path(checkpoint) / RUN_CONFIG_NAME) if checkpoint else None


def step_of(checkpoint: str | os.PathLike) -> int:
    """The optimizer step a checkpoint was saved at (its trainer state, else its folder name)."""
    return _step_of(checkpoint)


def _step_of(checkpoint: str | os.PathLike) -> int:
    state = _read_json(Path(checkpoint) / TRAINER_STATE_NAME) or {}
    if isinstance(state.get("global_step"), int):
        return state["global_step"]
    match = CHECKPOINT_NAME.match(Path(checkpoint).name)
    return int(match.group(1)) if match else 0


@dataclass
class RunFolder:
    """What an ``output_dir`` holds: the completion marker, checkpoints, files of a final model."""

    path: Path
    marker: dict[str, Any] | None
    checkpoints: list[Checkpoint]  # by step
    model_files: list[Path]  # final-model files at the top level
    damaged: str | None = None  # the finished model does not match its marker (marker_problem)

    @classmethod
    def inspect(cls, path: str | os.PathLike) -> RunFolder:
        path = Path(path)
        if not path.is_dir():
            return cls(path, None, [], [])
        marker = _read_json(path / COMPLETE_MARKER)
        if marker is None and (path / COMPLETE_MARKER).exists():
            logger.warning("%s: unreadable completion marker; the run is treated as unfinished", path / COMPLETE_MARKER)
        damaged = marker_problem(path, marker) if marker is not None else None
        if damaged:
            logger.warning(
                "%s: the finished model does not match its completion marker (%s); the run is treated as unfinished",
                path,
                damaged,
            )
        found = []
        for child in path.iterdir():
            match = CHECKPOINT_NAME.match(child.name)
            if match and child.is_dir():
                found.append(Checkpoint(child, int(match.group(1)), checkpoint_problem(child)))
        model_files = sorted({p for pattern in MODEL_FILE_PATTERNS for p in path.glob(pattern) if p.is_file()})
        return cls(path, marker, sorted(found, key=lambda c: c.step), model_files, damaged)

    @property
    def finished(self) -> bool:
        return self.marker is not None and self.damaged is None

    def foreign_files(self) -> list[str]:
        """Entries at the top of the folder that no run of this package writes there (hidden ones aside): all
        of them in a folder that holds no run; otherwise those that are neither a checkpoint nor a file of a
        saved model (:data:`OWN_FILE_PATTERNS`, the files of its checkpoints, the files its marker lists)."""
        if not self.path.is_dir():
            return []
        entries = [p for p in self.path.iterdir() if not p.name.startswith(".")]
        if not self.holds_run:
            return sorted(p.name for p in entries)
        own = set((self.marker or {}).get("files", {}) or {})
        for c in self.checkpoints:
            manifest = _read_json(c.path / CHECKPOINT_MANIFEST) or {}
            own |= {name for name in manifest.get("files", {}) if "/" not in name}
        foreign = []
        for p in entries:
            if CHECKPOINT_NAME.match(p.name) or p.name in own:
                continue
            if p.is_file() and any(p.match(pattern) for pattern in OWN_FILE_PATTERNS):
                continue
            foreign.append(p.name)
        return sorted(foreign)

    @property
    def complete(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints if c.problem is None]

    @property
    def newest(self) -> Checkpoint | None:
        """The newest complete checkpoint."""
        return self.complete[-1] if self.complete else None

    @property
    def holds_run(self) -> bool:
        return self.marker is not None or bool(self.checkpoints) or bool(self.model_files)

    def saved_config(self) -> dict[str, Any] | None:
        """The run config saved with the final model, else with the newest complete checkpoint."""
        places = [self.path] if self.finished else []
        places += [c.path for c in reversed(self.complete)] + [self.path]
        for place in places:
            config = _read_json(place / RUN_CONFIG_NAME)
            if config is not None:
                return config
        return None

    def describe(self) -> str:
        config = self.saved_config() or {}
        stage = f"Stage {config['stage']} " if config.get("stage") else ""
        listed = ", ".join(
            c.path.name + (f" (incomplete: {c.problem})" if c.problem else "") for c in self.checkpoints[-4:]
        )
        if len(self.checkpoints) > 4:
            listed = f"{len(self.checkpoints) - 4} older and " + listed
        if self.finished:
            text = (
                f"a finished {stage}run (step {self.marker.get('global_step', '?')}, final model and {COMPLETE_MARKER})"
            )
            return text + (f" and checkpoints {listed}" if listed else "")
        if self.checkpoints:
            newest = f"newest complete: step {self.newest.step}" if self.newest else "none of them complete"
            final = (
                f"a final model that does not match its {COMPLETE_MARKER} ({self.damaged})"
                if self.damaged
                else "no finished model"
            )
            return f"an unfinished {stage}run: checkpoints {listed} ({newest}), {final}"
        names = ", ".join(p.name for p in self.model_files[:4])
        if self.damaged:
            return f"the files of a {stage}model ({names}) that do not match its {COMPLETE_MARKER} ({self.damaged})"
        return f"the files of a {stage}model ({names}) without the completion marker {COMPLETE_MARKER}"


def config_differences(saved: dict[str, Any], new: dict[str, Any], limit: int = 8) -> list[str]:
    """``field old -> new`` for each compared field whose value differs (at most ``limit``, then a count)."""
    keys = sorted((set(saved) | set(new)) - set(NOT_COMPARED))
    diffs = [f"{k} {json.dumps(saved.get(k))} -> {json.dumps(new.get(k))}" for k in keys if saved.get(k) != new.get(k)]
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"{len(diffs) - limit} more"]
    return diffs


# ---------------------------------------------------------------------------------------------- where training ends


def _defaults(stage: str) -> dict[str, Any]:
    out = {}
    for cls in argument_classes(stage):
        for f in fields(cls):
            if f.default is not MISSING:
                out[f.name] = f.default
            elif f.default_factory is not MISSING:
                out[f.name] = f.default_factory()
    return out


def training_end_fields(stage: str) -> tuple[str, ...]:
    """The fields that decide where training ends: :data:`TRAINING_END_FIELDS` and every field of the stage's
    argument classes whose metadata says ``ends_training``; only those that exist in this version."""
    defaults = _defaults(stage)
    tagged = [f.name for cls in argument_classes(stage) for f in fields(cls) if f.metadata.get("ends_training")]
    return tuple(name for name in dict.fromkeys([*TRAINING_END_FIELDS, *tagged]) if name in defaults)


def end_values(config: dict[str, Any], stage: str) -> dict[str, Any]:
    """The training-length fields of a resolved config; a field it lacks (saved by an older version) has its default."""
    defaults = _defaults(stage)
    return {name: config.get(name, defaults[name]) for name in training_end_fields(stage)}


def steps_per_epoch(config: RunConfig, num_examples: int) -> int:
    """Optimizer steps in one pass over ``num_examples`` (as the Trainer counts them)."""
    args = config.training
    batches = math.ceil(num_examples / (args.per_device_train_batch_size * args.world_size))
    return max(1, math.ceil(batches / args.gradient_accumulation_steps))


def planned_end_step(values: dict[str, Any], per_epoch: int) -> int:
    """The optimizer step at which training ends: ``max_steps`` if positive, else ``num_train_epochs`` passes;
    capped by any other training-length field holding a positive step count."""
    max_steps = values.get("max_steps", -1)
    end = max_steps if max_steps and max_steps > 0 else math.ceil(values["num_train_epochs"] * per_epoch)
    for name, value in values.items():
        if (
            name not in ("max_steps", "num_train_epochs")
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value > 0
        ):
            end = min(end, value)
    return end


# ---------------------------------------------------------------------------------------------- the plan


@dataclass
class RunPlan:
    """What a run will do with its ``output_dir`` (decided by :func:`plan_run`, settled by :func:`prepare`)."""

    folder: RunFolder
    resume_from: str | None = None
    finished_message: str | None = None  # set when there is nothing to do
    continue_past: int | None = None  # continuing a finished run: the step it ended at
    clear: bool = False  # --overwrite_output_dir: delete the old run (after the start-up checks)
    keep_up_to: int | None = None  # ... but keep the checkpoints up to this step (the one resumed from)
    finalize_only: bool = False  # the resumed checkpoint is at the end: write the final model from it

    @property
    def finished(self) -> bool:
        return self.finished_message is not None


def _resume_setting(value) -> str | bool | None:
    if value in (None, False, "false", "False", ""):
        return None
    if value in (True, "true", "True"):
        return True
    return str(value)


def _how_to_proceed(flags: str) -> str:
    return f"{flags}, or choose another --output_dir"


def plan_run(config: RunConfig) -> RunPlan:
    """Decide, without writing anything, what this run does with its ``output_dir``; raises :class:`ConfigError`
    when it would replace a run the user did not ask to replace. Every process decides the same."""
    args, stage = config.training, config.stage.stage
    folder = RunFolder.inspect(args.output_dir)
    resume, overwrite = _resume_setting(args.resume_from_checkpoint), config.stage.overwrite_output_dir
    new = config.resolved()
    saved = folder.saved_config()
    diffs = config_differences(saved, new) if saved else []
    differs = (
        f"its {RUN_CONFIG_NAME} differs from this config in: {'; '.join(diffs)}"
        if diffs
        else f"its {RUN_CONFIG_NAME} equals this config"
        if saved
        else f"it has no {RUN_CONFIG_NAME}"
    )
    where = f"output_dir {args.output_dir}"
    plan = RunPlan(folder)
    foreign = folder.foreign_files()
    if foreign and not overwrite:
        listed = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
        raise ConfigError(
            f"{where} holds files this run did not write ({listed}); a run would write over them. Move them "
            "away, choose another --output_dir, or pass --overwrite_output_dir true to write into it anyway"
        )
    if foreign:
        logger.warning("overwrite_output_dir: writing into %s, which holds other files: %s", where, ", ".join(foreign))

    if resume is None:
        if folder.holds_run and not overwrite:
            raise ConfigError(
                f"{where} already holds {folder.describe()}; {differs}. To continue it pass "
                f"--resume_from_checkpoint true; to replace it pass --overwrite_output_dir true; or "
                "choose another --output_dir."
            )
        plan.clear = folder.holds_run
        return _settled(plan)

    saved_stage = (saved or {}).get("stage", stage)
    if saved_stage != stage:
        raise ConfigError(
            f"{where} holds {folder.describe()}, but this is a Stage {stage} config: it cannot continue "
            "it; choose another --output_dir"
        )
    if resume is True:
        if overwrite:
            raise ConfigError(
                f"{where}: --resume_from_checkpoint true continues the run there and "
                "--overwrite_output_dir true replaces it; pass only one of them"
            )
        for c in folder.checkpoints:
            if c.problem:
                logger.warning("%s is incomplete (%s): skipped", c.path, c.problem)
        if folder.finished:
            step = folder.marker.get("global_step")
            saved_end, new_end = end_values(saved or {}, stage), end_values(new, stage)
            if saved_end == new_end:
                note = f" ({differs}; none of these fields changes where training ends)" if diffs else ""
                plan.finished_message = (
                    f"{where} holds a finished Stage {stage} run (step {step}, finished "
                    f"{folder.marker.get('finished', '?')}) with the same training length "
                    f"({', '.join(f'{k} {v}' for k, v in new_end.items())}){note}: nothing to do. To train it "
                    "again pass --overwrite_output_dir true, or choose another --output_dir."
                )
                return plan
            if folder.newest is None:
                raise ConfigError(
                    f"{where} holds a finished Stage {stage} run (step {step}) but no complete "
                    "checkpoint to continue from; "
                    + _how_to_proceed("pass --overwrite_output_dir true to train it anew")
                )
            plan.continue_past = step if isinstance(step, int) else None
        elif folder.newest is None:
            raise ConfigError(
                f"resume_from_checkpoint is true but {args.output_dir} holds no complete checkpoint-* "
                "folder"
                + (f" ({folder.describe()})" if folder.holds_run else "")
                + "; start without --resume_from_checkpoint"
                + (" and with --overwrite_output_dir true" if folder.holds_run else "")
            )
        plan.resume_from = str(folder.newest.path)
        ckpt_config = _read_json(folder.newest.path / RUN_CONFIG_NAME)
        ckpt_diffs = config_differences(ckpt_config, new) if ckpt_config else []
        if ckpt_diffs:
            logger.warning(
                "resuming from %s, whose %s differs from this config in: %s",
                folder.newest.path,
                RUN_CONFIG_NAME,
                "; ".join(ckpt_diffs),
            )
        return _settled(plan)

    # an explicit checkpoint folder
    problem = checkpoint_problem(resume)
    if problem:
        raise ConfigError(
            f"resume_from_checkpoint {resume}: {problem}; this checkpoint is incomplete"
            + (
                f". The newest complete one in its folder: {newest}"
                if (newest := RunFolder.inspect(Path(resume).parent).newest)
                else ""
            )
        )
    plan.resume_from = resume
    inside = Path(resume).resolve().parent == Path(args.output_dir).resolve()
    step = _step_of(resume)
    later = [c for c in folder.checkpoints if not inside or c.step > step]
    if folder.finished or later or (not inside and folder.model_files):
        if not overwrite:
            what = (
                folder.describe()
                if folder.finished or not inside
                else f"checkpoints beyond step {step} ({', '.join(c.path.name for c in later)})"
            )
            raise ConfigError(
                f"{where} holds {what}; resuming from {resume} would replace them. Pass "
                "--overwrite_output_dir true to do so, or choose another --output_dir."
            )
        plan.clear, plan.keep_up_to = True, step if inside else None
    return _settled(plan)


def _settled(plan: RunPlan) -> RunPlan:
    """Every process has inspected the folder before any process changes it."""
    from accelerate import PartialState

    PartialState().wait_for_everyone()
    return plan


# ---------------------------------------------------------------------------------------------- start-up checks


def check_writable(output_dir: str) -> None:
    """Create ``output_dir`` and a file in it, or raise :class:`ConfigError`."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=output_dir, prefix=".write-test.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"output_dir {output_dir}: cannot write there ({e.strerror or e}); choose a folder you can write to"
        ) from None


def check_model_family(path: str, template: str | None = None, adapter: str | None = None, source: str = ""):
    """The model's config and tokenizer can be read and its family has a prompt template (the explicit
    ``template``, else the one saved in the adapter's or the model's ``llm2vec_config.json``, else detected),
    before any weights load; raises :class:`ConfigError`. Returns the tokenizer and the template. The
    evaluation CLI can call this too."""
    from transformers import AutoConfig, AutoTokenizer

    from .llm2vec import read_llm2vec_config
    from .templates import resolve_template

    where = f"{source}: " if source else ""
    try:
        model_config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{where}model_name_or_path {path!r}: cannot read its config and tokenizer ({first}); "
            "give a model folder or a hub id that is available"
        ) from None
    if template is None:
        template = read_llm2vec_config(adapter).get("template") or read_llm2vec_config(path).get("template")
    try:
        spec = resolve_template(model_config, tokenizer, template)
    except ValueError as e:
        raise ConfigError(f"{where}model {path}: {e}") from None
    return tokenizer, spec


def startup_checks(config: RunConfig):
    """What can be checked before the data and the weights are loaded: the output folder, the model's family.
    Returns the model's tokenizer and template (for the data check, :func:`llm2vec.collator.check_examples`)."""
    check_writable(config.training.output_dir)
    return check_model_family(
        config.model.model_name_or_path,
        config.model.template,
        getattr(config.stage, "peft_model_name_or_path", None),
        config.source,
    )


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


@dataclass
class DiskEstimate:
    """Bytes a run will write: ``checkpoints`` kept at once of ``weights + optimizer`` each, and the final model."""

    weights: int
    optimizer: int
    checkpoints: int

    @property
    def total(self) -> int:
        return self.checkpoints * (self.weights + self.optimizer) + self.weights

    def describe(self) -> str:
        return (
            f"about {_size(self.total)}: {self.checkpoints} checkpoint(s) on disk at once of "
            f"{_size(self.weights + self.optimizer)} each (weights {_size(self.weights)} + optimizer state "
            f"{_size(self.optimizer)}) and the final model ({_size(self.weights)})"
        )


def estimate_disk(args, model, start_step: int, end_step: int, per_epoch: int) -> DiskEstimate:
    """The bytes this run writes: weights in their dtype (a LoRA model saves its adapter only), AdamW's two
    moments per trainable parameter (none with ``save_only_model``), the checkpoints saved between
    ``start_step`` and ``end_step`` of which at most ``save_total_limit + 1`` exist at once (a new one is
    complete before the oldest is deleted)."""
    params = {id(p): p for p in model.parameters()}.values()
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in params)
    weights = trainable if hasattr(getattr(model, "model", None), "peft_config") else total
    optimizer = 0 if args.save_only_model else 2 * trainable
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    if strategy == "no" or end_step <= start_step:
        saves = 0
    elif strategy == "epoch":
        saves = math.ceil(end_step / per_epoch) - start_step // per_epoch
    else:  # steps (and best): every save_steps, and at the end
        interval = args.save_steps if args.save_steps >= 1 else math.ceil(end_step * args.save_steps)
        interval = max(1, int(interval))
        saves = end_step // interval - start_step // interval + (1 if end_step % interval else 0)
    limit = args.save_total_limit
    kept = min(saves, limit + 1) if limit and limit > 0 else saves
    return DiskEstimate(weights, optimizer, kept)


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _bytes_under(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total


def check_disk_space(output_dir: str, estimate: DiskEstimate, freed: int = 0) -> None:
    free = shutil.disk_usage(_nearest_existing(Path(output_dir))).free + freed
    if free < estimate.total:
        raise ConfigError(
            f"output_dir {output_dir}: {_size(free)} free, but this run writes {estimate.describe()}. "
            "Free some space, choose another --output_dir, or save less: a smaller save_total_limit, "
            "a larger save_steps, or save_only_model true (checkpoints without optimizer state; "
            "they cannot be resumed exactly)"
        )


# ---------------------------------------------------------------------------------------------- before training


def _to_clear(plan: RunPlan) -> list[Path]:
    """What --overwrite_output_dir deletes: the marker, the final model's files, the checkpoints (beyond the one
    resumed from, when it lies in the same folder)."""
    folder = plan.folder
    paths = [folder.path / COMPLETE_MARKER] if folder.finished else []
    paths += [folder.path / name for name in (folder.marker or {}).get("files", {})]
    paths += folder.model_files
    paths += [c.path for c in folder.checkpoints if plan.keep_up_to is None or c.step > plan.keep_up_to]
    return [p for p in dict.fromkeys(paths) if p.exists()]


def _remove(path: Path) -> None:
    if path.is_dir():
        aside = path.with_name(f".{path.name}.deleting.tmp")
        os.replace(path, aside)  # gone under its own name at once, so never picked as a checkpoint
        shutil.rmtree(aside, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_staging(output_dir: str | os.PathLike) -> None:
    """Delete the staging and deletion folders a killed run left behind (``.checkpoint-*.tmp``)."""
    for stale in Path(output_dir).glob(".checkpoint-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def prepare(plan: RunPlan, config: RunConfig, model, num_examples: int) -> RunPlan:
    """The checks that need the data and the model, then (main process) the changes to ``output_dir``.

    Where training ends (:func:`planned_end_step`): a continued finished run must end later than it did; a
    resumed checkpoint past the end is refused, one at the end is turned into the final model without training.
    Free disk space for the checkpoints and final model (:func:`estimate_disk`). Only then does
    ``--overwrite_output_dir`` delete the old run (marker first) and the stale staging folders go.
    """
    args, stage = config.training, config.stage.stage
    per_epoch = steps_per_epoch(config, num_examples)
    values = end_values(config.resolved(), stage)
    end = planned_end_step(values, per_epoch)
    ends_at = ", ".join(f"{k} {v}" for k, v in values.items())
    start = _step_of(plan.resume_from) if plan.resume_from else 0
    if plan.continue_past is not None and end <= plan.continue_past:
        raise ConfigError(
            f"output_dir {args.output_dir} holds a finished Stage {stage} run that ended at step "
            f"{plan.continue_past}; this config ends at step {end} ({ends_at}), so there is nothing "
            "to continue. " + _how_to_proceed("Pass --overwrite_output_dir true to train it anew")
        )
    if plan.resume_from is not None:
        if start > end:
            raise ConfigError(
                f"resume_from_checkpoint {plan.resume_from}: step {start} is past the end of this config "
                f"(step {end}: {ends_at}); resume with the config it was trained with, or start anew"
            )
        plan.finalize_only = start == end
    clear = _to_clear(plan) if plan.clear else []
    check_disk_space(args.output_dir, estimate_disk(args, model, start, end, per_epoch), freed=_bytes_under(clear))
    if args.should_save:
        if clear:
            logger.warning(
                "overwrite_output_dir: removing the previous run's %s from %s",
                ", ".join(p.name for p in clear),
                args.output_dir,
            )
        for path in clear:
            _remove(path)
        remove_stale_staging(args.output_dir)
    from accelerate import PartialState

    PartialState().wait_for_everyone()
    return plan


# ---------------------------------------------------------------------------------------------- saving


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(staged: Path, target: Path) -> None:
    """Rename the finished folder ``staged`` to ``target`` (replacing an older one of the same name)."""
    for f in staged.rglob("*"):
        _fsync(f)
    _fsync(staged)
    if target.exists():
        _remove(target)
    os.replace(staged, target)
    _fsync(target.parent)


def _rotate(run_dir: Path, limit: int | None) -> None:
    """Keep the newest ``limit`` complete checkpoints (transformers' ``save_total_limit``)."""
    if not limit or limit <= 0:
        return
    complete = RunFolder.inspect(run_dir).complete
    for old in complete[:-limit]:
        logger.info("save_total_limit %d: deleting %s", limit, old.path)
        _remove(old.path)


@contextlib.contextmanager
def staged_checkpoint(trainer, run_dir: str):
    """Yield the folder the Trainer should write ``checkpoint-<step>`` into; publish it when all processes are done.

    Every process writes its part (rank-specific RNG states, FSDP shards) under the same staging folder; after
    a barrier the saving process fsyncs and renames it, then applies ``save_total_limit``.
    """
    run_dir = Path(run_dir)
    name = f"checkpoint-{trainer.state.global_step}"
    staging = run_dir / f".{name}.staging.tmp"
    saver = trainer.args.should_save
    if saver:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    try:
        yield str(staging)
    except BaseException:
        if saver:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    trainer.accelerator.wait_for_everyone()
    if saver:
        write_checkpoint_manifest(staging / name, trainer.state.global_step)
        _publish(staging / name, run_dir / name)
        shutil.rmtree(staging, ignore_errors=True)
        _rotate(run_dir, trainer.args.save_total_limit)
    trainer.accelerator.wait_for_everyone()


def _write_marker(output_dir: Path, run_config: dict[str, Any], global_step: int) -> None:
    files = sorted(p for p in output_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    for p in files:
        _fsync(p)
    stage = run_config.get("stage", "I")
    marker = {
        "stage": stage,
        "global_step": global_step,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "training_end": end_values(run_config, stage) if run_config else {},
        "files": {p.name: p.stat().st_size for p in files if p.name != COMPLETE_MARKER},
    }
    with atomic_write(output_dir / COMPLETE_MARKER) as f:
        f.write(json.dumps(marker, indent=2) + "\n")
    _fsync(output_dir)


def save_final(trainer) -> None:
    """The final model, ``trainer_state.json``, then (last) the completion marker."""
    out = Path(trainer.args.output_dir)
    trainer.check_weights_finite("the final model was not written")
    if trainer.args.should_save:
        (out / COMPLETE_MARKER).unlink(missing_ok=True)  # from here on the folder is not a finished run
    trainer.save_model(str(out))
    trainer.save_state()  # trainer_state.json (the log history) beside the final model
    trainer.accelerator.wait_for_everyone()
    if trainer.args.should_save:
        _write_marker(out, trainer.run_config, trainer.state.global_step)
    trainer.accelerator.wait_for_everyone()


def finalize_from_checkpoint(trainer, checkpoint: str) -> None:
    """The final model of a run whose last checkpoint is complete but whose final save was interrupted:
    the checkpoint's model files (no optimizer, scheduler or RNG state), this run's config, then the marker."""
    from transformers import TrainerState

    out, ckpt = Path(trainer.args.output_dir), Path(checkpoint)
    trainer.state = TrainerState.load_from_json(str(ckpt / TRAINER_STATE_NAME))
    logger.info(
        "%s is at the last step (%d): writing the final model from it, no training needed",
        ckpt,
        trainer.state.global_step,
    )
    if trainer.args.should_save:
        (out / COMPLETE_MARKER).unlink(missing_ok=True)
        skip = {p.name for pattern in TRAINING_STATE_FILES for p in ckpt.glob(pattern)}
        for src in ckpt.iterdir():
            if src.is_file() and src.name not in skip:
                shutil.copyfile(src, out / src.name)
        with atomic_write(out / RUN_CONFIG_NAME) as f:
            json.dump(trainer.run_config, f, indent=2)
        _write_marker(out, trainer.run_config, trainer.state.global_step)
    trainer.accelerator.wait_for_everyone()


def train_and_save(trainer, plan: RunPlan) -> None:
    """Train as planned (fresh, or resumed from ``plan.resume_from``) and write the final model, marker last."""
    if plan.finalize_only:
        finalize_from_checkpoint(trainer, plan.resume_from)
        return
    trainer.train(resume_from_checkpoint=plan.resume_from)
    save_final(trainer)
