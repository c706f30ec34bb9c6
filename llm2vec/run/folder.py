"""What a run's ``output_dir`` holds, read without changing anything: the final model and its completion marker,
the checkpoints and whether each is complete, the saved run config.

A finished run's ``output_dir`` holds the final model (what :meth:`llm2vec.LLM2Vec.save` writes),
``run_config.json``, ``trainer_state.json``, the ``checkpoint-<step>`` folders the config asked for, and,
written last, the completion marker :data:`COMPLETE_MARKER` (the files the final save wrote, with their sizes,
the step, and the training-length fields :func:`llm2vec.run.config_fields.end_values`). A checkpoint written by this version holds
:data:`CHECKPOINT_MANIFEST` (each file's size and SHA-256). :class:`RunFolder` reads all of that: which
checkpoints are complete (:func:`checkpoint_problem`) and hold what they held when saved
(:func:`content_problem`), whether the final model matches its marker (:func:`marker_problem`), which files
the run wrote (:meth:`RunFolder.own_names`) and which it did not (:meth:`RunFolder.foreign_files`).

**A run owns only what it recorded.** The top-level files of a run are the ones its completion marker lists
(or, while the final save moves them into place, its record :data:`FINAL_SAVE_RECORD`); a ``checkpoint-<step>``
folder is the run's when it holds a manifest or a ``trainer_state.json``. Everything else in the folder is the
user's: never listed as the run's, never deleted, never written over (:func:`llm2vec.run.plan.plan_run`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..arguments import ConfigError

logger = logging.getLogger("llm2vec")

COMPLETE_MARKER = "training_complete.json"  # written last by the final save: its presence marks a finished run
RUN_CONFIG_NAME = "run_config.json"
TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")

# The names of a final model's files (what a final save may write at the top of output_dir).
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
# Written last into every checkpoint (before it is renamed into place): each file's path, size and SHA-256.
CHECKPOINT_MANIFEST = "checkpoint_files.json"
# While the final save moves its files into output_dir: their names (the run's own until the marker lists them).
FINAL_SAVE_RECORD = ".llm2vec-final-save.json"
# The completion marker's format: 2 lists only the files the final save wrote; 1 (older versions) listed every
# visible file of the folder, of which only those with a saved model's names (OWN_FILE_PATTERNS) are trusted.
MARKER_FORMAT = 2
# The names a final save may write at the top of output_dir (LLM2Vec.save, the card, the run's records): a
# user's file of such a name would be written over, so a run refuses to start beside one.
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


def _size_problems(folder: Path, files: dict[str, int], when: str) -> list[str]:
    """``name is missing`` or ``name is N bytes, M when <when>`` for each listed file not as it was recorded."""
    problems = []
    for name, size in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} is {path.stat().st_size} bytes, {size} when {when}")
    return problems


def _manifest_problem(folder: Path, manifest: dict) -> str | None:
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"unreadable {CHECKPOINT_MANIFEST}"
    problems = _size_problems(folder, files, "saved")
    if problems:
        return "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else "")
    return state_files_problem(set(files))


def _state_problem(folder: Path, state: dict[str, Any], manifest: dict[str, Any] | None) -> str | None:
    """Where the steps a checkpoint records disagree: its folder name ``checkpoint-<step>``, the ``global_step``
    of its ``trainer_state.json`` and of its manifest (a renamed or mixed-up checkpoint)."""
    recorded = state.get("global_step")
    if not isinstance(recorded, int) or isinstance(recorded, bool):
        return f"{TRAINER_STATE_NAME} records no global_step"
    match = CHECKPOINT_NAME.match(folder.name)
    if match and int(match.group(1)) != recorded:
        return f"its {TRAINER_STATE_NAME} says step {recorded} but the folder is named {folder.name}"
    if manifest is not None and manifest.get("global_step", recorded) != recorded:
        return (
            f"its {CHECKPOINT_MANIFEST} says step {manifest.get('global_step')} but its {TRAINER_STATE_NAME} {recorded}"
        )
    return None


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` cannot be resumed from, or ``None`` when it can.

    A checkpoint saved by this version holds :data:`CHECKPOINT_MANIFEST`, every file's size at save time:
    each file must be there with that size. Every checkpoint must hold a readable ``trainer_state.json`` whose
    step is the one of its folder name and manifest (:func:`_state_problem`), complete weights (each
    safetensors file as long as its header says), the optimizer, scheduler and RNG state
    (:func:`state_files_problem`), and readable ``torch.save`` archives (the zip directory, not the pickles: a
    file damaged inside is reported when it is loaded, :meth:`llm2vec.trainer.LLM2VecTrainer._load_guarded`).
    Contents are compared with the recorded SHA-256 only for the checkpoint a run resumes from
    (:func:`content_problem`: it reads every byte)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "not a folder"
    manifest_path = folder / CHECKPOINT_MANIFEST
    manifest = None
    if manifest_path.exists():
        manifest = read_json(manifest_path)
        problem = _manifest_problem(folder, manifest) if manifest else f"unreadable {CHECKPOINT_MANIFEST}"
        if problem:
            return problem
    if not (folder / TRAINER_STATE_NAME).is_file():
        return f"no {TRAINER_STATE_NAME}"
    state = read_json(folder / TRAINER_STATE_NAME)
    if state is None:
        return f"unreadable {TRAINER_STATE_NAME} (truncated or not JSON)"
    problem = _state_problem(folder, state, manifest)
    if problem:
        return problem
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


HASH_CHUNK = 8 << 20


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's contents, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def content_problem(folder: str | os.PathLike) -> str | None:
    """Which file of the checkpoint ``folder`` no longer holds what it held when saved (its SHA-256 differs from
    the one :data:`CHECKPOINT_MANIFEST` recorded), else ``None``. A checkpoint saved without hashes (older
    versions) has nothing to compare and passes. Reads every byte of the checkpoint (docs/benchmarks.md: the
    cost)."""
    folder = Path(folder)
    manifest = read_json(folder / CHECKPOINT_MANIFEST) or {}
    hashes = manifest.get("sha256")
    if not isinstance(hashes, dict):
        return None
    for name, recorded in sorted(hashes.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_file(path) != recorded:
            return f"{name} has other contents than when it was saved (its SHA-256 differs from {CHECKPOINT_MANIFEST})"
    return None


def marker_problem(folder: Path, marker: dict[str, Any]) -> str | None:
    """Why the finished model in ``folder`` does not match its completion marker (a file missing or of another
    size than when the run finished), else ``None``."""
    files = marker.get("files")
    if not isinstance(files, dict):
        return f"{COMPLETE_MARKER} lists no files"
    problems = _size_problems(folder, files, "finished")
    for path in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem and path.name in files:
            problems.append(problem)
    return "; ".join(dict.fromkeys(problems[:3])) or None


def listed(names: list[str], limit: int = 6) -> str:
    """``a, b, c and N more``: the first ``limit`` of ``names`` for a one-line message."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def saved_run_config(checkpoint: str | os.PathLike | None) -> dict[str, Any] | None:
    """The ``run_config.json`` saved in ``checkpoint`` (``None``: no checkpoint, or none readable there)."""
    return read_json(Path(checkpoint) / RUN_CONFIG_NAME) if checkpoint else None


