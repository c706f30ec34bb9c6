"""A retrieval folder of the BEIR layout, read and checked line by line: the one reader of such folders."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .io import iter_jsonl, short_hash

logger = logging.getLogger(__name__)

FILES = ("corpus.jsonl", "queries.jsonl", "qrels.jsonl")
UNJUDGED = ("leave_out", "refuse")


@dataclass(frozen=True)
class BeirFolder:
    """One BEIR-layout folder, every dict in file order: ``corpus`` (id -> ``(title, text)``), the scored ``queries``
    and their ``relevant`` documents (id -> grade); ``file_sha256`` of the bytes parsed, a ``digest`` of the three."""

    path: Path
    corpus: dict[str, tuple[str, str]]
    queries: dict[str, str]
    relevant: dict[str, dict[str, int]]
    file_sha256: dict[str, str]
    digest: str

    @property
    def name(self) -> str:
        """The folder's own name (``NanoNQ`` for ``data/NanoNQ/``)."""
        return Path(os.path.abspath(self.path)).name

    def document_text(self, doc_id: str) -> str:
        """The text a model reads for a document, as mteb 2 joins it: ``"{title} {text}"`` stripped."""
        title, text = self.corpus[doc_id]
        return f"{title} {text}".strip() if title else text.strip()


def _read_jsonl(path: Path, required: tuple[str, ...], digests=()) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of each non-blank line, each with the ``required`` fields."""
    fix = f"Each line needs a JSON object with {list(required)}."
    rows = []
    for line_no, row in iter_jsonl(path, fix=fix, digests=digests):
        if row is None:
            continue
        missing = [k for k in required if k not in row]
        if missing:
            raise ValueError(f"{path}:{line_no}: missing field(s) {missing}. {fix}")
        rows.append((line_no, row))
    if not rows:
        raise ValueError(f"{path}: no records; {fix[0].lower()}{fix[1:]}")
    return rows


def _id(value: Any, where: str, field: str) -> str:
    """An id as the string mteb keys by: a non-empty string, or an integer (``7`` and ``"7"`` are one id)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{where}: {field} {value!r} must be a string or an integer")
    text = str(value)
    if not text.strip():
        raise ValueError(f"{where}: {field} is empty")
    return text


def _text(row: dict[str, Any], field: str, where: str, optional: bool = False) -> str:
    value = row.get(field)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: {field} must be a string, got {json.dumps(value)[:40]}")
    return value


MAX_GRADE = 2**31 - 1  # pytrec_eval's (mteb's) grades are 32-bit integers; 10**400 is not even a float


def _grade(value: Any, where: str) -> int:
    """A relevance grade: a whole number >= 0 (a JSON integer, an integral float or a string of one)."""
    grade = value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(value, float) and value.is_integer():
        grade = int(value)
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):  # not a whole number: refused below
            grade = int(value.strip())
    if grade is None:
        raise ValueError(
            f"{where}: score {value!r} is not an integer; give a whole-number relevance grade (0 = not relevant)"
        )
    if grade < 0:
        raise ValueError(
            f"{where}: score {grade} is negative; nDCG needs grades >= 0 (give 0 for a judged non-relevant document)"
        )
    if grade > MAX_GRADE:
        raise ValueError(f"{where}: score {str(grade)[:20]}... is above {MAX_GRADE}, more than nDCG can weigh")
    return grade


def _unique_ids(path: Path, rows: list[tuple[int, dict[str, Any]]]) -> dict[str, int]:
    """id -> line of each record of ``path``; an id given twice is an error naming both lines."""
    lines: dict[str, int] = {}
    for line_no, row in rows:
        key = _id(row["_id"], f"{path}:{line_no}", "_id")
        if key in lines:
            raise ValueError(
                f"{path}:{line_no}: _id {key!r} is also the id of line {lines[key]}; ids must be unique (mteb would keep "
                "only one of the two records)"
            )
        lines[key] = line_no
    return lines


