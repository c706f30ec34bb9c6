"""Pieces of the Stage II gradient cache (GradCache, Gao et al. 2021): token-budget chunks and RNG replay.

The contrastive loss couples every text of a batch, so the batch cannot simply be split like gradient
accumulation. GradCache computes the same gradient with the activations of one chunk at a time:

1. embed every chunk without a graph (``torch.no_grad``), recording the RNG state before each chunk;
2. compute the loss over all embeddings, made leaf tensors, and back-propagate it to them only:
   ``g = d L / d e`` (the cache; no parameter is touched);
3. embed each chunk again, with a graph, restoring its RNG state (dropout draws the same masks), and
   back-propagate ``g`` of its rows through it: ``sum_rows <g_row, d e_row / d theta>`` summed over chunks
   is ``d L / d theta`` by the chain rule.

This module holds the model-independent parts: the rows of a padded batch (:func:`rows_of`), the
chunk plan (:func:`plan_chunks`), re-padding a chunk (:func:`collate_rows`) and the RNG state
(:class:`RngState`). :meth:`llm2vec.llm2vec_contrastive.LLM2VecContrastive.step_in_parts` runs the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FEATURE_KEYS = ("input_ids", "attention_mask", "text_mask")


def rows_of(features: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The rows of a padded batch (``pad_batch``'s keys), each cut to its real tokens (``attention_mask == 1``,
    contiguous on either padding side): a list of dicts of 1-D tensors."""
    mask = features["attention_mask"].bool()
    return [{k: features[k][row][mask[row]] for k in FEATURE_KEYS} for row in range(mask.shape[0])]


def plan_chunks(lengths: Sequence[int], budget: int, min_chunks: int = 1) -> list[list[int]]:
    """Split rows of these token lengths into chunks whose padded size stays within ``budget`` tokens.

    Rows are sorted by length, longest first (ties keep their input order), and cut greedily: a row
    joins the current chunk while ``rows x longest row`` (the chunk's padded size, its first row being
    its longest) stays <= ``budget``. A row longer than the budget is a chunk of its own. While there are
    fewer than ``min_chunks`` chunks (at most one per row), the chunk of the largest padded size is cut
    in two halves. Returns the rows' input indices per chunk, in sorted order; every index appears once.
    """
    if budget < 1:
        raise ValueError(f"budget must be a positive number of tokens, got {budget}")
    if not 1 <= min_chunks <= max(1, len(lengths)):
        raise ValueError(f"min_chunks must be between 1 and the number of rows ({len(lengths)}), got {min_chunks}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    for i in order:
        if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= budget:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    while len(chunks) < min_chunks:
        k = max(
            (k for k in range(len(chunks)) if len(chunks[k]) > 1), key=lambda k: len(chunks[k]) * lengths[chunks[k][0]]
        )
        half = (len(chunks[k]) + 1) // 2
        chunks[k : k + 1] = [chunks[k][:half], chunks[k][half:]]
    return chunks


def collate_rows(rows: Sequence[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows from :func:`rows_of` into one batch (the masks are 0 on the padding)."""
    width = max(len(r["input_ids"]) for r in rows)
    first = rows[0]
    out = {
        "input_ids": torch.full(
            (len(rows), width), pad_token_id, dtype=first["input_ids"].dtype, device=first["input_ids"].device
        )
    }
    for k in ("attention_mask", "text_mask"):
        out[k] = torch.zeros((len(rows), width), dtype=first[k].dtype, device=first[k].device)
    for i, r in enumerate(rows):
        for k in FEATURE_KEYS:
            out[k][i, : len(r[k])] = r[k]
    return out


@dataclass
class RngState:
    """The RNG state dropout draws from: torch's CPU generator and, on a CUDA device, that device's generator."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
