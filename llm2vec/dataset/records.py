"""Training examples and the one parser of JSON-lines pair files (``e5.py``, ``jsonl.py``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..io import iter_jsonl
from ..keywords import strict_booleans

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A problem with training data; the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class TrainExample:
    """One training triple: ``query_instruction`` goes to the query only; ``negative`` is ``None`` without a hard
    negative; ``source`` names the dataset (a global batch never mixes sources)."""

    query: str
    positive: str
    negative: str | None
    query_instruction: str
    source: str
    origin: str = field(default="", compare=False)  # "file:line" it was read from ("" when built in code)


@dataclass(frozen=True)
class RawRecord:
    """A parsed, non-empty record of a JSON-lines file: ``index`` its 0-based position among the file's records
    (skipped empty ones included), ``line`` its line number."""

    index: int
    line: int
    query: str
    positive: str
    negative: str | None
    instruction: str | None
    path: str = ""


@dataclass
class FileReport:
    """What reading one file produced."""

    path: str
    records: int = 0  # non-blank lines read
    kept: int = 0
    skipped_empty: int = 0  # records with an empty text, not used
    blank_lines: int = 0
    truncated: bool = False  # stopped early because of a limit
    # the lines of kept records that repeat an earlier record's query and positive, and whose negative is the positive
    duplicates: list[int] = field(default_factory=list)
    negative_is_positive: list[int] = field(default_factory=list)


def _fail(path: str, line: int, problem: str, fix: str) -> DataError:
    return DataError(f"{path}:{line}: {problem}. {fix}")


def _text_field(obj: dict, name: str, path: str, line: int, fix: str, required: bool) -> str | None:
    """The stripped string ``obj[name]``; ``None`` when optional and absent or null."""
    value = obj.get(name)
    if value is None:
        if required:
            present = "is null" if name in obj else "is missing"
            raise _fail(path, line, f'required field "{name}" {present}', fix)
        return None
    if not isinstance(value, str):
        raise _fail(path, line, f'field "{name}" must be a string, got {type(value).__name__}', fix)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate (JSON "\ud800"): no tokenizer can read it
        raise _fail(
            path,
            line,
            f'field "{name}" holds {value[err.start]!r} at character {err.start}, half of a UTF-16 surrogate '
            "pair, which is not a character (a broken \\uXXXX escape)",
            fix,
        ) from None
    return value.strip()


@strict_booleans
def read_jsonl_pairs(
    path: str,
    *,
    require_negative: bool,
    read_instruction: bool,
    limit: int | None = None,
    fix: str = "Fix or remove this line.",
) -> tuple[list[RawRecord], FileReport]:
    """The kept records (at most ``limit``) of a JSON-lines file of ``{"query", "positive", "negative"?,
    "instruction"?}`` objects in file order, and a :class:`FileReport`. ``require_negative``: a record needs a
    non-empty negative (else absent, null or empty mean none); ``read_instruction``: read each line's
    ``instruction``. A malformed line (``fix``: what to tell the user), a file that is not UTF-8, or one in which no
    record survives is a :class:`DataError`."""
    report = FileReport(path=path)
    records: list[RawRecord] = []
    pairs_seen: set[int] = set()
    for line_no, obj in iter_jsonl(path, error=DataError, fix=fix):
        if limit is not None and len(records) >= limit:
            report.truncated = True
            break
        if obj is None:
            report.blank_lines += 1
            continue
        index = report.records
        report.records += 1
        query = _text_field(obj, "query", path, line_no, fix, required=True)
        positive = _text_field(obj, "positive", path, line_no, fix, required=True)
        negative = _text_field(obj, "negative", path, line_no, fix, required=require_negative)
        instruction = _text_field(obj, "instruction", path, line_no, fix, required=False) if read_instruction else None
        if not query or not positive or (require_negative and not negative):
            report.skipped_empty += 1
            continue
        pair = hash((query, positive))
        if pair in pairs_seen:
            report.duplicates.append(line_no)
        pairs_seen.add(pair)
        if negative == positive:
            report.negative_is_positive.append(line_no)
        records.append(RawRecord(index, line_no, query, positive, negative or None, instruction, path))
    report.kept = len(records)
    if report.blank_lines:
        logger.warning("%s: ignored %d blank lines", path, report.blank_lines)
    check_report(report, ("query", "positive", "negative")[: 3 if require_negative else 2])
    return records, report


def check_report(report: FileReport, required: Sequence[str], unit: str = "line", first: str = "") -> None:
    """Warn of ``report``'s skipped records (``first``: where the first was) and of its kept repeated pairs and
    negatives equal to their positive, naming the first lines (``unit``: or rows) of each; refuse one that kept none."""
    noun, path = "rows" if unit == "row" else "records", report.path
    if report.skipped_empty:
        needed = ", ".join(required[:-1]) + " or " + required[-1]
        logger.warning(
            "%s: skipped %d of %d %s whose %s is empty or whitespace only%s",
            *(path, report.skipped_empty, report.records, noun, needed, first),
        )
    if report.duplicates:
        logger.warning(
            "%s: %d of %d records %s the query and positive of an earlier record (%s); they are kept, but two copies "
            "in one batch make each an in-batch negative of the other's query",
            *(path, len(report.duplicates), report.records, "repeats" if len(report.duplicates) == 1 else "repeat"),
            _line_list(report.duplicates, unit=unit),
        )
    if report.negative_is_positive:
        logger.warning(
            "%s: %d of %d records %s a negative equal to %s positive (%s); they are kept, but such a hard negative "
            "scores exactly as the positive",
            *(path, len(report.negative_is_positive), report.records),
            *(("has", "its") if len(report.negative_is_positive) == 1 else ("have", "their")),
            _line_list(report.negative_is_positive, unit=unit),
        )
    if not report.kept and not report.records:
        raise DataError(f"{path}: the file holds no records. Check that it is the right file.")
    if not report.kept:
        where = "the dataset's columns and column_map" if unit == "row" else "the file's field names and contents"
        raise DataError(
            f"{path}: all {report.records} {noun} were skipped because a required text is empty or whitespace only. "
            f"Check {where}."
        )


def _line_list(lines: list[int], shown: int = 5, unit: str = "line") -> str:
    """``line 3``, ``lines 5, 7``, or the first ``shown`` of many followed by ``...``."""
    listed = ", ".join(map(str, lines[:shown])) + (", ..." if len(lines) > shown else "")
    return f"{unit}{'s' if len(lines) > 1 else ''} {listed}"


def _listing(folder: str, n: int = 2) -> str:
    """``folder/a.jsonl,folder/b.jsonl``: the first ``n`` JSON-lines files of ``folder`` (for a hint)."""
    try:
        names = sorted(name for name in os.listdir(folder) if name.endswith(".jsonl"))[:n]
    except OSError:
        names = []
    return ",".join(os.path.join(folder, name) for name in names) or os.path.join(folder, "<name>.jsonl")


def check_path_kind(path: str, dataset_name: str, what: str = "dataset_file_path") -> None:
    """A data path that exists is of the kind its reader needs (E5's a folder, every other a file); else a
    :class:`DataError` naming ``what``, the path and what to give instead."""
    if dataset_name == "E5" and os.path.isfile(path):
        raise DataError(
            f"{what} {path} is a file; dataset_name E5 reads the folder that holds the E5 <source>.jsonl files: give "
            "that folder, or set dataset_name jsonl to train on this file"
        )
    if dataset_name != "E5" and os.path.isdir(path):
        raise DataError(
            f"{what} {path} is a folder; a JSON-lines file is expected here: name the files, joined by ',' "
            f"(e.g. {_listing(path)})"
            + (
                ", or set dataset_name E5 if it holds the E5 <source>.jsonl files"
                if what == "dataset_file_path"
                else ""
            )
        )


def missing_files(paths: Iterable[str]) -> list[str]:
    """The paths in ``paths`` that are not existing files, in order."""
    return [p for p in paths if not os.path.isfile(p)]
