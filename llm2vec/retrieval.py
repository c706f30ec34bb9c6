"""Retrieval scores on BEIR-layout folders (:mod:`llm2vec.beir`), as mteb 2 computes them, with the model being trained."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .beir import BeirFolder, read_beir_folder
from .distributed import world

logger = logging.getLogger(__name__)

LOGGED = ("ndcg_at_10", "mrr_at_10", "recall_at_100")  # what a run logs per folder, and the means over the folders
MEAN = "beir_mean"  # the means' name (beir_mean_ndcg_at_10); no folder may have it
RECALL_AT = (1, 10, 100)
PROGRESS_BATCHES = 100  # an embedding of this many batches or more logs its progress about every tenth of them


@contextlib.contextmanager
def measuring(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """``model`` in eval mode (no dropout) with autocast off for a measurement, its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device_type=device.type, enabled=False):
            yield
    finally:
        model.train(was_training)


@dataclass(frozen=True)
class Judgments:
    """The qrels of ``Nq`` queries over ``Nd`` documents (both by index) as tensors, for :func:`ranking_metrics`:
    ``keys`` (``query * Nd + document``, sorted) and ``grades`` of every pair graded > 0, each query's ``ideal_dcg``
    (DCG@10) and count of ``relevant`` documents, and ``tie_order``, the documents by decreasing id."""

    keys: torch.Tensor
    grades: torch.Tensor
    ideal_dcg: torch.Tensor
    relevant: torch.Tensor
    tie_order: torch.Tensor

    @classmethod
    def build(cls, relevant: Sequence[Mapping[int, int]], doc_ids: Sequence[str]) -> Judgments:
        """``relevant[q]``: document index -> grade for query ``q`` (every query has one grade > 0)."""
        nd = len(doc_ids)
        pairs = sorted((q * nd + d, g) for q, grades in enumerate(relevant) for d, g in grades.items() if g > 0)
        ideal = [
            sum(g / math.log2(i + 2) for i, g in enumerate(sorted(grades.values(), reverse=True)[:10]))
            for grades in relevant
        ]
        return cls(
            keys=torch.tensor([k for k, _ in pairs], dtype=torch.long),
            grades=torch.tensor([g for _, g in pairs], dtype=torch.float64),
            ideal_dcg=torch.tensor(ideal, dtype=torch.float64),
            relevant=torch.tensor([sum(g > 0 for g in grades.values()) for grades in relevant], dtype=torch.float64),
            tie_order=torch.tensor(sorted(range(nd), key=doc_ids.__getitem__, reverse=True), dtype=torch.long),
        )

    @classmethod
    def of_folder(cls, folder: BeirFolder) -> Judgments:
        """The judgments of ``folder``'s queries and corpus, both in file order."""
        index = {d: i for i, d in enumerate(folder.corpus)}
        relevant = [{index[d]: g for d, g in folder.relevant[q].items()} for q in folder.queries]
        return cls.build(relevant, list(folder.corpus))


def ranking_metrics(scores: torch.Tensor, judgments: Judgments, first_query: int = 0) -> dict[str, torch.Tensor]:
    """Per-query nDCG@10, MRR@10 and Recall@1/10/100 (docs/design.md; float64, ``(n,)``) of the score rows
    ``scores`` (n, Nd) of the queries ``first_query .. first_query + n - 1`` of ``judgments``."""
    n, nd = scores.shape
    depth = min(100, nd)
    tie = judgments.tie_order.to(scores.device)
    by_score = torch.sort(scores[:, tie], dim=1, descending=True, stable=True).indices[:, :depth]
    ranked = tie[by_score].cpu()  # (n, depth) document indices, best first; equal scores by decreasing id
    queries = torch.arange(first_query, first_query + n)
    keys = queries[:, None] * nd + ranked
    position = torch.searchsorted(judgments.keys, keys).clamp(max=len(judgments.keys) - 1)
    gain = torch.where(judgments.keys[position] == keys, judgments.grades[position], 0.0)  # (n, depth) grades
    top = min(10, depth)
    discount = 1.0 / torch.log2(torch.arange(2, top + 2, dtype=torch.float64))
    found = gain[:, :top] > 0
    first = found.double().argmax(dim=1).double()  # the first document with a grade > 0 (0 when there is none)
    out = {
        "ndcg_at_10": (gain[:, :top] * discount).sum(dim=1) / judgments.ideal_dcg[queries],
        "mrr_at_10": torch.where(found.any(dim=1), 1.0 / (first + 1), 0.0),
    }
    for k in RECALL_AT:
        out[f"recall_at_{k}"] = (gain[:, :k] > 0).sum(dim=1) / judgments.relevant[queries]
    return out


