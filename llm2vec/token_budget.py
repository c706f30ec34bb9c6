"""Token-budget chunks of a Stage I batch: which pairs go through the decoder together.

A Stage I batch of B (query, document) pairs makes up to four decoder calls, each over a (B, width)
padded tensor: the encoding passes of the queries and of the documents, and the reconstruction passes
q2d (anchor + document targets) and d2q (anchor + query targets). Pair i's real length in call c is
``lengths[i][c]`` (:func:`decoder_call_lengths`); a set of pairs run together costs

    cost(pairs) = |pairs| * sum_c max_{i in pairs} lengths[i][c]

decoder positions, padding included (each call is padded to its longest row); with packing
(:mod:`llm2vec.packing`) there is no padding and a chunk costs the sum of its pairs' lengths. Splitting the batch into
chunks of pairs whose cost stays under a budget bounds the activations of one forward/backward, and
grouping pairs of similar length cuts the padding. Each pair's loss terms depend on that pair only and
the loss is a sum of token NLLs divided by step-wide counts, so the chunks' gradients add up to the
batch's gradient exactly (:meth:`llm2vec.llm2vec_q2d_d2q.LLM2Vec_q2d_d2q.step_in_parts`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

COUNTS_KEY = "target_counts"


def decoder_call_lengths(batch: dict, directions: Sequence[str]) -> torch.Tensor:
    """(B, C) real positions of each pair in each decoder call: the query and document encoding passes, then
    for each direction computed (``"q2d"``, ``"d2q"``) its reconstruction pass (the anchor + the targets)."""
    columns = [batch["query"]["attention_mask"].sum(1), batch["positive"]["attention_mask"].sum(1)]
    targets = {"q2d": "positive_targets", "d2q": "query_targets"}
    columns += [1 + batch[targets[d]]["attention_mask"].sum(1) for d in directions]
    return torch.stack(columns, dim=1)


def decoder_positions(batch: dict, directions: Sequence[str], packed: bool = False) -> int:
    """Positions the decoder calls of ``batch`` process, padding included: B times the sum of the widths
    (packed: the real positions, there being no padding)."""
    if packed:
        return int(decoder_call_lengths(batch, directions).sum())
    widths = [batch["query"]["input_ids"].shape[1], batch["positive"]["input_ids"].shape[1]]
    targets = {"q2d": "positive_targets", "d2q": "query_targets"}
    widths += [1 + batch[targets[d]]["input_ids"].shape[1] for d in directions]
    return batch["query"]["input_ids"].shape[0] * sum(widths)


def chunk_cost(lengths: Sequence[Sequence[int]], pairs: Sequence[int], packed: bool = False) -> int:
    """Padded decoder positions of running ``pairs`` together (the module docstring's cost); packed, their
    real positions."""
    if not pairs:
        return 0
    if packed:
        return sum(sum(lengths[i]) for i in pairs)
    calls = len(lengths[pairs[0]])
    return len(pairs) * sum(max(lengths[i][c] for i in pairs) for c in range(calls))


def token_budget_chunks(lengths: Sequence[Sequence[int]], budget: int, packed: bool = False) -> list[list[int]]:
    """Chunks of pair indices, each costing at most ``budget`` positions (:func:`chunk_cost`, padded or packed).

    Pairs are taken longest first (by total length; ties by index) and added greedily to the current chunk
    while it stays within the budget; a pair that alone exceeds the budget is a chunk by itself. Every pair
    is in exactly one chunk; within a chunk the indices are ascending.
    """
    if budget < 1:
        raise ValueError(f"budget must be positive, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-sum(lengths[i]), i))
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and chunk_cost(lengths, current + [i], packed) > budget:
            chunks.append(sorted(current))
            current = []
        current.append(i)
    if current:
        chunks.append(sorted(current))
    return chunks


def _select_rows(features: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows of a padded ``{"input_ids", "attention_mask", ...}`` dict, cut to the columns where one of them
    has a real token. That works for either padding side (the kept columns are a prefix for right padding,
    a suffix for left padding); every tensor is new, the batch's own are not changed."""
    mask = features["attention_mask"].index_select(0, rows)
    keep = mask.bool().any(dim=0).nonzero().squeeze(1)
    return {name: value.index_select(0, rows).index_select(1, keep) for name, value in features.items()}


def select_pairs(batch: dict, pairs: Sequence[int]) -> dict:
    """The sub-batch of ``pairs``, each padded tensor trimmed to the sub-batch's longest row; the step-wide
    ``target_counts`` are kept as they are (every chunk divides by the same counts)."""
    rows = torch.tensor(list(pairs), dtype=torch.long, device=batch["query"]["input_ids"].device)
    return {name: value if name == COUNTS_KEY else _select_rows(value, rows) for name, value in batch.items()}
