"""Pooling: pure, vectorised functions over explicitly built masks."""

from __future__ import annotations

import torch

POOLING_MODES = ("eos_token", "last_token", "mean", "weighted_mean")


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
