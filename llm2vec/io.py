"""Files: JSON-lines reading with ``file:line`` errors, atomic writes, short content hashes.

Every reader of a JSON-lines file in the package (training data, local retrieval tasks) goes through
:func:`iter_jsonl`, so a malformed line gives the same kind of message everywhere: the file, the line
number, what is wrong, and what to do.

Atomic writes build a file or a folder under a temporary name and rename it into place at the end. A
rename within one folder is atomic on POSIX (``os.replace``), so a reader sees either the old content or
the complete new one, never a half-written file. An exception (or a KeyboardInterrupt) while writing
removes the temporary file or folder; a hard kill can leave one behind, under a name starting with ``.``
and ending in ``.tmp``, which no reader picks up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


def iter_jsonl(
    path: str | os.PathLike, *, error: type[Exception] = ValueError, fix: str = "Fix or remove this line."
) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """``(line number, object)`` for each line of a JSON-lines file; ``None`` for a blank line.

    Raises ``error`` naming ``file:line`` for a line that is not UTF-8, not JSON, or not a JSON object;
    ``fix`` (what the user should do) ends the message.
    """
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise error(f"{path}:{line_no}: not valid UTF-8 ({err.reason}). {fix}") from None
            if not text.strip():
                yield line_no, None
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                raise error(f"{path}:{line_no}: invalid JSON ({err.msg}). {fix}") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}. {fix}")
            yield line_no, obj


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> int:
    """Write ``rows`` as JSON lines (UTF-8, unescaped), atomically; returns the number of rows."""
    n = 0
    with atomic_write(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def short_hash(obj: Any, n: int = 16) -> str:
    """The first ``n`` hex digits of the SHA-256 of ``obj`` as canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def file_digest(paths: Iterable[str | os.PathLike], n: int = 64) -> str:
    """SHA-256 (first ``n`` hex digits) of the bytes of ``paths``, in the order given."""
    digest = hashlib.sha256()
    for p in paths:
        digest.update(Path(p).read_bytes())
    return digest.hexdigest()[:n]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file next to ``path``; on a clean exit, flush, fsync and rename it to ``path``.

    Text mode writes ``\\n`` line ends on every platform (``newline=""``), so the bytes do not depend on
    the machine.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private (0600); the result is an ordinary file
        f = os.fdopen(fd, mode) if "b" in mode else os.fdopen(fd, mode, encoding=encoding, newline="")
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

    If ``target`` exists, it is replaced when ``replace`` is true (the old folder is first renamed aside,
    then deleted, so there is no moment without a complete folder under some name), and a
    ``FileExistsError`` is raised otherwise. On an exception the temporary folder is deleted.
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


def remove_stale_temporaries(target: str | os.PathLike) -> None:
    """Delete the temporary siblings of ``target`` (``.<name>.*.tmp``) that a hard kill left behind."""
    target = Path(target)
    if target.parent.is_dir():
        for stale in target.parent.glob(f".{target.name}.*.tmp"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
