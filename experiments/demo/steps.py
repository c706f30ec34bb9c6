"""The step runner: each step of the demo builds one folder, atomically, and is reused when nothing changed.

A :class:`Step` builds into a temporary sibling folder (``.<name>.*.tmp``) that is renamed into place only
after its completion marker (:data:`MARKER`) was written there, last. A step is reused when its folder holds
a marker whose fingerprint matches what the step would do now (its ``key``: settings and the run ids of the
steps it reads); otherwise (no marker: an interrupted or hand-made folder; other settings; an upstream step
that was redone; or ``fresh``) it is redone. Temporary folders left by a hard kill are removed when their
step next runs. One demo at a time per output folder.

Commands run through :func:`run_command`, from the repository root, with this terminal (progress bars show);
the peak resident memory of each is recorded and reported per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llm2vec.io import atomic_dir, atomic_write, remove_stale_temporaries, short_hash

from .settings import REPO_ROOT, rel

MARKER = "demo_step.json"  # written last into a step's folder: its presence marks the step as complete


class DemoError(RuntimeError):
    """A step failed; the message says which command."""


def say(message: str = "") -> None:
    print(message, flush=True)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: ``build(tmp)`` fills a temporary folder that becomes ``output``.

    ``key`` holds everything the output depends on; a complete folder is reused only when its marker's
    fingerprint equals the fingerprint of ``key``. ``build`` may return extra fields for the marker.
    """

    name: str
    title: str
    output: Path
    key: dict[str, Any]
    build: Callable[[Path], dict[str, Any] | None]


@dataclasses.dataclass(frozen=True)
class Done:
    """A finished step: its folder and its marker, whose ``run_id`` names this build of the folder (the steps
    that read it put the run id in their keys, so that they are redone when it is)."""

    name: str
    folder: Path
    marker: dict[str, Any]

    @property
    def run_id(self) -> str:
        return self.marker["run_id"]


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The completion marker of a step folder, or None (no marker, or an unreadable one)."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) and "fingerprint" in marker else None


class StepRunner:
    """Runs steps (or reuses them; every step with ``fresh``) and logs the time and memory of each."""

    def __init__(self, fresh: bool = False):
        self.fresh = fresh
        self.log: list[dict[str, Any]] = []

    def run(self, step: Step) -> Done:
        """Reuse ``step.output`` if complete and current, else build it atomically."""
        fingerprint = short_hash(step.key)
        marker = read_marker(step.output)
        if marker is not None and marker["fingerprint"] == fingerprint and not self.fresh:
            say(f"[{step.name}] reusing {rel(step.output)} (completed {marker.get('finished', '?')})")
            self.record(step.name, reused=True)
            return Done(step.name, step.output, marker)
        if step.output.exists():
            if self.fresh:
                why = "--fresh"
            elif marker is None:
                why = f"it has no completion marker ({MARKER}): an interrupted or foreign folder"
            else:
                why = "it was made with other settings or from other inputs"
            say(f"[{step.name}] redoing {rel(step.output)}: {why}")
        say(f"[{step.name}] {step.title}\n[{step.name}] output -> {rel(step.output)}")
        remove_stale_temporaries(step.output)
        start = time.perf_counter()
        with peak_rss_of_children() as peak, atomic_dir(step.output, replace=True) as tmp:
            info = step.build(tmp) or {}
            seconds = time.perf_counter() - start
            marker = {
                "step": step.name,
                "fingerprint": fingerprint,
                "run_id": uuid.uuid4().hex,
                "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                "seconds": round(seconds, 1),
                "key": step.key,
                **info,
            }
            with atomic_write(tmp / MARKER) as f:
                f.write(json.dumps(marker, indent=2, default=str) + "\n")
        say(f"[{step.name}] done in {duration(seconds)} -> {rel(step.output)}")
        self.record(step.name, reused=False, seconds=seconds, peak_rss_mib=peak["mib"])
        return Done(step.name, step.output, marker)

    def record(self, name: str, reused: bool, seconds: float = 0.0, peak_rss_mib: float | None = None) -> None:
        """Log a step; :meth:`run` does it, a step that keeps its own completion marker calls it itself."""
        self.log.append(
            {
                "step": name,
                "reused": reused,
                "seconds": 0.0 if reused else round(seconds, 1),
                "peak_rss_mib": peak_rss_mib,
            }
        )

    def table(self, total_seconds: float) -> str:
        """The log as a Markdown table: each step's time (or ``reused``) and the peak memory of its commands."""
        lines = ["| step | time | peak memory of its process |", "|---|---:|---:|"]
        for entry in self.log:
            when = "reused" if entry["reused"] else duration(entry["seconds"])
            mem = f"{entry['peak_rss_mib']:.0f} MiB" if entry.get("peak_rss_mib") else "-"
            lines.append(f"| {entry['step']} | {when} | {mem} |")
        lines.append(f"| total (this run) | {duration(total_seconds)} | |")
        return "\n".join(lines)


# Peak resident memory (MiB) of every command run so far, in order; a block reads the ones it added.
_command_peaks: list[float] = []


@contextlib.contextmanager
def peak_rss_of_children() -> Iterator[dict[str, float | None]]:
    """Yields ``{"mib": None}``; at the end of the block, ``"mib"`` holds the largest peak resident memory
    of the commands run inside it (None when none ran, or on Windows)."""
    out: dict[str, float | None] = {"mib": None}
    first = len(_command_peaks)
    try:
        yield out
    finally:
        peaks = _command_peaks[first:]
        out["mib"] = round(max(peaks), 0) if peaks else None


def child_env(threads: int | None = None) -> dict[str, str]:
    """This environment, offline, with this checkout's ``llm2vec`` first on the import path and, when
    ``threads`` is given, that many CPU threads for torch (a fixed count keeps CPU results reproducible)."""
    env = dict(os.environ)
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the hub
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./=:,@+" for c in arg) else json.dumps(arg)


def run_command(cmd: list[str], threads: int | None = None) -> None:
    """Run ``cmd`` from the repository root with this terminal (progress bars show); raise if it fails.

    The command's peak resident memory is recorded (Linux/macOS) for :func:`peak_rss_of_children`.
    """
    say("  $ " + " ".join(quote(c) for c in cmd))
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=child_env(threads))
    try:
        if hasattr(os, "wait4"):
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            scale = 1024 * 1024 if sys.platform == "darwin" else 1024
            _command_peaks.append(usage.ru_maxrss / scale)
        else:  # pragma: no cover - Windows
            proc.wait()
    except BaseException:  # Ctrl-C reaches the child too (same process group): let it stop, then go on
        with contextlib.suppress(Exception):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()
        raise
    if proc.returncode != 0:
        raise DemoError(f"command failed with exit code {proc.returncode}: {' '.join(quote(c) for c in cmd)}")
