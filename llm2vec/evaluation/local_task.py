"""A local BEIR-style retrieval dataset as an mteb 2.x retrieval task (no hub access).

The folder holds three JSON-lines files:

- ``corpus.jsonl``: ``{"_id", "title", "text"}`` (``title`` optional);
- ``queries.jsonl``: ``{"_id", "text"}``;
- ``qrels.jsonl``: ``{"query-id", "corpus-id", "score"}``.

:func:`local_retrieval_task` reads them into the ``RetrievalSplitData`` that mteb's own retrieval tasks
use (one ``default`` subset, one ``test`` split), so ``mteb.evaluate`` scores it like any retrieval task
(main score nDCG@10) and writes ``<name>.json`` into the results cache. Queries with no qrels line are
left out (they cannot be scored); a line that is not a JSON object, lacks a field, or (in the qrels)
names an unknown query or document is an error naming ``file:line``. The dataset "revision" in the task
metadata is a hash of the three files, so the results file records which version of the data was scored.

The task's instruction (for its queries; documents get none) is ``task.instruction``, kept in the task's
metadata as mteb keeps a task's own prompt (``metadata.prompt = {"query": instruction}``), where
``LLM2VecMTEBEncoder`` reads it when its instructions mapping has no entry for the task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import Dataset
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.task_metadata import TaskMetadata

from ..io import file_digest, iter_jsonl

FILES = ("corpus.jsonl", "queries.jsonl", "qrels.jsonl")


def _read_jsonl(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of each non-blank line; every record must have the ``required`` fields."""
    fix = f"Each line needs a JSON object with {list(required)}."
    rows = []
    for line_no, row in iter_jsonl(path, fix=fix):
        if row is None:
            continue
        missing = [k for k in required if k not in row]
        if missing:
            raise ValueError(f"{path}:{line_no}: missing field(s) {missing}. {fix}")
        rows.append((line_no, row))
    if not rows:
        raise ValueError(f"{path}: no records; {fix[0].lower()}{fix[1:]}")
    return rows


def read_beir_folder(data_dir: str | Path) -> tuple[RetrievalSplitData, str]:
    """The split data of a BEIR-style folder and a short hash of its files."""
    data_dir = Path(data_dir)
    missing = [name for name in FILES if not (data_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"local retrieval folder {str(data_dir)!r} lacks {missing}; it needs corpus.jsonl "
            '({"_id","title","text"}), queries.jsonl ({"_id","text"}) and qrels.jsonl ({"query-id","corpus-id","score"})'
        )
    corpus = [row for _, row in _read_jsonl(data_dir / "corpus.jsonl", ("_id", "text"))]
    queries = [row for _, row in _read_jsonl(data_dir / "queries.jsonl", ("_id", "text"))]
    qrels_path = data_dir / "qrels.jsonl"
    qrels = _read_jsonl(qrels_path, ("query-id", "corpus-id", "score"))

    doc_ids = {str(d["_id"]) for d in corpus}
    query_ids = {str(q["_id"]) for q in queries}
    relevant: dict[str, dict[str, int]] = {}
    for line_no, row in qrels:
        qid, did = str(row["query-id"]), str(row["corpus-id"])
        if qid not in query_ids:
            raise ValueError(f"{qrels_path}:{line_no}: query-id {qid!r} is not in queries.jsonl")
        if did not in doc_ids:
            raise ValueError(f"{qrels_path}:{line_no}: corpus-id {did!r} is not in corpus.jsonl")
        try:
            relevant.setdefault(qid, {})[did] = int(row["score"])
        except (TypeError, ValueError):
            raise ValueError(f"{qrels_path}:{line_no}: score {row['score']!r} is not an integer") from None

    split = RetrievalSplitData(
        corpus=Dataset.from_list(
            [{"id": str(d["_id"]), "title": str(d.get("title") or ""), "text": str(d["text"])} for d in corpus]
        ),
        queries=Dataset.from_list(
            [{"id": str(q["_id"]), "text": str(q["text"])} for q in queries if str(q["_id"]) in relevant]
        ),
        relevant_docs=relevant,
        top_ranked=None,
    )
    return split, file_digest([data_dir / name for name in FILES], n=12)


class LocalRetrievalTask(AbsTaskRetrieval):
    """A retrieval task whose data come from a local folder (see the module docstring)."""

    metadata: TaskMetadata  # set on the per-dataset subclass that local_retrieval_task creates

    def __init__(self, data_dir: str | Path, instruction: str | None = None, **kwargs: Any):
        self.data_dir = Path(data_dir)
        super().__init__(**kwargs)
        if instruction is not None:
            self.instruction = instruction

    @property
    def instruction(self) -> str | None:
        """The query instruction: the ``"query"`` entry of the metadata's ``prompt`` (``""``: none, by choice; None:
        not given)."""
        prompt = self.metadata.prompt
        return prompt.get("query") if isinstance(prompt, dict) else prompt

    @instruction.setter
    def instruction(self, value: str | None) -> None:
        # the metadata lives on this dataset's own class (see local_retrieval_task), so this task's alone changes
        prompt = {"query": value} if value is not None else None  # "": the task has no instruction, by choice
        type(self).metadata = type(self).metadata.model_copy(update={"prompt": prompt})

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        if self.data_loaded:
            return
        split, _ = read_beir_folder(self.data_dir)
        self.dataset = {"default": {"test": split}}
        self.data_loaded = True


def local_retrieval_task(
    data_dir: str | Path,
    name: str = "StdlibDocRetrieval",
    instruction: str | None = None,
    description: str | None = None,
) -> LocalRetrievalTask:
    """An mteb retrieval task over ``data_dir`` (BEIR layout), evaluated on split ``test``, score nDCG@10.

    The files are checked (and hashed) here, so a bad folder fails before any model is loaded.
    """
    _, digest = read_beir_folder(data_dir)
    metadata = TaskMetadata(
        name=name,
        description=description or f"Local BEIR-style retrieval dataset read from {Path(data_dir).resolve()}.",
        reference=None,
        dataset={"path": str(Path(data_dir).resolve()), "revision": digest},
        type="Retrieval",
        category="t2t",
        modalities=["text"],
        eval_splits=["test"],
        eval_langs=["eng-Latn"],
        main_score="ndcg_at_10",
        date=None,
        domains=None,
        task_subtypes=None,
        license=None,
        annotations_creators=None,
        dialect=None,
        sample_creation=None,
        bibtex_citation="",
    )
    # mteb keeps a task's published metadata on its class (unloading data drops instance-level metadata),
    # so each local dataset gets its own subclass
    task_class = type(f"LocalRetrievalTask_{name}", (LocalRetrievalTask,), {"metadata": metadata})
    return task_class(data_dir, instruction)
