"""What the anchor tells the decoder: the anchor's information gain and rank accuracy on held-out pairs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .geometry import anchor_geometry
from .retrieval import measuring

RANK_CANDIDATES = 8
FIRST_TOKENS = 4


def _on(value, device: torch.device):
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _ratio(total: float, count: float) -> float:
    return total / count if count else float("nan")


def _rank_credit(totals: dict[int, float], own: int) -> float:
    """1 / (ties + 1) when ``own`` has the lowest total among ``totals`` (``{candidate: C}``), else 0."""
    mine = totals[own]
    tolerance = 1e-6 * max(1.0, abs(mine))
    if any(c < mine - tolerance for j, c in totals.items() if j != own):
        return 0.0
    return 1.0 / sum(1 for c in totals.values() if abs(c - mine) <= tolerance)


class _Tally:
    """One direction's measures over batches: each pair's ``terms`` (in batch order) and the within-source sums."""

    def __init__(self):
        self.source = {"loss": 0.0, "rolled": 0.0, "hits": 0.0, "chance": 0.0, "tokens": 0, "pairs": 0}
        self.terms: list[dict[str, float]] = []

    def total(self, key: str) -> float:
        return sum(term[key] for term in self.terms)

    def add(self, cross, mask, first, shift, candidates, groups):
        """One batch: ``cross`` (B, B, M) holds c_t(i, j) (NaN where not computed), ``mask`` (B, M) the targets,
        ``first`` their first k."""
        size = mask.shape[0]
        totals = (cross * mask[:, None, :]).sum(-1).tolist()  # totals[i][j] = C_i(j)
        firsts = (cross * first[:, None, :]).sum(-1).tolist()  # the same over the first k targets
        counts, first_counts = mask.sum(-1).tolist(), first.sum(-1).tolist()
        for i in range(size):
            partner = (i + shift) % size
            hit = _rank_credit({j: totals[i][j] for j in ((i + c) % size for c in range(candidates))}, i)
            term = {"loss": totals[i][i], "rolled": totals[i][partner], "tokens": counts[i]}
            term.update(first_loss=firsts[i][i], first_rolled=firsts[i][partner], first_tokens=first_counts[i])
            term.update(hit=hit, chance=1.0 / candidates)
            self.terms.append(term)
        for members in groups:
            n = len(members)
            for p, i in enumerate(members):
                pool = [members[(p + c) % n] for c in range(min(n, candidates))]
                self.source["loss"] += totals[i][i]
                self.source["rolled"] += totals[i][members[(p + n // 2) % n]]
                self.source["tokens"] += int(counts[i])
                self.source["hits"] += _rank_credit({j: totals[i][j] for j in pool}, i)
                self.source["chance"] += 1.0 / len(pool)
                self.source["pairs"] += 1


@torch.no_grad()
def anchor_gain(
    model: torch.nn.Module,
    batches: Iterable[dict],
    device: torch.device | None = None,
    sources: Sequence[Sequence[str]] | None = None,
    first_tokens: int = FIRST_TOKENS,
    rank_candidates: int = RANK_CANDIDATES,
) -> dict[str, float]:
    """The validation reconstruction loss and the anchor measures (docs/design.md) of ``model`` (a Stage I model,
    possibly wrapped) on ``batches`` (collated held-out pairs, at least 2 a batch); ``sources``: each batch's pairs'
    sources, for the measures within a source; ``first_tokens``: k of the gain@k; ``rank_candidates``: R.

    Returns per computed direction ``d``: ``loss_d``, ``rolled_d``, ``anchor_gain_d``, ``anchor_gain_first{k}_d``,
    ``rank_accuracy_d``; ``rank_chance``, ``pairs``; with ``sources`` the ``*_in_source*`` measures; ``geometry_*``.
    """
    tallies, anchors = _tally(model, batches, device, sources, first_tokens, rank_candidates)
    first = next(iter(tallies.values()))
    result: dict[str, float] = {
        "pairs": float(len(first.terms)),
        "rank_chance": first.total("chance") / len(first.terms),
    }
    for direction, t in tallies.items():
        loss, rolled = t.total("loss") / t.total("tokens"), t.total("rolled") / t.total("tokens")
        first_gain = (t.total("first_rolled") - t.total("first_loss")) / max(1, t.total("first_tokens"))
        result.update(
            {
                f"loss_{direction}": loss,
                f"rolled_{direction}": rolled,
                f"anchor_gain_{direction}": rolled - loss,
                f"anchor_gain_first{first_tokens}_{direction}": first_gain,
                f"rank_accuracy_{direction}": t.total("hit") / len(t.terms),
            }
        )
        if sources is not None:
            s = t.source
            result[f"anchor_gain_in_source_{direction}"] = _ratio(s["rolled"] - s["loss"], s["tokens"])
            result[f"rank_accuracy_in_source_{direction}"] = _ratio(s["hits"], s["pairs"])
            result.update(rank_chance_in_source=_ratio(s["chance"], s["pairs"]), pairs_in_source=float(s["pairs"]))
    if anchors:
        e_q, e_d = torch.cat(anchors, dim=1)
        result.update(anchor_geometry(e_q, e_d, [[i] for i in range(len(e_q))]))
    return result


@torch.no_grad()
def pair_terms(
    model: torch.nn.Module,
    batches: Iterable[dict],
    device: torch.device | None = None,
    first_tokens: int = FIRST_TOKENS,
    rank_candidates: int = RANK_CANDIDATES,
) -> dict[str, list[dict[str, float]]]:
    """Each pair's part of :func:`anchor_gain`'s sums per direction, in the batches' order (``loss``, ``rolled``,
    ``tokens``, their ``first_*``, ``hit``, ``chance``), for standard errors over groups of pairs."""
    tallies, _ = _tally(model, batches, device, None, first_tokens, rank_candidates)
    return {direction: t.terms for direction, t in tallies.items()}


def _tally(model, batches, device, sources, first_tokens, rank_candidates) -> tuple[dict[str, _Tally], list]:
    """One :class:`_Tally` per direction over ``batches``, and each batch's anchors (2, B, H)."""
    if first_tokens < 1 or rank_candidates < 2:
        raise ValueError(f"first_tokens must be >= 1 and rank_candidates >= 2, got {first_tokens}, {rank_candidates}")
    device = device or next(model.parameters()).device
    tallies: dict[str, _Tally] = {}
    anchors = []
    with measuring(model, device):
        for b, batch in enumerate(batches):
            batch = _on({k: v for k, v in batch.items() if k != "target_counts"}, device)
            size = batch["query"]["input_ids"].shape[0]
            if size < 2:
                raise ValueError(f"the anchor gain needs batches of at least 2 pairs, got one of {size}")
            shift, candidates = size // 2, min(size, rank_candidates)
            shifts = sorted(set(range(candidates)) | {shift})
            groups = _source_groups(sources[b], size) if sources is not None else []
            if groups:  # the in-source partners and candidates need every shift
                shifts = list(range(size))
            out = dict(model(**batch, anchor_shifts=tuple(shifts)))
            if (pair := out.pop("anchors", None)) is not None:
                anchors.append(pair.float())
            targets = {"q2d": batch["positive_targets"], "d2q": batch["query_targets"]}
            for direction, per_shift in out.items():
                mask = targets[direction]["attention_mask"].float()
                cross = _as_matrix(per_shift, shifts)
                tally = tallies.setdefault(direction, _Tally())
                first = mask * (mask.cumsum(dim=1) <= first_tokens)  # the first real targets of each row
                tally.add(cross, mask, first, shift, candidates, groups)
    if not tallies:
        raise ValueError("the anchor gain needs held-out pairs; got no batches")
    return tallies, anchors


def _as_matrix(per_shift: torch.Tensor, shifts: Sequence[int]) -> torch.Tensor:
    """(B, B, M) with row (i, j) = c(i, j) for the computed (i, j), NaN elsewhere."""
    size, width = per_shift.shape[1], per_shift.shape[2]
    cross = torch.full((size, size, width), float("nan"), dtype=per_shift.dtype, device=per_shift.device)
    rows = torch.arange(size, device=per_shift.device)
    for k, s in enumerate(shifts):
        cross[rows, (rows + s) % size] = per_shift[k]
    return cross  # on the batch's device, as the masks it is weighed with


def _source_groups(labels: Sequence[str], size: int) -> list[list[int]]:
    """The batch positions of each source with at least two pairs in the batch, in batch order."""
    if len(labels) != size:
        raise ValueError(f"sources: {len(labels)} labels for a batch of {size} pairs")
    groups: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        groups.setdefault(label, []).append(i)
    return [members for members in groups.values() if len(members) > 1]
