"""The geometry of anchor embeddings, raw and centred: a diagnostic, not part of the method (docs/design.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

TIE = 1e-9  # scores closer than this count as equal
SIDES = ("query", "document")


def _float64(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached in float64, on its device if that is a GPU (CUDA), else on the CPU (MPS has no float64)."""
    return x.detach().to(device=x.device if x.device.type == "cuda" else "cpu", dtype=torch.float64)


def variants(queries: torch.Tensor, documents: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"": (queries, documents), "_centred": (each minus its own mean row)}`` in float64 (:func:`_float64`)."""
    q, d = _float64(queries), _float64(documents)
    return {"": (q, d), "_centred": (q - q.mean(0), d - d.mean(0))}


def side_measures(rows: torch.Tensor) -> dict[str, float]:
    """``cosine``, ``top_share`` and ``effective_rank`` of one side's rows (n, H); NaN for fewer than 2 rows or all
    rows zero. The s_k^2 are the eigenvalues of the smaller Gram matrix of U."""
    n = rows.shape[0]
    u = F.normalize(_float64(rows), dim=-1)
    power = torch.linalg.eigvalsh(u @ u.T if n <= u.shape[1] else u.T @ u).clamp(min=0)
    if n < 2 or not power.sum() > 0:
        return dict.fromkeys(("cosine", "top_share", "effective_rank"), math.nan)
    p = power / power.sum()
    p = p[p > 0]
    return {
        "cosine": float((u.sum(0).square().sum() - n) / (n * (n - 1))),
        "top_share": float(p.max()),
        "effective_rank": float(torch.exp(-(p * p.log()).sum())),
    }


def _harmonic(n: torch.Tensor) -> torch.Tensor:
    """H_n = 1 + 1/2 + ... + 1/n (H_0 = 0) of whole numbers n, in float64."""
    return torch.special.digamma(n.double() + 1) + 0.5772156649015329


def query_terms(
    queries: torch.Tensor, documents: torch.Tensor, relevant: Sequence[Sequence[int]], scale: float, rows: int = 256
) -> dict[str, torch.Tensor]:
    """Each query's ``infonce``, ``accuracy_at_1`` and ``mrr`` (float64, (Nq,)) against all ``documents``;
    ``relevant[i]``: the indices of query i's relevant documents (at least one)."""
    if len(relevant) != len(queries) or any(len(r) == 0 for r in relevant):
        raise ValueError(f"relevant: one non-empty list of document indices per query ({len(queries)}) is needed")
    q, d = (F.normalize(_float64(x), dim=-1) for x in (queries, documents))
    parts: dict[str, list[torch.Tensor]] = {"infonce": [], "accuracy_at_1": [], "mrr": []}
    for start in range(0, len(q), rows):
        z = scale * (q[start : start + rows] @ d.T)
        mask = torch.zeros_like(z, dtype=torch.bool)
        marked = torch.tensor([(i, j) for i, docs in enumerate(relevant[start : start + rows]) for j in docs])
        mask[marked[:, 0].to(z.device), marked[:, 1].to(z.device)] = True
        parts["infonce"].append(-(z.log_softmax(-1) * mask).sum(-1) / mask.sum(-1))
        best = z.masked_fill(~mask, -math.inf).max(-1, keepdim=True).values
        above = ((z > best + TIE) & ~mask).sum(-1)
        ties = (((z - best).abs() <= TIE) & ~mask).sum(-1)
        parts["accuracy_at_1"].append(torch.where(above == 0, 1.0 / (ties + 1.0), 0.0).double())
        parts["mrr"].append((_harmonic(above + ties + 1) - _harmonic(above)) / (ties + 1))
    return {name: torch.cat(values) for name, values in parts.items()}


def anchor_geometry(
    queries: torch.Tensor, documents: torch.Tensor, relevant: Sequence[Sequence[int]], scale: float = 20.0
) -> dict[str, float]:
    """Every measure, raw and centred, of ``queries`` (Nq, H) against ``documents`` (Nd, H) at ``scale`` = 1 / tau:
    ``geometry_<measure>_<side>[_centred]``, ``geometry_<measure>[_centred]`` (the query means), and the chances
    ``geometry_infonce_chance`` (ln N) and ``geometry_accuracy_at_1_chance`` (the mean |R| / N)."""
    out: dict[str, float] = {}
    for suffix, (q, d) in variants(queries, documents).items():
        for side, rows in zip(SIDES, (q, d)):
            out.update({f"geometry_{k}_{side}{suffix}": v for k, v in side_measures(rows).items()})
        terms = query_terms(q, d, relevant, scale)
        out.update({f"geometry_{k}{suffix}": float(v.mean()) for k, v in terms.items()})
    n = documents.shape[0]
    out["geometry_infonce_chance"] = math.log(n)
    out["geometry_accuracy_at_1_chance"] = sum(len(set(r)) for r in relevant) / (n * len(relevant))
    return out
