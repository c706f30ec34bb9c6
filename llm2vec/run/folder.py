"""What a run's ``output_dir`` holds, read without changing anything. A run owns only what it recorded (its
marker's files, :data:`FINAL_SAVE_RECORD`'s during the final save, its checkpoints); the rest is the user's."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..arguments import ConfigError
from ..io import COMPLETE_MARKER, FINAL_SAVE_RECORD, RUN_CONFIG_NAME, record_problem

logger = logging.getLogger("llm2vec")

TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_MANIFEST = "checkpoint_files.json"
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
# What a checkpoint holds beyond the model: not part of a final model built from a checkpoint.
TRAINING_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth", CHECKPOINT_MANIFEST)
RESUME_STATE = {"optimizer.pt": "optimizer*", "scheduler.pt": "scheduler.pt", "rng_state.pth": "rng_state*.pth"}
# The names a final save may write at the top of output_dir: a user's file of such a name would be written over.
OWN_FILE_PATTERNS = (
    *("*.safetensors", "*.safetensors.index.json", "adapter_config.json", "llm2vec_config.json", RUN_CONFIG_NAME),
    *(TRAINER_STATE_NAME, COMPLETE_MARKER, "README.md", "config.json", "generation_config.json", "tokenizer*"),
    *("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt"),
)


class CheckpointError(ConfigError):
    """A checkpoint or finished model that cannot be read back; the message names the file and what to do."""


Checkpoint = namedtuple("Checkpoint", "path step problem")  # problem: why it cannot be resumed from; None: complete


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def listed(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def checkpoint_problem(folder: str | os.PathLike, contents: bool = False) -> str | None:
    """Why ``folder`` cannot be resumed from (manifest, sizes or with ``contents`` hashes, training state, step)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "not a folder"
    if (manifest := read_json(folder / CHECKPOINT_MANIFEST)) is None:
        return f"no readable {CHECKPOINT_MANIFEST} (a checkpoint is complete once its manifest is written)"
    if problem := record_problem(folder, manifest, CHECKPOINT_MANIFEST, contents):
        return problem
    for name, pattern in RESUME_STATE.items():
        if not any(Path(n).match(pattern) for n in manifest["files"]):
            return f"no {name}"
    recorded = (read_json(folder / TRAINER_STATE_NAME) or {}).get("global_step")
    if not isinstance(recorded, int) or isinstance(recorded, bool):
        return f"{TRAINER_STATE_NAME} records no global_step"
    match = CHECKPOINT_NAME.match(folder.name)
    if match and int(match.group(1)) != recorded:  # the manifest hashes trainer_state.json: the name is what can differ
        return f"its {TRAINER_STATE_NAME} says step {recorded} but the folder is named {folder.name}"
    return None


def step_of(checkpoint: str | os.PathLike) -> int:
    step = (read_json(Path(checkpoint) / TRAINER_STATE_NAME) or {}).get("global_step")
    match = CHECKPOINT_NAME.match(Path(checkpoint).name)
    return step if isinstance(step, int) else int(match.group(1)) if match else 0


def own_names(marker: dict[str, Any] | None, record: dict[str, Any] | None = None) -> set[str]:
    """The top-level files a run wrote: its ``marker``'s with a hash, its final-save ``record``'s."""
    hashes, files = (marker or {}).get("sha256"), (record or {}).get("files")
    names = {str(n) for n in hashes} if isinstance(hashes, dict) else set()
    names |= {str(n) for n in files} if isinstance(files, list) else set()
    return {n for n in names if "/" not in n and n not in ("", ".", "..")}


def is_own_checkpoint(path: Path) -> bool:
    return bool(CHECKPOINT_NAME.match(path.name)) and any(
        (path / n).is_file() for n in (CHECKPOINT_MANIFEST, TRAINER_STATE_NAME)
    )


def checkpoints_of(path: Path, complete: bool = False) -> list[Checkpoint]:
    """The run's checkpoints in ``path`` by step; with ``complete``, only those a resume can read."""
    found = sorted((int(CHECKPOINT_NAME.match(c.name)[1]), c) for c in path.iterdir() if is_own_checkpoint(c))
    return [c for c in (Checkpoint(c, n, checkpoint_problem(c)) for n, c in found) if not (complete and c.problem)]


