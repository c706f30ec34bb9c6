"""One run per output folder: a run holds an exclusive ``flock`` on :data:`LOCK_NAME` in its ``output_dir`` for its
whole life (the kernel drops the lock of a killed process, so a kill leaves only the file). The file names the holder
(process, host, start, command line) for a refused second run. Releasing removes the file while still holding the
lock; a run that opened the old file meanwhile sees that its file is no longer the one at the path and tries again.
Other processes of a distributed run learn from the main process whether it got the lock. Without ``flock`` a run
goes ahead with a warning.
"""

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
    if len(command) > 120:
        command = command[:117] + "..."
    command = f": {command}" if command else ""
    return f"process {info.get('pid', '?')} on {info.get('host', '?')} (started {info.get('started', '?')}{command})"


def _try_lock(path: Path) -> int | None:
    """An open descriptor of ``path`` holding its lock, or ``None`` when another process holds it."""
    for _ in range(20):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed the file after we opened it: try the new one
    raise RunLocked(f"{path}: could not take the run lock (it keeps being replaced)")


def is_held(path: Path) -> bool:
    """Whether a live process holds the lock file ``path`` (a file left by a killed run is not held)."""
    if fcntl is None or not path.is_file():
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the lock this probe may have taken
    return False


@contextlib.contextmanager
def hold(output_dir: str | os.PathLike, is_main: bool = True) -> Iterator[None]:
    """Hold the run lock of ``output_dir`` (created if needed) while the block runs; raises :class:`RunLocked` naming
    the holder when another live run has it. Every process calls this; only ``is_main`` takes the lock."""
    folder = Path(output_dir)
    path = folder / LOCK_NAME
    fd, problem = None, None
    if is_main:
        if fcntl is None:
            logger.warning("no file locking on this system: nothing stops a second run writing into %s", folder)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            try:
                fd = _try_lock(path)
            except OSError as e:
                logger.warning("%s: cannot lock (%s); nothing stops a second run writing there", path, e)
            else:
                if fd is None:
                    problem = (
                        f"output_dir {folder} is in use by another run: {describe_holder(path)}. Wait for it to "
                        "end (or stop it), or choose another --output_dir"
                    )
                else:
                    started = time.strftime("%Y-%m-%d %H:%M:%S")
                    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "argv": sys.argv}
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    problem = _shared(problem)
    if problem:
        raise RunLocked(problem)
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:  # the folder may have been replaced (an export):
                    path.unlink()  # never remove the lock file of another holder
            os.close(fd)


def _shared(problem: str | None) -> str | None:
    """The main process's answer, on every process of a distributed run."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return problem
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]
