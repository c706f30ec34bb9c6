"""InfoNCE with in-batch and hard negatives (the paper's Stage II loss, Eq. 6-7)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import gather_with_grad, positive_labels


def autocast_off(device: torch.device):
    """A context in which autocast is off for ``device``'s type: operations run in their inputs' dtype."""
    return torch.autocast(device_type=device.type, enabled=False)


class InfoNCELoss(nn.Module):
    """Contrastive loss of queries against the positives and hard negatives of the whole global batch.

    Inputs (this process's slice, B examples): ``query``, ``positive`` (B, H) and ``negative`` (B, H) or
    ``None`` (in-batch negatives only). With ``scale = 1 / tau`` and C = all positives then all hard negatives
    of the global batch (gathered in rank order; query i's target is candidate ``rank * B + i``):

        sim(Q, D) = scale * <e_Q / |e_Q|, e_D / |e_D|>                          (Eq. 7)
        l_i = -log( exp(sim(Q_i, D+_i)) / sum_{D in C} exp(sim(Q_i, D)) )      (Eq. 6)

    The loss is the mean of l_i over this process's queries, computed in float32 with autocast off.
    ``gather=False`` takes the given embeddings as the whole batch (query i's target is candidate i).

    Args:
        scale: 1 / tau; the paper's tau = 0.05 gives 20 (the default).
    """

    def __init__(self, scale: float = 20.0):
        super().__init__()
        if scale <= 0:
            raise ValueError(f"scale (1 / temperature) must be positive, got {scale}")
        self.scale = float(scale)

    def scores(
        self, query: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor | None = None, gather: bool = True
    ) -> torch.Tensor:
        """(B, |C|) scaled cosine similarities (float32) of the local queries to all candidates of the global batch
        (of the given batch with ``gather=False``)."""
        collect = gather_with_grad if gather else (lambda t: t)
        with autocast_off(query.device):
            q = F.normalize(query.float(), p=2, dim=-1)
            candidates = [collect(F.normalize(positive.float(), p=2, dim=-1))]
            if negative is not None:
                candidates.append(collect(F.normalize(negative.float(), p=2, dim=-1)))
            return self.scale * q @ torch.cat(candidates, dim=0).T

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor | None = None, gather: bool = True
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