def cosine_metrics(
    queries: torch.Tensor, documents: torch.Tensor, judgments: Judgments, rows: int = 256
) -> dict[str, float]:
    """The means over the queries of :func:`ranking_metrics` of the cosine scores of ``queries`` (Nq, H) against
    ``documents`` (Nd, H), ``rows`` queries at a time."""
    q, d = F.normalize(queries.float(), dim=-1), F.normalize(documents.float(), dim=-1)
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(q), rows):
        for name, values in ranking_metrics(q[start : start + rows] @ d.T, judgments, start).items():
            parts.setdefault(name, []).append(values)
    return {name: float(torch.cat(values).mean()) for name, values in parts.items()}


@torch.no_grad()
def embed_items(
    model, encoder, items: Sequence[tuple[str, str]], batch_size: int, device, what: str = "texts"
) -> torch.Tensor:
    """(N, H) float32 embeddings of ``(instruction, text)`` items in input order, in ``encoder.encode``'s batches,
    each by ``model(features=...)`` (``encoder`` or the trainer's wrapper of it), shared among the processes
    (docs/design.md); every process returns all N rows."""
    order, batches = encoder.length_sorted_batches(items, batch_size)
    rank, size = world()
    mine = list(range(rank, len(batches), size))
    turns = math.ceil(len(batches) / size)
    every = math.ceil(turns / 10) if len(batches) >= PROGRESS_BATCHES else 0
    rows = []
    for turn in range(turns):
        if every and turn % every == 0 and turn:
            logger.info(f"embedding {len(items)} {what}: batch {turn * size} of {len(batches)}")
        b = mine[turn] if turn < len(mine) else 0  # no batch left: batch 0 again, for the same forward count
        embedded = model(features=encoder.padded(batches[b], device)).float()
        rows.append(embedded if turn < len(mine) else embedded[:0])
    local = torch.cat(rows)
    if size > 1:
        local = gather_batches(local, [len(b) for b in batches], turns * batch_size)
    embeddings = torch.empty_like(local)
    embeddings[torch.tensor(order, dtype=torch.long, device=local.device)] = local
    return embeddings


def gather_batches(local: torch.Tensor, sizes: list[int], width: int) -> torch.Tensor:
    """Every rank's rows (its batches r, r + W, ... of ``sizes`` rows; at most ``width``) in batch order, on every
    rank."""
    _, size = world()
    padded = local.new_zeros((width, local.shape[1]))
    padded[: len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous())
    offsets = [0] * size
    out = []
    for b, rows in enumerate(sizes):
        r = b % size
        out.append(parts[r][offsets[r] : offsets[r] + rows])
        offsets[r] += rows
    return torch.cat(out)


