"""Packed decoder calls: the sequences of one call laid end to end in a single row, with no padding."""

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
    """Whether transformers declares the variable-length attention arguments (``FlashAttentionKwargs``)."""
    try:
        from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    except ImportError:
        return False
    return set(VARLEN_KWARGS) <= set(getattr(FlashAttentionKwargs, "__annotations__", {}))


def accepts_varlen_kwargs(decoder: nn.Module) -> bool:
    """Whether :func:`packed_call` passes :func:`varlen_kwargs` to ``decoder``: transformers declares them and the
    decoder's ``forward`` (and its ``inner`` module's, for a wrapper) takes extra keyword arguments."""
    if not transformers_takes_varlen_kwargs():
        return False
    modules = [decoder] + ([decoder.inner] if isinstance(getattr(decoder, "inner", None), nn.Module) else [])
    for module in modules:
        parameters = inspect.signature(module.forward).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return False
    return True


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The sequences' boundaries in a packed row from its position ids (N,), restarting at 0 at each sequence:
    ``cu_seq_lens_q/k`` (S + 1,) int32 cumulative lengths, ``max_length_q/k`` = max n_i (an int: one device sync)."""
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
    """One decoder call over the concatenated ``pieces`` (token ids (n_i,), or embeddings (n_i, H) when ``embeds``)
    at their ``positions`` (with :func:`varlen_kwargs` where the decoder takes them); the final-layer states split
    like ``pieces``."""
    sizes = [len(p) for p in pieces]
    inputs = torch.cat(list(pieces))[None]
    position_ids = torch.cat(list(positions))[None]
    kwargs = {"inputs_embeds": inputs} if embeds else {"input_ids": inputs}
    if accepts_varlen_kwargs(decoder):
        kwargs.update(varlen_kwargs(position_ids[0]))
    hidden = decoder(**kwargs, attention_mask=None, position_ids=position_ids, use_cache=False).last_hidden_state
    return hidden[0].split(sizes)


def packed_hidden_states(decoder, batches: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Final-layer states (B_i, T_i, H) of several padded batches, computed in one packed decoder call."""
    masks = [b["attention_mask"] for b in batches]
    pieces = [b["input_ids"][m.bool()] for b, m in zip(batches, masks)]
    states = packed_call(decoder, pieces, [packed_positions(m) for m in masks], embeds=False)
    return [unpack(s, m) for s, m in zip(states, masks)]
