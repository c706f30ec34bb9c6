"""Files: strict JSON and JSON-lines reading, atomic writes, content hashes, and the records of saved folders."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

MAX_LINE_BYTES = 16 * 2**20  # the longest line iter_jsonl reads: a hundred times a 32k-token text


def iter_jsonl(
    path: str | os.PathLike,
    *,
    error: type[Exception] = ValueError,
    fix: str = "Fix or remove this line.",
    digests: Iterable[Any] = (),
) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """``(line number, object)`` for each line of a JSON-lines file (``None`` for a blank line); ``error`` naming
    ``file:line`` and ``fix`` for a line over :data:`MAX_LINE_BYTES`, not UTF-8, not a JSON object, or giving one
    key twice. ``digests``: ``hashlib`` objects fed every byte parsed."""
    digests = list(digests)
    limit = MAX_LINE_BYTES  # read once: a reader never sees the limit change under it
    with _open_hashing(path, digests) as handle:
        for line_no, raw in enumerate(iter(lambda: handle.readline(limit + 1), b""), start=1):
            if len(raw) > limit:
                raise error(
                    f"{path}:{line_no}: the line is longer than {limit:,} bytes (llm2vec.io.MAX_LINE_BYTES), more "
                    "than any text a model reads; it is not read. Is this a JSON-lines file (one object per line)? "
                    f"{fix}"
                )
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                looks = _guess_encoding(raw)
                raise error(
                    f"{path}:{line_no}: not valid UTF-8 ({err.reason}); it looks like {looks}. Save the file as UTF-8"
                ) from None
            if not text.strip():
                yield line_no, None
                continue
            try:
                obj = json.loads(text, object_pairs_hook=_no_duplicates)
            except _DuplicateKey as err:
                raise error(f"{path}:{line_no}: the key {err.key!r} is given twice in one object. {fix}") from None
            except json.JSONDecodeError as err:
                raise error(f"{path}:{line_no}: invalid JSON ({err.msg}). {fix}") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}. {fix}")
            yield line_no, obj


class _HashingReader(io.RawIOBase):
    """A raw binary file that feeds every block it reads to ``digests``."""

    def __init__(self, raw: IO[bytes], digests: list[Any]):
        self.raw, self.digests = raw, digests

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        if n:
            block = memoryview(buffer)[:n]
            for digest in self.digests:
                digest.update(block)
        return n

    def close(self) -> None:
        self.raw.close()
        super().close()


def _open_hashing(path: str | os.PathLike, digests: list[Any]) -> IO[bytes]:
    """``path`` opened for reading bytes; with ``digests``, each block read is hashed on its way."""
    if not digests:
        return open(path, "rb")
    return io.BufferedReader(_HashingReader(open(path, "rb", buffering=0), digests), buffer_size=1 << 20)


class JsonFileError(ValueError):
    """A JSON file that is missing, a folder, not UTF-8, not JSON, or gives a key twice (one line)."""


def _guess_encoding(data: bytes) -> str:
    """A short description of the encoding that bytes which are not UTF-8 look like."""
    for bom, name in (
        (b"\xff\xfe\x00\x00", "UTF-32 LE"),
        (b"\x00\x00\xfe\xff", "UTF-32 BE"),
        (b"\xff\xfe", "UTF-16 LE"),
        (b"\xfe\xff", "UTF-16 BE"),
    ):
        if data.startswith(bom):
            return f"{name} (it starts with that byte order mark)"
    head = data[:4096]
    if head and head.count(0) * 4 >= len(head):
        return "UTF-16 or UTF-32 (every other byte is zero)"
    return "a one-byte encoding such as Latin-1 or Windows-1252"


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_json_file(path: str | os.PathLike, what: str = "file") -> Any:
    """The JSON value in ``path``; :class:`JsonFileError` (one line naming ``what`` and the path) for a missing file,
    a folder, bytes that are not UTF-8, text that is not JSON, or an object that gives one key twice."""
    path = Path(path)
    if path.is_dir():
        raise JsonFileError(f"{what} {path} is a folder; give the path of a JSON file")
    if not path.is_file():
        raise JsonFileError(f"{what} {path} not found")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise JsonFileError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    try:
        return json.loads(data.decode("utf-8-sig"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as err:
        raise JsonFileError(
            f"{what} {path}: not UTF-8 (byte {data[err.start]:#04x} at offset {err.start}); it looks like "
            f"{_guess_encoding(data)}. Save it as UTF-8"
        ) from None
    except _DuplicateKey as e:
        raise JsonFileError(
            f"{what} {path}: the key {e.key!r} is given twice in one object; JSON keeps only the last one, so keep "
            "the one you mean and delete the other"
        ) from None
    except json.JSONDecodeError as e:
        raise JsonFileError(f"{what} {path}: not valid JSON ({e})") from None


def missing_local_path(value: str | os.PathLike) -> bool:
    """Whether ``value`` is written as a local path (absolute, starting with ``.`` or ``~``, with more than one
    ``/`` or an OS separator other than ``/``; not a hub id) that does not exist."""
    text = os.fspath(value)
    pathlike = text.startswith(("/", ".", "~")) or text.count("/") > 1 or (os.sep != "/" and os.sep in text)
    return pathlike and not os.path.exists(os.path.expanduser(text))


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> int:
    """Write ``rows`` as JSON lines (UTF-8, unescaped), atomically; returns the number of rows."""
    n = 0
    with atomic_write(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def short_hash(obj: Any, n: int = 16) -> str:
    """The first ``n`` hex digits of the SHA-256 of ``obj`` as canonical JSON (sorted keys, ASCII)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def json_sha256(obj: Any) -> str:
    """The SHA-256 (hex) of ``obj`` as canonical JSON in UTF-8 (sorted keys, text unescaped)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


HASH_BLOCK = 8 << 20
_WHOLE_FILE_SHA256: dict[tuple, str] = {}  # one version of a file (sha256_file's key) -> its SHA-256, per process


def sha256_file(path: str | os.PathLike, limit: int | None = None, digest=None) -> str:
    """The SHA-256 (hex) of a file's bytes, or of its first ``limit`` bytes; ``digest``: a ``hashlib`` object to
    continue. A whole file's hash is cached per process by real path, inode, size and times."""
    if limit is not None or digest is not None:
        return _read_sha256(path, limit, digest or hashlib.sha256())
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key in _WHOLE_FILE_SHA256:
        return _WHOLE_FILE_SHA256[key]
    # Linux takes file times from CLOCK_REALTIME_COARSE (5), never earlier; elsewhere allow two seconds' granularity
    tick = time.clock_gettime_ns(5) if sys.platform == "linux" else time.time_ns() - 2 * 10**9
    value = _read_sha256(path, None, hashlib.sha256())
    if stat.st_ctime_ns < tick:  # any later write gets a change time of at least tick
        _WHOLE_FILE_SHA256[key] = value
    return value


