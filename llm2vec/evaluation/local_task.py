"""A local BEIR-style retrieval dataset as an mteb 2.x retrieval task (no hub access).

The folder holds three JSON-lines files:

- ``corpus.jsonl``: ``{"_id", "title", "text"}`` (``title`` optional);
- ``queries.jsonl``: ``{"_id", "text"}``;
- ``qrels.jsonl``: ``{"query-id", "corpus-id", "score"}``.

:func:`local_retrieval_task` reads them into the ``RetrievalSplitData`` that mteb's own retrieval tasks
use (one ``default`` subset, one ``test`` split), so ``mteb.evaluate`` scores it like any retrieval task
(main score nDCG@10) and writes ``<name>.json`` into the results cache. Queries with no qrels line, or
whose grades are all 0, are left out with a warning (they have nothing to find); a line that is not a JSON
object or lacks a field, and whatever would make the score meaningless (an id given twice, a qrels line
naming an unknown query or document or repeating a pair, a grade that is not a whole number >= 0, no
relevant document at all) is an error naming ``file:line`` (the reader: :func:`llm2vec.beir.read_beir_folder`). The dataset "revision" in the task
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

from .. import beir
from .paths import check_name


def read_beir_folder(data_dir: str | Path) -> tuple[RetrievalSplitData, str]:
    """The split data of a BEIR-style folder and a short hash of its files.

    Read and checked by :func:`llm2vec.beir.read_beir_folder`: what cannot give a meaningful score is a ``ValueError``
    naming ``file:line``; queries with no qrels line, or whose grades are all 0, have nothing to find and are left
    out, with a warning that counts them.
    """
    folder = beir.read_beir_folder(data_dir, queries_without_relevant="leave_out")
    split = RetrievalSplitData(
        corpus=Dataset.from_list(
            [{"id": doc_id, "title": title, "text": text} for doc_id, (title, text) in folder.corpus.items()]
        ),
        queries=Dataset.from_list([{"id": qid, "text": text} for qid, text in folder.queries.items()]),
        relevant_docs=folder.relevant,
        top_ranked=None,
    )
    return split, folder.digest


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

    The files are checked (and hashed) here, so a bad folder fails before any model is loaded. ``name``
    becomes the results file's name (``<name>.json``): it must be a plain file name
    (:func:`llm2vec.evaluation.paths.check_name`).
    """
    check_name(name, "task name")
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
