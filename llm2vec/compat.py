"""What this package does differently on the older transformers releases that ``setup.py`` admits (>= 5.17)."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import transformers
from torch import nn

# Read on first use (module __getattr__): transformers' Trainer and TrainingArguments take seconds to import
# (accelerate, datasets, torch.distributed), and encoding or evaluating a model needs neither.
_LAZY = ("TRAINER_READS_LOSS_IS_SCALED_FOR_GA", "HAS_ACTIVATION_CHECKPOINTING", "TrainingArguments")


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    values = _training_compat()
    globals().update(values)
    return values[name]


def _training_compat() -> dict[str, Any]:
    """The values of :data:`_LAZY` for the installed transformers."""
    # transformers >= 5.19: the Trainer reads `loss_is_scaled_for_ga` (see the module docstring).
    reads_scaled = hasattr(transformers.Trainer, "loss_is_scaled_for_ga")
    # transformers >= 5.23: `activation_checkpointing` is a field of TrainingArguments.
    has_checkpointing = "activation_checkpointing" in {f.name for f in fields(transformers.TrainingArguments)}
    return {
        "TRAINER_READS_LOSS_IS_SCALED_FOR_GA": reads_scaled,
        "HAS_ACTIVATION_CHECKPOINTING": has_checkpointing,
        "TrainingArguments": transformers.TrainingArguments if has_checkpointing else _with_activation_checkpointing(),
    }


def _with_activation_checkpointing() -> type:
    @dataclass
    class TrainingArguments(transformers.TrainingArguments):
        """transformers' ``TrainingArguments`` with 5.23's ``activation_checkpointing[_kwargs]``, mapped onto the
        ``gradient_checkpointing[_kwargs]`` the installed release reads (afterwards both pairs hold the same)."""

        activation_checkpointing: bool = field(
            default=False,
            metadata={"help": "Recompute each decoder layer's activations in the backward pass to save memory."},
        )
        activation_checkpointing_kwargs: dict[str, Any] | str | None = field(
            default=None,
            metadata={
                "help": "Keyword arguments of the activation checkpointing (e.g. {'use_reentrant': false}); "
                "`every_n_layers` and `offload` as transformers reads them."
            },
        )

        def __post_init__(self):
            if self.activation_checkpointing:
                self.gradient_checkpointing = True
            if self.activation_checkpointing_kwargs is not None:
                self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
            super().__post_init__()  # parses a JSON string of gradient_checkpointing_kwargs
            self.activation_checkpointing = self.gradient_checkpointing
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs

    # pickled by the Trainer (training_args.bin) by its module and name, which __getattr__ answers
    TrainingArguments.__qualname__ = "TrainingArguments"
    return TrainingArguments


def enable_activation_checkpointing(
    model: nn.Module, activation_checkpointing_kwargs: dict[str, Any] | None = None, **kwargs
) -> None:
    """Turn on activation checkpointing of a transformers model (or a PEFT model around one) by the method its
    release has (``activation_checkpointing_enable`` from 5.23)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=activation_checkpointing_kwargs, **kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activation_checkpointing_kwargs, **kwargs)


def disable_activation_checkpointing(model: nn.Module) -> None:
    """Turn it off again, by the method the release has."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


@contextlib.contextmanager
def peft_reads_deprecated_property():
    """Hide the one FutureWarning peft causes whenever it wraps a model (its read of ``is_gradient_checkpointing``,
    deprecated in transformers 5.23); every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
