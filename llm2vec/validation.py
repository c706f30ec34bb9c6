"""Stage II's measures on held-out pairs while it trains: the validation InfoNCE loss and retrieval quality."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .distributed import world
from .geometry import anchor_geometry
from .loss.infonce import InfoNCELoss
from .retrieval import Judgments, cosine_metrics, gather_batches, measuring

SIDES = ("query", "positive", "negative")


def retrieval_metrics(queries: torch.Tensor, documents: torch.Tensor, relevant: torch.Tensor) -> dict[str, float]:
    """nDCG@10, Recall@1/10 and MRR@10 of ``queries`` against ``documents``, query i's relevant one ``relevant[i]``."""
    judgments = Judgments.build([{int(d): 1} for d in relevant], [f"{d:09d}" for d in range(len(documents))])
    metrics = cosine_metrics(queries, documents, judgments)
    return {name: metrics[name] for name in ("ndcg_at_10", "recall_at_1", "recall_at_10", "mrr_at_10")}


@torch.no_grad()
def embed_triples(
    model: torch.nn.Module,
    triples: Sequence,
    collate: Callable[[Sequence], dict],
    batch_size: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Embeddings (N, H) of each side of ``triples`` (``collate``: a training batch of them), each process
    embedding its shard with ``model(features=...)``, gathered in the triples' order (docs/design.md)."""
    rank, size = world()
    shard = list(triples[rank::size])
    batches = max(1, math.ceil(math.ceil(len(triples) / size) / batch_size))  # the same count on every process
    out: dict[str, list[torch.Tensor]] = {}
    for b in range(batches):
        part = shard[b * batch_size : (b + 1) * batch_size]
        padding = not part  # a process whose shard ran out embeds a copy of its first triple, then drops it
        batch = collate(part or shard[:1] or list(triples[:1]))
        for side in SIDES:
            if batch.get(side) is None:
                continue
            features = {k: v.to(device) for k, v in batch[side].items()}
            embedded = model(features=features).float()
            out.setdefault(side, []).append(embedded[:0] if padding else embedded)
    gathered = {side: torch.cat(parts) for side, parts in out.items()}
    if size > 1:  # the shards back in triple order: batches of one triple, batch b embedded by rank b mod W
        width = math.ceil(len(triples) / size)
        gathered = {side: gather_batches(rows, [1] * len(triples), width) for side, rows in gathered.items()}
    return gathered


def contrastive_validation(
    model: torch.nn.Module,
    triples: Sequence,
    collate: Callable[[Sequence], dict],
    batch_size: int,
    contrastive_batch: int,
    scale: float,
    device: torch.device,
) -> dict[str, float]:
    """The validation InfoNCE loss and the retrieval metrics of ``triples``, measured with ``model`` (the Stage II
    model as the trainer wraps it) in eval mode, autocast off."""
    with measuring(model, device):
        e = embed_triples(model, triples, collate, batch_size, device)
    n = len(triples)
    infonce = InfoNCELoss(scale)  # Eq. 6-7 in float32; the embeddings are gathered already: gather=False
    loss = 0  # the sum over batches of the training loss's size of each batch's mean times its size
    for i in range(0, n, contrastive_batch):
        rows = slice(i, i + contrastive_batch)
        negative = e["negative"][rows] if "negative" in e else None
        loss = loss + infonce(e["query"][rows], e["positive"][rows], negative, gather=False) * (min(n, rows.stop) - i)
    corpus: dict[str, int] = {}
    relevant = [corpus.setdefault(t.positive, len(corpus)) for t in triples]
    first = torch.tensor([relevant.index(j) for j in range(len(corpus))])  # a row of each distinct positive
    metrics = retrieval_metrics(e["query"], e["positive"][first], torch.tensor(relevant))
    metrics.update(anchor_geometry(e["query"], e["positive"][first], [[r] for r in relevant], scale))
    return {"loss": float(loss) / n, **metrics, "queries": float(n), "documents": float(len(corpus))}