def step_of(checkpoint: str | os.PathLike) -> int:
    """The optimizer step a checkpoint was saved at (its trainer state, else its folder name)."""
    state = read_json(Path(checkpoint) / TRAINER_STATE_NAME) or {}
    if isinstance(state.get("global_step"), int):
        return state["global_step"]
    match = CHECKPOINT_NAME.match(Path(checkpoint).name)
    return int(match.group(1)) if match else 0


def own_names(marker: dict[str, Any] | None, record: dict[str, Any] | None = None) -> set[str]:
    """The top-level files a run wrote, as its completion ``marker`` and its final-save ``record`` list them. A
    marker of format 1 (older versions listed every visible file) is trusted only for a saved model's names."""
    names: set[str] = set()
    for source in (marker, record):
        files = (source or {}).get("files")
        if not isinstance(files, dict | list):
            continue
        listed = {str(n) for n in files if "/" not in str(n) and str(n) not in ("", ".", "..")}
        if source is marker and (marker or {}).get("format", 1) < MARKER_FORMAT:
            listed = {n for n in listed if any(Path(n).match(pattern) for pattern in OWN_FILE_PATTERNS)}
        names |= listed
    return names


def is_own_checkpoint(path: Path) -> bool:
    """A ``checkpoint-<step>`` folder a Trainer wrote: it holds this package's manifest or a ``trainer_state.json``."""
    return (
        bool(CHECKPOINT_NAME.match(path.name))
        and path.is_dir()
        and ((path / CHECKPOINT_MANIFEST).is_file() or (path / TRAINER_STATE_NAME).is_file())
    )


