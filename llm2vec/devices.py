"""The device and the dtype a model is loaded and run in, from what the user names ("auto" included)."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """The first GPU when torch sees one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | None = None) -> torch.dtype:
    """A dtype from its name; ``"auto"``/None: bfloat16 on a GPU that supports it, float32 otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device is not None and device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]