def _check_files(data_dir: Path) -> None:
    if data_dir.is_file():
        raise FileNotFoundError(
            f"local retrieval folder {str(data_dir)!r} is a file; give the folder that holds corpus.jsonl, "
            "queries.jsonl and qrels.jsonl"
        )
    missing = [name for name in FILES if not (data_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"local retrieval folder {str(data_dir)!r} lacks {missing}; it needs corpus.jsonl "
            '({"_id","title","text"}), queries.jsonl ({"_id","text"}) and qrels.jsonl ({"query-id","corpus-id","score"})'
        )


def read_beir_folder(data_dir: str | os.PathLike, queries_without_relevant: str = "leave_out") -> BeirFolder:
    """The folder ``data_dir`` read and checked (docs/design.md); ``queries_without_relevant``: ``"leave_out"``
    (with a warning) or ``"refuse"`` (a ``ValueError`` naming the query's line)."""
    if queries_without_relevant not in UNJUDGED:
        raise ValueError(f"queries_without_relevant must be one of {UNJUDGED}, got {queries_without_relevant!r}")
    data_dir = Path(data_dir)
    _check_files(data_dir)
    corpus_path, queries_path, qrels_path = (data_dir / name for name in FILES)
    each = {name: hashlib.sha256() for name in FILES}
    corpus = _read_jsonl(corpus_path, ("_id", "text"), (each["corpus.jsonl"],))
    queries = _read_jsonl(queries_path, ("_id", "text"), (each["queries.jsonl"],))
    qrels = _read_jsonl(qrels_path, ("query-id", "corpus-id", "score"), (each["qrels.jsonl"],))
    doc_ids, query_ids = _unique_ids(corpus_path, corpus), _unique_ids(queries_path, queries)

    relevant: dict[str, dict[str, int]] = {}
    pair_lines: dict[tuple[str, str], int] = {}
    for line_no, row in qrels:
        where = f"{qrels_path}:{line_no}"
        qid, did = _id(row["query-id"], where, "query-id"), _id(row["corpus-id"], where, "corpus-id")
        if qid not in query_ids:
            raise ValueError(f"{where}: query-id {qid!r} is not in queries.jsonl")
        if did not in doc_ids:
            raise ValueError(f"{where}: corpus-id {did!r} is not in corpus.jsonl")
        if (qid, did) in pair_lines:
            raise ValueError(
                f"{where}: query {qid!r} and document {did!r} are graded already at line {pair_lines[qid, did]}; "
                "give each pair once"
            )
        pair_lines[qid, did] = line_no
        relevant.setdefault(qid, {})[did] = _grade(row["score"], where)

    unjudged = [q for q in query_ids if q not in relevant]
    nothing_relevant = [q for q, grades in relevant.items() if not any(grades.values())]
    if queries_without_relevant == "refuse" and (unjudged or nothing_relevant):
        first = min(unjudged + nothing_relevant, key=query_ids.__getitem__)
        why = "has no line in qrels.jsonl" if first in unjudged else "has only qrels lines that grade 0"
        raise ValueError(
            f"{queries_path}:{query_ids[first]}: query {first!r} {why}, so it has no relevant document to find "
            f"({len(unjudged) + len(nothing_relevant)} such queries in all); remove such queries or give the qrels "
            "of this split"
        )
    for qid in nothing_relevant:
        del relevant[qid]
    if not relevant:
        raise ValueError(
            f"{qrels_path}: no query has a relevant document (a score above 0); nothing can be scored. Check the "
            "scores and ids"
        )
    if unjudged or nothing_relevant:
        logger.warning(
            f"{data_dir}: {len(unjudged) + len(nothing_relevant)} of {len(query_ids)} queries are left out: "
            f"{len(unjudged)} without a qrels line, {len(nothing_relevant)} whose documents are all graded 0 "
            "(nothing relevant to find)"
        )
    return BeirFolder(
        path=data_dir,
        corpus={
            str(d["_id"]): (
                _text(d, "title", f"{corpus_path}:{n}", optional=True),
                _text(d, "text", f"{corpus_path}:{n}"),
            )
            for n, d in corpus
        },
        queries={
            str(q["_id"]): _text(q, "text", f"{queries_path}:{n}") for n, q in queries if str(q["_id"]) in relevant
        },
        relevant={q: relevant[q] for q in query_ids if q in relevant},
        file_sha256=(sha := {name: digest.hexdigest() for name, digest in each.items()}),
        digest=short_hash(sha, n=12),
    )
