"""Where evaluation reads and writes: the input files, the names that become path components, the results folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..io import JsonFileError, read_json_file

MAX_NAME_BYTES = 200  # the longest name (UTF-8 bytes) of one path component: room for ".json" and temporary suffixes


class PathNameError(ValueError):
    """A name that cannot be one path component, or a results folder that cannot be read or written (one line)."""


def check_name(name: object, what: str) -> str:
    """``name`` if it is a plain file name (docs/design.md), else :class:`PathNameError` naming ``what``."""
    if not isinstance(name, str):
        raise PathNameError(f"{what} {name!r}: must be a string")
    problem = None
    if not name:
        problem = "is empty"
    elif name in (".", ".."):
        problem = "names a folder, not a file"
    elif "/" in name or "\\" in name:
        problem = "holds a path separator"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "holds a control character"
    elif len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        problem = f"is longer than {MAX_NAME_BYTES} bytes"
    if problem:
        raise PathNameError(
            f"{what} {name!r} {problem}; it becomes one folder or file name under the output folder, so give a "
            "plain name (letters, digits, '.', '_', '-'; not '.' or '..')"
        )
    return name


def model_folder_name(model_name: object, what: str = "--model_name") -> str:
    """The folder mteb names a model's results after (``org/name`` as ``org__name``, spaces as ``_``), each part
    and the whole a plain name (:func:`check_name`)."""
    if not isinstance(model_name, str) or "/" not in model_name:
        raise PathNameError(f"{what} {model_name!r}: give it as organization/name (mteb's format), e.g. local/my-model")
    for part in model_name.split("/"):
        check_name(part, f"{what} {model_name!r}: its part")
    return check_name(model_name.replace("/", "__").replace(" ", "_"), what)


def results_folder(output_dir: str | os.PathLike, model_name: str, revision: str) -> Path:
    """``<output_dir>/results/<model folder>/<revision>``, the names checked; always inside ``output_dir``."""
    return Path(output_dir) / "results" / model_folder_name(model_name) / check_name(revision, "--revision")


def read_input_json(path: str | os.PathLike, what: str, holds: str, error: type[Exception]) -> Any:
    """The JSON value of the input file ``path`` (:func:`llm2vec.io.read_json_file`); ``error`` (one line naming
    ``what`` and the path, and what it ``holds`` when missing) where it cannot be read."""
    if not Path(path).exists():
        raise error(f"{what} {str(path)!r} not found; {holds}")
    try:
        return read_json_file(path, what)
    except JsonFileError as e:
        raise error(str(e)) from None


def check_output_folder(folder: str | os.PathLike, what: str) -> None:
    """``folder`` (which need not exist yet) can be made, read and written, in no run's or export's folder; creates
    nothing. Raises :class:`PathNameError` naming ``what`` (the option that gave it) and the folder at fault."""
    existing = Path(folder)
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent  # a folder that cannot be entered stops here too (exists() is false below it)
    if not existing.is_dir():
        raise PathNameError(f"{what}: {existing} is a file, not a folder; choose another output folder")
    if not os.access(existing, os.R_OK | os.X_OK):
        raise PathNameError(
            f"{what}: cannot read the folder {existing} (permission denied); earlier results are read "
            "from there: fix its permissions or choose another output folder"
        )
    from ..run import folder_holds

    for holder in (existing, *existing.parents):
        if held := folder_holds(holder):
            raise PathNameError(
                f"{what}: {holder} holds {held}; results are written apart from runs and exports: choose another "
                "output folder"
            )
    if not os.access(existing, os.W_OK):
        raise PathNameError(
            f"{what}: cannot write in the folder {existing} (permission denied or a read-only file "
            "system); fix its permissions or choose another output folder"
        )
