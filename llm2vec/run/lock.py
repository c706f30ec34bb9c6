"""One writer per output folder: an exclusive ``flock`` on :data:`LOCK_NAME`, held for the writer's life (the kernel
drops a killed one's) and naming the holder. Imports nothing of the package (:mod:`llm2vec.model_files` reads it)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("llm2vec")

LOCK_NAME = ".llm2vec-run.lock"

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None


class RunLocked(RuntimeError):
    """Another live run holds the lock of this output folder."""


def describe_holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return "another run (its lock file could not be read)"
    command = " ".join(info.get("argv", []))
    command = f": {command[:117]}..." if len(command) > 120 else f": {command}" if command else ""
    return f"process {info.get('pid', '?')} on {info.get('host', '?')} (started {info.get('started', '?')}{command})"


def is_held(path: Path) -> bool:
    if fcntl is None or not path.is_file():
        return False
    fd = None
    try:
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as e:  # BlockingIOError: another process holds it
        return isinstance(e, BlockingIOError)
    finally:
        if fd is not None:
            os.close(fd)  # closing drops the lock this probe may have taken


def _try_lock(path: Path) -> int | None:
    """A descriptor holding ``path``'s lock, or ``None`` when another process holds it."""
    if fcntl is None:
        raise OSError("no file locking on this system")
    for _ in range(20):
        fd, keep = os.open(path, os.O_RDWR | os.O_CREAT, 0o644), False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            keep = os.fstat(fd).st_ino == os.stat(path).st_ino  # else the holder replaced the file: again
        except BlockingIOError:
            return None
        except FileNotFoundError:
            pass  # the holder removed the file after we opened it
        finally:
            if not keep:
                os.close(fd)
        if keep:
            return fd
    raise RunLocked(f"{path}: could not take the run lock (it keeps being replaced)")


@contextlib.contextmanager
def hold(output_dir: str | os.PathLike, is_main: bool = True) -> Iterator[None]:
    """Hold ``output_dir``'s lock (only ``is_main`` takes it; every process learns the answer) or raise RunLocked."""
    folder, fd, problem = Path(output_dir), None, None
    path = folder / LOCK_NAME
    if is_main:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = _try_lock(path)
        except OSError as e:
            logger.warning("%s: cannot lock (%s); nothing stops a second run writing there", path, e)
        else:
            if fd is None:
                problem = f"output_dir {folder} is in use by another run: {describe_holder(path)}"
            else:
                started = time.strftime("%Y-%m-%d %H:%M:%S")
                info = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "argv": sys.argv}
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)  # the main process's answer, on every process
        problem = box[0]
    if problem:
        raise RunLocked(problem)
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:  # never another holder's (an export replaced it)
                    path.unlink()
            os.close(fd)
