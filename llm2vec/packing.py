"""Packed decoder calls: the sequences of one call laid end to end in a single row, with no padding.

A padded batch (B, T) with ``attention_mask`` becomes one row of its N real tokens, in row-major order,
with position ids that restart at 0 at the start of each sequence and no attention mask:

    padded   [a1 a2 a3 _ ]       packed  [a1 a2 a3 b1 b2 b3 b4 c1]
             [b1 b2 b3 b4]       pos      0  1  2  0  1  2  3  0
             [c1 _  _  _ ]

Each call also passes the boundaries as transformers' variable-length keyword arguments (:func:`varlen_kwargs`):
``cu_seq_lens_q = cu_seq_lens_k = [0, n_1, n_1 + n_2, ..., N]`` (int32) and ``max_length_q = max_length_k =
max_i n_i``, computed once per call, so that ``flash_attention_2`` runs its variable-length kernel without
rederiving them in every layer (a device sync each time). Where they are not taken (:func:`accepts_varlen_kwargs`)
transformers finds the packed form from the position ids alone. ``sdpa`` and ``eager`` get a block-diagonal causal
mask: the same numbers, at a cost quadratic in the row's length (cheaper than padding for Stage I's chunks, not for
an ``encode`` batch), so ``ModelArguments.packing`` is on by default only with ``flash_attention_2``; the CPU tests
use ``sdpa`` to check that a packed call equals the padded one.

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

import functools
import inspect
from collections.abc import Sequence

import torch
from torch import nn

from .pooling import position_ids_from_mask


def packed_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (N,) of the real tokens of a padded batch, row-major: 0..n_b-1 for each row b."""
    return position_ids_from_mask(attention_mask)[attention_mask.bool()]


def unpack(packed: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, H) states of the real tokens, row-major, back to (B, T, H) with zeros at the padding."""
    rows, columns = attention_mask.bool().nonzero(as_tuple=True)
    shape = (*attention_mask.shape, packed.shape[-1])
    return packed.new_zeros(shape).index_put((rows, columns), packed)


VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@functools.cache
def transformers_takes_varlen_kwargs() -> bool:
    """Whether the installed transformers declares the variable-length attention arguments
    (``FlashAttentionKwargs``, which its decoders pass on to the attention function)."""
    try:
        from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    except ImportError:
        return False
    return set(VARLEN_KWARGS) <= set(getattr(FlashAttentionKwargs, "__annotations__", {}))


def accepts_varlen_kwargs(decoder: nn.Module) -> bool:
    """Whether :func:`packed_call` passes :func:`varlen_kwargs` to ``decoder``: the installed transformers
    declares them and the decoder's ``forward`` takes extra keyword arguments (transformers' decoders pass
    those on to every attention layer). A wrapper's ``inner`` module, if it has one, must take them too."""
    if not transformers_takes_varlen_kwargs():
        return False
    modules = [decoder] + ([decoder.inner] if isinstance(getattr(decoder, "inner", None), nn.Module) else [])
    for module in modules:
        parameters = inspect.signature(module.forward).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return False
    return True


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The sequences' boundaries in a packed row from its position ids (N,) that restart at 0 at each
    sequence: ``cu_seq_lens_q/k`` (S + 1,) int32, the cumulative lengths [0, n_1, ..., N], and
    ``max_length_q/k`` = max n_i as a Python int (one device sync per call)."""
    starts = (position_ids == 0).nonzero().flatten()
    ends = torch.tensor([position_ids.numel()], device=position_ids.device)
    cu_seq_lens = torch.cat([starts, ends]).to(torch.int32)
    max_length = int(cu_seq_lens.diff().max())
    return {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }


def packed_call(decoder, pieces: Sequence[torch.Tensor], positions: Sequence[torch.Tensor], embeds: bool):
    """One decoder call over the concatenated ``pieces`` (token ids (n_i,) or embeddings (n_i, H) when
    ``embeds``) with their concatenated ``positions`` (restarting at 0 at each sequence) and, where the
    decoder takes them, the :func:`varlen_kwargs` derived from those positions; returns the final-layer
    states split like ``pieces``."""
    sizes = [len(p) for p in pieces]
    inputs = torch.cat(list(pieces))[None]
    position_ids = torch.cat(list(positions))[None]
    kwargs = {"inputs_embeds": inputs} if embeds else {"input_ids": inputs}
    if accepts_varlen_kwargs(decoder):
        kwargs.update(varlen_kwargs(position_ids[0]))
    hidden = decoder(**kwargs, attention_mask=None, position_ids=position_ids, use_cache=False).last_hidden_state
    return hidden[0].split(sizes)


def packed_hidden_states(decoder, batches: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Final-layer states (B_i, T_i, H) of several padded batches (``input_ids``, ``attention_mask``), all
    computed in one packed decoder call."""
    masks = [b["attention_mask"] for b in batches]
    pieces = [b["input_ids"][m.bool()] for b, m in zip(batches, masks)]
    states = packed_call(decoder, pieces, [packed_positions(m) for m in masks], embeds=False)
    return [unpack(s, m) for s, m in zip(states, masks)]
