"""Packed decoder calls: the sequences of one call laid end to end in a single row, with no padding.

A padded batch (B, T) with ``attention_mask`` becomes one row of its N real tokens, in row-major order,
with position ids that restart at 0 at the start of each sequence and no attention mask:

    padded   [a1 a2 a3 _ ]       packed  [a1 a2 a3 b1 b2 b3 b4 c1]
             [b1 b2 b3 b4]       pos      0  1  2  0  1  2  3  0
             [c1 _  _  _ ]

transformers recognises this form by the restarting position ids (``masking_utils.
find_packed_sequence_indices``, used when the attention mask is ``None``): ``flash_attention_2`` runs its
variable-length kernel over the sequences, so no padding is computed at all; ``sdpa`` and ``eager`` get
a block-diagonal causal mask, which gives the same numbers but computes attention over the whole row and
masks it, at a cost that grows with the square of the row's length. For Stage I chunks of about a
thousand tokens that is still cheaper than padding (the README's benchmark table), but an
``encode`` batch of 32 texts of 512 tokens would be one row of 16k; so ``ModelArguments.packing`` turns
packing on by default only with ``flash_attention_2``. The CPU tests use it with ``sdpa`` to check
that a packed call equals the padded one.

Exactness has two conditions. The model's attention must read the position ids (a family declares it:
``TemplateSpec.packing_exact``; true for the shipped Llama, Qwen2 and Mistral families, false for OPT or
Bloom, whose positions come from the attention mask or from ALiBi). And no dropout may be drawn: LoRA
dropout draws its masks for the packed (1, N) row, not for the padded (B, T) batches, so with dropout a
packed step is exact for its own masks but not equal to the padded step's numbers.

The helpers build every tensor anew (nothing is written into a caller's tensor); :func:`unpack` puts the
packed rows back into the (B, T, H) layout, zeros at the padding, so pooling and everything after it is
the padded code path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .pooling import position_ids_from_mask


def packed_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (N,) of the real tokens of a padded batch, row-major: 0..n_b-1 for each row b."""
    return position_ids_from_mask(attention_mask)[attention_mask.bool()]


def unpack(packed: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, H) states of the real tokens, row-major, back to (B, T, H) with zeros at the padding."""
    rows, columns = attention_mask.bool().nonzero(as_tuple=True)
    shape = (*attention_mask.shape, packed.shape[-1])
    return packed.new_zeros(shape).index_put((rows, columns), packed)


def packed_call(decoder, pieces: Sequence[torch.Tensor], positions: Sequence[torch.Tensor], embeds: bool):
    """One decoder call over the concatenated ``pieces`` (token ids (n_i,) or embeddings (n_i, H) when
    ``embeds``) with their concatenated ``positions``; returns the final-layer states split like ``pieces``."""
    sizes = [len(p) for p in pieces]
    inputs = torch.cat(list(pieces))[None]
    position_ids = torch.cat(list(positions))[None]
    kwargs = {"inputs_embeds": inputs} if embeds else {"input_ids": inputs}
    hidden = decoder(**kwargs, attention_mask=None, position_ids=position_ids, use_cache=False).last_hidden_state
    return hidden[0].split(sizes)


def packed_hidden_states(decoder, batches: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Final-layer states (B_i, T_i, H) of several padded batches (``input_ids``, ``attention_mask``), all
    computed in one packed decoder call."""
    masks = [b["attention_mask"] for b in batches]
    pieces = [b["input_ids"][m.bool()] for b, m in zip(batches, masks)]
    states = packed_call(decoder, pieces, [packed_positions(m) for m in masks], embeds=False)
    return [unpack(s, m) for s, m in zip(states, masks)]
