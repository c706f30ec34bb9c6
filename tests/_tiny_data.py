"""Tiny data folders of random words for the tests, written offline: E5-layout training files and BEIR-layout
retrieval folders (the vocabulary is :mod:`llm2vec.testing`'s built-in corpus, which its tiny tokenizers cover)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llm2vec.testing import _CORPUS


def _word_picker(seed: int):
    """``(pick, generator)``: ``pick(k)`` is ``k`` words of the built-in corpus drawn with ``generator`` (seeded)."""
    words = " ".join(_CORPUS).replace(".", "").replace(",", "").split()
    g = torch.Generator().manual_seed(seed)

    def pick(k: int) -> str:
        return " ".join(words[i] for i in torch.randint(len(words), (k,), generator=g))

    return pick, g


def write_tiny_e5(folder: str | Path, n: int = 24, sources: tuple[str, ...] = ("nq", "fever"), seed: int = 0) -> Path:
    """E5-layout training files (``<source>.jsonl`` with query/positive/negative) of random words, offline."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pick, g = _word_picker(seed)
    for source in sources:
        with open(folder / f"{source}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps({"query": pick(5), "positive": pick(14), "negative": pick(9)}) + "\n")
    return folder


def write_tiny_beir(
    folder: str | Path, queries: int = 12, documents: int = 40, seed: int = 0, titles: bool = True
) -> Path:
    """A BEIR-layout retrieval folder (corpus.jsonl, queries.jsonl, qrels.jsonl) of random words, offline: each query
    has one to three judged documents graded 0, 1 or 2, at least one of them above 0; some documents have a title."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pick, g = _word_picker(seed)
    with open(folder / "corpus.jsonl", "w") as f:
        for d in range(documents):
            title = pick(2) if titles and d % 3 == 0 else ""
            f.write(json.dumps({"_id": f"d{d}", "title": title, "text": pick(12)}) + "\n")
    with open(folder / "queries.jsonl", "w") as f:
        for q in range(queries):
            f.write(json.dumps({"_id": f"q{q}", "text": pick(5)}) + "\n")
    with open(folder / "qrels.jsonl", "w") as f:
        for q in range(queries):
            judged = torch.randperm(documents, generator=g)[: 1 + q % 3].tolist()
            for k, d in enumerate(judged):
                grade = 1 + (q + k) % 2 if k == 0 else (q + k) % 3
                f.write(json.dumps({"query-id": f"q{q}", "corpus-id": f"d{d}", "score": grade}) + "\n")
    return folder
