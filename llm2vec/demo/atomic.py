"""Atomic writes: build a file or a folder under a temporary name, rename it into place at the end.

A rename within one folder is atomic on POSIX and on Windows (``os.replace``), so a reader sees
either the old content or the complete new one, never a half-written file. An exception (or a
KeyboardInterrupt) while writing removes the temporary file or folder; a hard kill can leave one
behind, under a name starting with ``.`` and ending in ``.tmp``, which is never read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file next to ``path``; on a clean exit, flush, fsync and rename it to ``path``.

    Text mode writes ``\\n`` line ends on every platform (``newline=""``), so the bytes do not
    depend on the machine.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private (0600); the result is an ordinary file
        if "b" in mode:
            f = os.fdopen(fd, mode)
        else:
            f = os.fdopen(fd, mode, encoding=encoding, newline="")
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``target``; on a clean exit, rename it to ``target``.

    If ``target`` exists, it is replaced when ``replace`` is true (the old folder is first renamed
    aside, then deleted, so there is no moment without a complete folder under another name), and
    a ``FileExistsError`` is raised otherwise. On an exception the temporary folder is deleted.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private (0700); the result is an ordinary folder
        yield tmp
        if target.exists():
            if not replace:
                raise FileExistsError(f"{target} appeared while it was being built")
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old.", suffix=".tmp"))
            old.rmdir()
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