def _read_sha256(path: str | os.PathLike, limit: int | None, digest) -> str:
    left = limit
    with open(path, "rb") as f:
        while left is None or left > 0:
            block = f.read(HASH_BLOCK if left is None else min(HASH_BLOCK, left))
            if not block:
                break
            digest.update(block)
            left = None if left is None else left - len(block)
    return digest.hexdigest()


def file_digest(paths: Iterable[str | os.PathLike], n: int = 64) -> str:
    """SHA-256 (first ``n`` hex digits) of the bytes of ``paths``, in the order given."""
    digest = hashlib.sha256()
    for p in paths:
        sha256_file(p, digest=digest)
    return digest.hexdigest()[:n]


RUN_CONFIG_NAME = "run_config.json"  # a run's settings and inputs, in its folder and each checkpoint (llm2vec.run)
FINAL_SAVE_RECORD = ".llm2vec-final-save.json"  # the final save's file names while it moves them into place
COMPLETE_MARKER = "training_complete.json"  # written last by a run's final save (llm2vec.run.saves)
EXPORT_MARKER = "export_complete.json"  # written last into an export (llm2vec.run.target)


def file_record(folder: str | os.PathLike, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{"files": {name: size}, "sha256": {name: hex}}`` of the files ``names`` (relative paths) of ``folder``."""
    folder, names = Path(folder), sorted(names)
    return {
        "files": {n: (folder / n).stat().st_size for n in names},
        "sha256": {n: sha256_file(folder / n) for n in names},
    }


def record_problem(folder: str | os.PathLike, record: Any, name: str, contents: bool = True) -> str | None:
    """Why ``folder`` does not hold what its ``record`` (the file ``name``, :func:`file_record`) says, else ``None``
    (``contents``: the bytes compared too)."""
    files = record.get("files") if isinstance(record, dict) else None
    hashes = record.get("sha256") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not isinstance(hashes, dict) or not files:
        return f"{name} lists no files with their sizes and SHA-256"
    if set(files) != set(hashes):
        return f"{name} gives no size or no SHA-256 for {sorted(set(files) ^ set(hashes))[0]}"
    problems = []
    for file, size in sorted(files.items()):
        path = Path(folder) / file
        if path.is_symlink() or not resolves_inside(folder, path):
            problems.append(f"{file} is a link, not a file the save wrote")
        elif not path.is_file():
            problems.append(f"{file} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{file} is {path.stat().st_size} bytes, {size} when saved")
        elif contents and sha256_file(path) != hashes[file]:
            problems.append(f"{file} has other contents than when it was saved (its SHA-256 differs from {name})")
    return "; ".join(problems[:3]) + (f"; {len(problems) - 3} more" if len(problems) > 3 else "") or None


def resolves_inside(folder: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Whether ``path``'s real path lies inside ``folder``'s (or a cache snapshot's ``blobs`` folder)."""
    root, real = Path(folder).resolve(), Path(path).resolve()
    return root in real.parents or (root.parent.name == "snapshots" and real.parent == root.parent.parent / "blobs")


def saved_folder_problem(folder: str | os.PathLike) -> str | None:
    """Why the local model, adapter, run or export ``folder`` must not be read, else ``None``: a file that links
    outside it, or files that do not match the record its save wrote last (:data:`COMPLETE_MARKER`,
    :data:`EXPORT_MARKER`)."""
    if folder is None or not os.path.isdir(folder):
        return None
    links = links_outside(folder)
    if links:
        return (
            f"its file {links[0]} links outside the folder; a model's files are read only from inside its folder. "
            "Copy the file into the folder in place of the link"
        )
    for name in (COMPLETE_MARKER, EXPORT_MARKER):
        if os.path.lexists(Path(folder) / name):
            try:
                record = json.loads((Path(folder) / name).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                record = None
            problem = record_problem(folder, record, name)
            if problem:
                return (
                    f"{problem}; the folder was changed or damaged after it was saved. Save (train or export) it again"
                )
    return None


def links_outside(folder: str | os.PathLike) -> list[str]:
    """The files of ``folder`` (any depth) whose real path lies outside it (:func:`resolves_inside`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_symlink() and not resolves_inside(folder, p)
    )


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """A temporary file next to ``path``, flushed, synced and renamed to ``path`` on a clean exit (text mode:
    ``\\n`` line ends)."""
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
    """An empty temporary folder next to ``target``, renamed to ``target`` on a clean exit (an existing one replaced
    when ``replace``, else a ``FileExistsError``), deleted on an exception."""
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