def newest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    return next((c.path for c in reversed(checkpoints_of(Path(output_dir), complete=True))), None)


def remove_path(path: Path) -> None:
    """Delete a file, or a folder (renamed away first: never read half-deleted)."""
    if path.is_dir() and not path.is_symlink():
        aside = path.with_name(f".{path.name}.deleting.tmp")
        os.replace(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@dataclass
class RunFolder:
    path: Path
    marker: dict[str, Any] | None
    checkpoints: list[Checkpoint]  # by step
    model_files: list[Path]  # the run's own top-level files (own_names) that exist, marker aside
    damaged: str | None = None  # the finished model does not match its marker
    record: dict[str, Any] | None = None  # FINAL_SAVE_RECORD: a final save was moving these files into place

    @classmethod
    def inspect(cls, path: str | os.PathLike) -> RunFolder:
        path = Path(path)
        if not path.is_dir():
            return cls(path, None, [], [])
        marker = read_json(path / COMPLETE_MARKER)
        damaged = record_problem(path, marker, COMPLETE_MARKER) if (path / COMPLETE_MARKER).exists() else None
        if damaged:
            logger.warning("%s: the finished model does not match its completion marker (%s)", path, damaged)
        record = read_json(path / FINAL_SAVE_RECORD)
        model_files = sorted(p for n in own_names(marker, record) - {COMPLETE_MARKER} if (p := path / n).is_file())
        return cls(path, marker, checkpoints_of(path), model_files, damaged, record)

    @property
    def finished(self) -> bool:
        return self.marker is not None and self.damaged is None

    @property
    def complete(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints if c.problem is None]

    @property
    def newest(self) -> Checkpoint | None:
        return self.complete[-1] if self.complete else None

    @property
    def holds_run(self) -> bool:
        return self.marker is not None or bool(self.checkpoints) or bool(self.model_files)

    def foreign_files(self) -> tuple[list[str], list[str]]:
        """The top-level files the run did not write, and those of them a save of the run would write over."""
        if not self.path.is_dir():
            return [], []
        own = own_names(self.marker, self.record) | {c.path.name for c in self.checkpoints} | {COMPLETE_MARKER}
        names = sorted(p.name for p in self.path.iterdir() if p.name[0] != "." and p.name not in own)
        return names, [n for n in names if CHECKPOINT_NAME.match(n) or any(Path(n).match(p) for p in OWN_FILE_PATTERNS)]

    def saved_config(self) -> dict[str, Any] | None:
        """The run config saved with the final model, else with the newest complete checkpoint."""
        places = ([self.path] if self.finished else []) + [c.path for c in reversed(self.complete)]
        places += [self.path] if RUN_CONFIG_NAME in own_names(self.marker, self.record) else []
        return next((c for c in (read_json(p / RUN_CONFIG_NAME) for p in places) if c is not None), None)

    def describe(self) -> str:
        stage = f"Stage {s} " if (s := (self.saved_config() or {}).get("stage")) else ""
        names = (f"{len(self.checkpoints) - 4} older and " if len(self.checkpoints) > 4 else "") + ", ".join(
            c.path.name + (f" (incomplete: {c.problem})" if c.problem else "") for c in self.checkpoints[-4:]
        )
        if self.finished:
            step, names = self.marker.get("global_step", "?"), names and f" and checkpoints {names}"
            return f"a finished {stage}run (step {step}, final model and {COMPLETE_MARKER}){names}"
        damaged = f"a final model not matching its {COMPLETE_MARKER} ({self.damaged})"
        final = damaged if self.damaged else "no final model"
        if self.checkpoints:
            newest = f"newest complete: step {self.newest.step}" if self.newest else "none complete"
            return f"an unfinished {stage}run: checkpoints {names} ({newest}), {final}"
        return f"the files of a {stage}model ({', '.join(p.name for p in self.model_files[:4])}), {final}"
