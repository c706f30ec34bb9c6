"""Batch construction and pooling: pure, vectorised functions over explicitly built masks.

Masks are built once here (by :func:`pad_batch`) and never modified afterwards:

- ``attention_mask`` (B, T): 1 on every real token (template prefix, instruction, text, anchor).
- ``text_mask`` (B, T): 1 on the text tokens and the anchor; 0 on the template prefix and the
  instruction, and on padding. Mean pooling averages over it, so instructions never enter an embedding.

Padding may be on either side; pooling locates tokens through the masks, not through fixed columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .templates import EncodedText

POOLING_MODES = ("eos_token", "last_token", "mean", "weighted_mean")


def pad_batch(
    encoded: Sequence[EncodedText], pad_token_id: int, padding_side: str = "right"
) -> dict[str, torch.Tensor]:
    """Pad token ids to one (B, T) tensor and build ``attention_mask`` and ``text_mask`` for them."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    width = max(len(e.input_ids) for e in encoded)
    input_ids = torch.full((len(encoded), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    text_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, e in enumerate(encoded):
        offset = width - len(e.input_ids) if padding_side == "left" else 0
        input_ids[row, offset : offset + len(e.input_ids)] = torch.tensor(e.input_ids)
        attention_mask[row, offset : offset + len(e.input_ids)] = 1
        text_mask[row, offset + e.text_start : offset + len(e.input_ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "text_mask": text_mask}


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions 0..n-1 over the real tokens of each row, whatever the padding side (padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Column of the last real token of each row (the anchor), for left or right padding."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return torch.where(attention_mask.bool(), columns, -1).max(dim=1).values


def pool(hidden_states: torch.Tensor, attention_mask: torch.Tensor, text_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One vector per row of ``hidden_states`` (B, T, H).

    - ``eos_token`` (the paper's Eq. 1): the hidden state at the anchor, the last real token.
    - ``last_token``: the hidden state at the last token before the anchor (the text's last token).
    - ``mean``: the mean over ``text_mask`` (text and anchor; no prefix, no instruction).
    - ``weighted_mean``: position-weighted mean over ``text_mask``, weight k for the k-th text token.
    """
    if mode not in POOLING_MODES:
        raise ValueError(f"unknown pooling mode {mode!r}; choose one of {POOLING_MODES}")
    rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
    if mode in ("eos_token", "last_token"):
        index = last_token_index(attention_mask) - (1 if mode == "last_token" else 0)
        return hidden_states[rows, index]
    weights = text_mask.to(hidden_states.dtype)
    if mode == "weighted_mean":
        weights = weights * weights.cumsum(dim=1)
    weights = weights / weights.sum(dim=1, keepdim=True)
    return torch.einsum("bt,bth->bh", weights, hidden_states)
