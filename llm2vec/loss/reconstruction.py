"""Embedding-based reconstruction loss (the paper's Eq. 3 and 4, Algorithm 1 lines 3-6).

Given the anchor embedding e_X of one side of a pair (B, H) and the token ids y_1..y_m of the other
side, the decoder reads the sequence

    [ e_X ; Embed(y_1) ; ... ; Embed(y_m) ]          (positions 0, 1, ..., m)

under teacher forcing, and the LM head at position t-1 predicts y_t:

    NLL(Y | e_X) = - sum_{t=1..m} log P(y_t | e_X, y_<t)

The anchor sits directly before the first target at position 0 and the targets follow at consecutive
positions 1..m; the targets are right-padded, so padding never separates the anchor from y_1 (the
authors' code put the anchor before the left padding). Logits are computed only at the positions that
have a target: the LM head never sees the position of y_m or any padding.

This function returns the *sum* of token NLLs and the number of target tokens, so the caller decides
how to average (see ``LLM2Vec_q2d_d2q``: a token mean over the whole optimizer step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def reconstruction_nll(
    decoder: nn.Module,
    lm_head: nn.Module,
    anchor: torch.Tensor,
    target_ids: torch.Tensor,
    target_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of -log P(y_t | anchor, y_<t) over the targets of a batch, and the number of targets.

    Args:
        decoder: the decoder body (``inputs_embeds`` -> ``last_hidden_state``), the same one that made ``anchor``.
        lm_head: the causal LM's output layer.
        anchor: (B, H) anchor embeddings; gradients flow back through them into the encoding pass.
        target_ids: (B, M) right-padded target token ids.
        target_mask: (B, M) 1 on real targets, 0 on padding; every row holds at least one target.
    """
    embed = decoder.get_input_embeddings()
    target_embeds = embed(target_ids)
    inputs_embeds = torch.cat([anchor[:, None, :].to(target_embeds.dtype), target_embeds], dim=1)
    ones = torch.ones_like(target_mask[:, :1])
    attention_mask = torch.cat([ones, target_mask], dim=1)
    batch, width = attention_mask.shape
    position_ids = torch.arange(width, device=attention_mask.device).expand(batch, width)
    hidden = decoder(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    # hidden[:, t] predicts target_ids[:, t]: the anchor (t = 0) predicts y_1, Embed(y_t) predicts y_{t+1}.
    predicting = target_mask.bool()
    logits = lm_head(hidden[:, :-1][predicting])
    total = F.cross_entropy(logits.float(), target_ids[predicting], reduction="sum")
    return total, predicting.sum()
