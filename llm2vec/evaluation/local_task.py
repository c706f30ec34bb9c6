"""A local BEIR-style retrieval folder (:func:`llm2vec.beir.read_beir_folder`) as an mteb 2.x retrieval task: one
``default`` subset, one ``test`` split, main score nDCG@10, no hub access."""

from __future__ import annotations

import functools
import importlib
import logging
from pathlib import Path
from typing import Any

from datasets import Dataset
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.task_metadata import TaskMetadata

from .. import beir
from .paths import check_name

logger = logging.getLogger(__name__)


NOT_KNOWN = ("date", "domains", "task_subtypes", "license", "annotations_creators", "dialect", "sample_creation")


class TaskNameError(ValueError):
    """A local task's name that is the name of a task mteb knows (one line)."""


@functools.lru_cache(maxsize=1)
def mteb_registry() -> dict[str, type]:
    """Name -> class of every task in mteb's registry (read offline)."""
    return {cls.metadata.name: cls for cls in importlib.import_module("mteb.get_tasks").TASK_LIST}


@functools.lru_cache(maxsize=1)
def _mteb_task_names() -> dict[str, str]:
    """Lower-cased name -> name of every task mteb knows, including old names it still answers to."""
    renames = getattr(importlib.import_module("mteb.get_tasks"), "_TASK_RENAMES", {})
    return {name.lower(): name for name in [*mteb_registry(), *renames]}


def check_local_task_name(name: str, what: str = "local task name") -> str:
    """``name`` unless it is, without case, the name of a task mteb knows (its results would be stored and found as
    that task's): then :class:`TaskNameError`."""
    known = _mteb_task_names().get(name.lower())
    if known is not None:
        same = f"the mteb task {known!r}" if known == name else f"the mteb task {known!r} (names differ only in case)"
        raise TaskNameError(
            f"{what} {name!r} is the name of {same}; its results would be stored and found as that task's: choose "
            f"another name (say {name + '-local'!r})"
        )
    return name


def read_beir_files(data_dir: str | Path) -> tuple[RetrievalSplitData, dict[str, str], str]:
    """The split data of a BEIR-style folder (queries with nothing to find left out), the SHA-256 of each of its
    files and a short hash of the three."""
    folder = beir.read_beir_folder(data_dir, queries_without_relevant="leave_out")
    split = RetrievalSplitData(
        corpus=Dataset.from_list(
            [{"id": doc_id, "title": title, "text": text} for doc_id, (title, text) in folder.corpus.items()]
        ),
        queries=Dataset.from_list([{"id": qid, "text": text} for qid, text in folder.queries.items()]),
        relevant_docs=folder.relevant,
        top_ranked=None,
    )
    return split, folder.file_sha256, folder.digest


class LocalRetrievalTask(AbsTaskRetrieval):
    """A retrieval task whose data come from a local folder (see the module docstring)."""

    metadata: TaskMetadata  # set on the per-dataset subclass that local_retrieval_task creates

    def __init__(self, data_dir: str | Path, instruction: str | None = None, **kwargs: Any):
        self.data_dir = Path(data_dir)
        self.file_sha256: dict[str, str] | None = None  # file -> SHA-256 of the files this task scores
        super().__init__(**kwargs)
        if instruction is not None:
            self.instruction = instruction

    @property
    def instruction(self) -> str | None:
        """The query instruction: the metadata's ``prompt["query"]`` (``""``: none, by choice; None: not given)."""
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
        split, file_sha256, _ = read_beir_files(self.data_dir)
        if self.file_sha256 is not None and file_sha256 != self.file_sha256:
            changed = [name for name in beir.FILES if file_sha256[name] != self.file_sha256[name]]
            raise ValueError(
                f"local retrieval folder {str(self.data_dir)!r}: {', '.join(changed)} changed after the task was made "
                "from it; its result would be recorded as computed from the files read then. Make the task again "
                "(run the command again) once the folder is as it should be"
            )
        self.file_sha256 = file_sha256
        self.dataset = {"default": {"test": split}}
        self.data_loaded = True


def local_retrieval_task(
    data_dir: str | Path,
    name: str = "StdlibDocRetrieval",
    instruction: str | None = None,
    *,
    allow_mteb_name: bool = False,
) -> LocalRetrievalTask:
    """An mteb retrieval task over ``data_dir`` (BEIR layout), checked and hashed now; ``name``: a plain file name,
    unless ``allow_mteb_name`` not an mteb task's (its results are keyed as this folder's either way)."""
    check_name(name, "task name")
    if not allow_mteb_name:
        check_local_task_name(name, "task name")
    _, file_sha256, digest = read_beir_files(data_dir)
    metadata = TaskMetadata(
        name=name,
        description=f"Local BEIR-style retrieval dataset read from {Path(data_dir).resolve()}.",
        reference=None,
        dataset={"path": str(Path(data_dir).resolve()), "revision": digest},
        type="Retrieval",
        category="t2t",
        modalities=["text"],
        eval_splits=["test"],
        eval_langs=["eng-Latn"],
        main_score="ndcg_at_10",
        bibtex_citation="",
        **dict.fromkeys(NOT_KNOWN),  # of a local folder
    )
    # mteb keeps a task's published metadata on its class (unloading data drops instance-level metadata),
    # so each local dataset gets its own subclass
    task_class = type(f"LocalRetrievalTask_{name}", (LocalRetrievalTask,), {"metadata": metadata})
    task = task_class(data_dir, instruction)
    task.file_sha256 = file_sha256
    return task