def folder_metrics(model, encoder, folder: BeirFolder, instruction: str, batch_size: int, device) -> dict[str, float]:
    """nDCG@10, MRR@10 and Recall@1/10/100 of ``folder``, with its ``queries`` and ``documents`` counts; ``model``
    embeds (``encoder`` or the trainer's wrapper of it), in the mode it is in."""
    judgments = Judgments.of_folder(folder)
    queries = [(instruction, t) for t in folder.queries.values()]
    q = embed_items(model, encoder, queries, batch_size, device, f"queries of {folder.name}")
    documents = [("", folder.document_text(i)) for i in folder.corpus]
    d = embed_items(model, encoder, documents, batch_size, device, f"documents of {folder.name}")
    metrics = cosine_metrics(q, d, judgments)
    return {**metrics, "queries": float(len(folder.queries)), "documents": float(len(folder.corpus))}


@dataclass(frozen=True)
class RetrievalFolder:
    """A folder of a training run's retrieval evaluation: its name (its log keys' prefix), data and instruction."""

    name: str
    data: BeirFolder
    instruction: str


class RetrievalEvaluation:
    """The retrieval evaluation of a training run, called with the model at every evaluation."""

    def __init__(self, folders: Sequence[RetrievalFolder]):
        names = [f.name for f in folders]
        if len(set(names)) != len(names) or MEAN in names:
            raise ValueError(f"retrieval folders need distinct names other than {MEAN!r}, got {names}")
        self.folders = list(folders)

    @classmethod
    def read(cls, folders: Sequence[tuple[str, str]]) -> RetrievalEvaluation:
        """``(folder, instruction)`` pairs, each folder read and checked (queries without a relevant one refused)."""
        read = [read_beir_folder(path, queries_without_relevant="refuse") for path, _ in folders]
        return cls([RetrievalFolder(data.name, data, instruction) for data, (_, instruction) in zip(read, folders)])

    def describe(self, hidden_size: int | None = None) -> list[str]:
        """One line per folder: its size, the texts one evaluation embeds and, given the model's ``hidden_size``,
        the memory of its document embeddings (float32, on every process)."""
        lines = []
        for f in self.folders:
            nq, nd = len(f.data.queries), len(f.data.corpus)
            held = nd * hidden_size * 4 if hidden_size else 0
            memory = f", document embeddings {nd:,} x {hidden_size} x 4 = {held:,} bytes ({held / 1e9:.2f} GB)"
            lines.append(
                f"{f.name}: {nq:,} queries, {nd:,} documents; each evaluation embeds {nq + nd:,} texts"
                f"{memory if held else ''}; instruction {f.instruction!r}"
            )
        return lines

    def __call__(self, model, encoder, batch_size: int, device) -> dict[str, float]:
        """``<folder>_<metric>`` for each folder and metric of :data:`LOGGED`, and ``beir_mean_<metric>``, measured
        with ``model`` (``encoder`` or the trainer's wrapper of it) in eval mode, autocast off."""
        start = time.perf_counter()
        device = torch.device(device)
        with measuring(model, device):
            scores = {
                f.name: folder_metrics(model, encoder, f.data, f.instruction, batch_size, device) for f in self.folders
            }
        out = logged_scores(scores)
        texts = sum(v["queries"] + v["documents"] for v in scores.values())
        logger.info(
            f"retrieval evaluation of {len(scores)} folder(s), {texts:.0f} texts: {time.perf_counter() - start:.1f} s"
        )
        return out


def logged_scores(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """``<folder>_<metric>`` of each folder's scores for each metric of :data:`LOGGED`, and ``beir_mean_<metric>``."""
    out = {f"{name}_{m}": values[m] for name, values in scores.items() for m in LOGGED}
    return out | {f"{MEAN}_{m}": sum(v[m] for v in scores.values()) / len(scores) for m in LOGGED}


def split_log_key(key: str) -> tuple[str, str] | None:
    """``(folder name, metric)`` of a key :class:`RetrievalEvaluation` logs (``eval_`` prefix or not), else None."""
    key = key.removeprefix("eval_")
    for metric in LOGGED:
        if key.endswith(f"_{metric}") and len(key) > len(metric) + 1:
            return key[: -len(metric) - 1], metric
    return None