@dataclass
class RunFolder:
    """What an ``output_dir`` holds: the completion marker, checkpoints, the files the run wrote at its top."""

    path: Path
    marker: dict[str, Any] | None
    checkpoints: list[Checkpoint]  # by step
    model_files: list[Path]  # the run's own top-level files (own_names) that exist, marker aside
    damaged: str | None = None  # the finished model does not match its marker (marker_problem)
    record: dict[str, Any] | None = None  # FINAL_SAVE_RECORD: a final save was moving these files into place

    @classmethod
    def inspect(cls, path: str | os.PathLike) -> RunFolder:
        path = Path(path)
        if not path.is_dir():
            return cls(path, None, [], [])
        marker = read_json(path / COMPLETE_MARKER)
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
            if is_own_checkpoint(child):
                step = int(CHECKPOINT_NAME.match(child.name).group(1))
                found.append(Checkpoint(child, step, checkpoint_problem(child)))
        record = read_json(path / FINAL_SAVE_RECORD)
        own = own_names(marker, record) - {COMPLETE_MARKER}
        model_files = sorted(p for p in (path / name for name in own) if p.is_file())
        return cls(path, marker, sorted(found, key=lambda c: c.step), model_files, damaged, record)

    @property
    def finished(self) -> bool:
        return self.marker is not None and self.damaged is None

    def own_names(self) -> set[str]:
        """The top-level names this folder's run wrote: the marker, the files it and the final-save record list,
        the record itself, the checkpoints."""
        names = own_names(self.marker, self.record) | {c.path.name for c in self.checkpoints}
        if self.marker is not None or (self.path / COMPLETE_MARKER).exists():
            names.add(COMPLETE_MARKER)
        return names

    def foreign_files(self) -> list[str]:
        """Entries at the top of the folder that its run did not write (hidden ones aside: a run never touches
        them): everything but the files the marker and the final-save record list and the run's checkpoints
        (:func:`is_own_checkpoint`)."""
        if not self.path.is_dir():
            return []
        own = self.own_names()
        return sorted(p.name for p in self.path.iterdir() if not p.name.startswith(".") and p.name not in own)

    @staticmethod
    def would_write_over(names: list[str]) -> list[str]:
        """Those of ``names`` (foreign entries) that a run would write over: a saved model's names, a checkpoint's."""
        return [
            n for n in names if CHECKPOINT_NAME.match(n) or any(Path(n).match(pattern) for pattern in OWN_FILE_PATTERNS)
        ]

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
        places += [c.path for c in reversed(self.complete)]
        places += [self.path] if RUN_CONFIG_NAME in own_names(self.marker, self.record) else []
        for place in places:
            config = read_json(place / RUN_CONFIG_NAME)
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


def newest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of ``output_dir`` (:class:`RunFolder`), or ``None``."""
    newest = RunFolder.inspect(output_dir).newest
    return newest.path if newest else None


def remove_path(path: Path) -> None:
    """Delete a file, or a folder (renamed away first, so that it is never picked as a checkpoint half-deleted)."""
    if path.is_dir():
        aside = path.with_name(f".{path.name}.deleting.tmp")
        os.replace(path, aside)  # gone under its own name at once, so never picked as a checkpoint
        shutil.rmtree(aside, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
