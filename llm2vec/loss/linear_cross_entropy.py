"""LM head + cross-entropy summed over target rows, without materialising all the logits at once."""

from __future__ import annotations

import importlib.util
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _block_nll(lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain computation on one block of rows: logits, upcast to float32, summed cross-entropy."""
    return F.cross_entropy(lm_head(hidden).float(), targets, reduction="sum")


def liger_available(device: torch.device) -> bool:
    """Whether the fused Liger path can run on ``device`` (CUDA and the package installed)."""
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def _liger_nll(lm_head: nn.Linear, hidden, targets):
    """Liger's fused kernel (CUDA only), summing in float32 where the installed Liger takes ``accum_dtype``."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    options = {"reduction": "sum"}
    if "accum_dtype" in inspect.signature(LigerFusedLinearCrossEntropyLoss).parameters:
        options["accum_dtype"] = torch.float32
    loss = LigerFusedLinearCrossEntropyLoss(**options)
    return loss(lm_head.weight, hidden, targets, lm_head.bias).float()


def linear_cross_entropy_sum(
    hidden: torch.Tensor, lm_head: nn.Module, targets: torch.Tensor, chunk_rows: int = 0, fused: bool = True
) -> torch.Tensor:
    """sum_i -log softmax(lm_head(hidden_i))[targets_i] in float32.

    Args:
        hidden: (N, H) hidden states at the target positions; targets: (N,) target ids.
        lm_head: the LM's output layer, called on each block (its hooks and wrappers run as usual).
        chunk_rows: rows per block of logits (0: all at once); fused: Liger's kernel when :func:`liger_available`.
    """
    if chunk_rows < 0:
        raise ValueError(f"chunk_rows must be >= 0, got {chunk_rows}")
    if chunk_rows == 0 or hidden.shape[0] == 0:
        return _block_nll(lm_head, hidden, targets)
    # the fused kernel reads the weight directly: only for a plain linear head (no hooks, adapters or wrappers)
    if fused and type(lm_head) is nn.Linear and liger_available(hidden.device):
        return _liger_nll(lm_head, hidden, targets)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        if torch.is_grad_enabled():
            block = checkpoint(_block_nll, lm_head, hidden[rows], targets[rows], use_reentrant=False)
        else:
            block = _block_nll(lm_head, hidden[rows], targets[rows])
        total = total + block
    return total
