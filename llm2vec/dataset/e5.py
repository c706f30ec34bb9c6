"""The public E5 training data, as curated by the echo-embeddings authors."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..keywords import strict_booleans
from .base import SourceStats, TrainDataset, examples_from_records
from .records import DataError, TrainExample, check_path_kind, missing_files, read_jsonl_pairs


@dataclass(frozen=True)
class E5Source:
    paper_name: str  # as written in Table 6
    instructions: tuple[str, ...]  # one, or two that alternate by record position


# Table 6 of the paper, "Instructions used for each of the E5 datasets during fine-tuning"; the keys are the
# file stems (<key>.jsonl in data_dir), which are also the source names.
E5_SOURCES: dict[str, E5Source] = {
    "allnli": E5Source(
        "NLI",
        (
            "Given a premise, retrieve a hypothesis that is entailed by the premise",
            "Retrieve semantically similar text",
        ),
    ),
    "dureader": E5Source("DuReader", ("Given a Chinese search query, retrieve web passages that answer the question",)),
    "eli5_question_answer": E5Source(
        "ELI5", ("Provided a user question, retrieve the highest voted answers on Reddit ELI5 forum",)
    ),
    "fever": E5Source("FEVER", ("Given a claim, retrieve documents that support or refute the claim",)),
    "hotpot_qa": E5Source(
        "HotpotQA", ("Given a multi-hop question, retrieve documents that can help answer the question",)
    ),
    "miracl": E5Source("MIRACL", ("Given a question, retrieve Wikipedia passages that answer the question",)),
    "mrtydi": E5Source("MrTyDi", ("Given a question, retrieve Wikipedia passages that answer the question",)),
    "msmarco_passage": E5Source(
        "MSMARCO Passage", ("Given a web search query, retrieve relevant passages that answer the query",)
    ),
    "msmarco_document": E5Source(
        "MSMARCO Document", ("Given a web search query, retrieve relevant documents that answer the query",)
    ),
    "nq": E5Source("NQ", ("Given a question, retrieve Wikipedia passages that answer the question",)),
    "quora_duplicates": E5Source(
        "QuoraDuplicates",
        (
            "Given a question, retrieve questions that are semantically equivalent to the given question",
            "Find questions that have the same meaning as the input question",
        ),
    ),
    "squad": E5Source("SQuAD", ("Retrieve Wikipedia passages that answer the question",)),
    "t2ranking": E5Source(
        "T2Ranking", ("Given a Chinese search query, retrieve web passages that answer the question",)
    ),
    "trivia_qa": E5Source("TriviaQA", ("Retrieve Wikipedia passages that answer the question",)),
}


def e5_instruction(source: str, position: int) -> str:
    """The query instruction of record number ``position`` (0-based) of ``source``."""
    instructions = E5_SOURCES[source].instructions
    return instructions[position % len(instructions)]


@strict_booleans
def load_e5(
    data_dir: str,
    global_batch_size: int = 512,
    seed: int = 42,
    sources: list[str] | None = None,
    max_per_source: int | None = None,
    require_negative: bool = True,
    validation_size: float = 0,
) -> TrainDataset:
    """The E5 files of ``data_dir`` (``sources``: keys of :data:`E5_SOURCES`, default all; at most ``max_per_source``
    first records each) in single-source global batches (:meth:`TrainDataset.from_sources`). Raises
    :class:`DataError` for an unknown source, a file as ``data_dir``, missing files (all in one error), a malformed
    line, or too little data for one global batch."""
    names = list(E5_SOURCES) if sources is None else list(dict.fromkeys(sources))
    unknown = [n for n in names if n not in E5_SOURCES]
    if unknown:
        raise DataError(f"e5_sources: unknown E5 source(s) {unknown}; the sources are: {', '.join(E5_SOURCES)}")
    if not names:
        raise DataError("e5_sources is empty; leave it out (or pass None) for all E5 sources")
    if max_per_source is not None and max_per_source < 1:
        raise ValueError(f"max_per_source must be positive or None, got {max_per_source}")

    check_path_kind(os.fspath(data_dir), "E5")
    paths = {n: os.path.join(data_dir, f"{n}.jsonl") for n in names}
    missing = missing_files(paths.values())
    if missing:
        listing = "\n".join(f"  - {p}  ({E5_SOURCES[n].paper_name})" for n, p in paths.items() if p in missing)
        raise DataError(
            f"{len(missing)} of {len(paths)} E5 training files are missing:\n{listing}\nDownload the public E5 "
            "training data curated by the echo-embeddings authors (linked from "
            f"https://github.com/jakespringer/echo-embeddings#training) and put its .jsonl files in {data_dir}/, or "
            "pass sources=[...] to train on the files you have."
        )

    fix = "Fix or delete this line, or download the file again (echo-embeddings training data)."
    examples_by_source: dict[str, list[TrainExample]] = {}
    stats: dict[str, SourceStats] = {}
    for name, path in paths.items():
        records, report = read_jsonl_pairs(
            path, require_negative=require_negative, read_instruction=False, limit=max_per_source, fix=fix
        )
        stats[name] = SourceStats(name=name)
        stats[name].add_report(report)
        examples_by_source[name] = examples_from_records(records, name, lambda r, n=name: e5_instruction(n, r.index))
    return TrainDataset.from_sources(examples_by_source, global_batch_size, seed, stats, validation_size)
