"""InfoNCE with in-batch and hard negatives (the paper's Stage II loss, Eq. 6-7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import gather_with_grad, positive_labels


def autocast_off(device: torch.device):
    """A context in which autocast is off for ``device``'s type, so operations (and, on CPU, where backward runs on
    the calling thread, the backward ops called inside it) run in their inputs' dtype."""
    return torch.autocast(device_type=device.type, enabled=False)


class InfoNCELoss(nn.Module):
    """Contrastive loss of queries against the positives and hard negatives of the whole global batch.

    Inputs (this process's slice of the global batch, B examples):
        query:    (B, H) query embeddings e_Q.
        positive: (B, H) embeddings of each query's positive document D+.
        negative: (B, H) embeddings of each query's hard negative, or ``None`` (in-batch negatives only).

    Similarity (Eq. 7), with ``scale = 1 / tau``:

        sim(Q, D) = cos(e_Q, e_D) / tau = scale * <e_Q / |e_Q|, e_D / |e_D|>

    Candidates: C = [ all positives of the global batch ; all hard negatives of the global batch ]
    (gathered over data-parallel processes, each part in rank order; :mod:`llm2vec.distributed`). For
    query i its own positive is the target; every other entry of C (the other queries' positives and all
    hard negatives, its own included) is a negative D- (Eq. 6):

        l_i = -log( exp(sim(Q_i, D+_i)) / sum_{D in C} exp(sim(Q_i, D)) )

    The loss is the mean of l_i over this process's B queries, i.e. a cross-entropy over the rows of
    the (B, |C|) score matrix with label ``rank * B + i``. Averaged over processes (DDP's gradient
    average) this is the mean over all queries of the global batch.

    Precision: the normalisation, the score matmul, the softmax and the cross-entropy run in float32 with
    autocast switched off, whatever the embeddings' dtype and whatever autocast surrounds the call (bf16 has 8
    bits of mantissa, coarse on scores of magnitude up to ``scale``). So the plain step, whose loss is computed
    inside the model's ``forward`` under the Trainer's autocast, and the gradient-cached step, whose loss is
    computed outside it, give the same float32 loss.

    ``gather=False`` (``scores`` and ``forward``) takes the given embeddings as the whole batch: nothing is
    gathered and query i's target is candidate i (the validation loss, whose embeddings are gathered already).

    Args:
        scale: 1 / tau. The paper fixes tau = 0.05, so 20 (the default); the authors' code used 50
            (tau = 0.02) without stating it.
    """

    def __init__(self, scale: float = 20.0):
        super().__init__()
        if scale <= 0:
            raise ValueError(f"scale (1 / temperature) must be positive, got {scale}")
        self.scale = float(scale)

    def scores(
        self, query: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor | None = None, gather: bool = True
    ) -> torch.Tensor:
        """(B, |C|) scaled cosine similarities of the local queries to all candidates of the global batch (of the
        given batch with ``gather=False``), in float32 (autocast off)."""
        collect = gather_with_grad if gather else (lambda t: t)
        with autocast_off(query.device):
            q = F.normalize(query.float(), p=2, dim=-1)
            candidates = [collect(F.normalize(positive.float(), p=2, dim=-1))]
            if negative is not None:
                candidates.append(collect(F.normalize(negative.float(), p=2, dim=-1)))
            return self.scale * q @ torch.cat(candidates, dim=0).T

    def forward(
        self,
        query: torch.Tensor,
        positive: torch.Tensor,
        negative: torch.Tensor | None = None,
        gather: bool = True,
    ) -> torch.Tensor:
        if query.shape != positive.shape or (negative is not None and negative.shape != query.shape):
            shapes = [tuple(t.shape) for t in (query, positive, negative) if t is not None]
            raise ValueError(f"query, positive (and negative) embeddings must have the same shape, got {shapes}")
        with autocast_off(query.device):
            scores = self.scores(query, positive, negative, gather)
            if gather:
                labels = positive_labels(query.shape[0], scores.device)
            else:
                labels = torch.arange(query.shape[0], device=scores.device)
            return F.cross_entropy(scores, labels)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"
