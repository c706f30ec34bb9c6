"""Padded batches: :func:`pad_batch` (token ids -> tensors and masks) and the training collator of both stages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import templates
from .loss.reconstruction import RECONSTRUCTION_TARGETS, target_counts

if TYPE_CHECKING:
    from .dataset import TrainExample

COUNTS_KEY = "target_counts"  # a batch's target tokens per loss direction


def pad_batch(
    encoded: Sequence[templates.EncodedText], pad_token_id: int, padding_side: str = "right"
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


def pad_targets(sequences: Sequence[Sequence[int]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad target id sequences to (B, M) with a mask of the real targets."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def reconstruction_targets(e: templates.EncodedText, which: str) -> tuple[int, ...]:
    """The tokens Stage I predicts for one side: ``text`` = its text tokens; ``all`` = everything but the anchor."""
    if which == "text":
        return e.input_ids[e.text_start : e.text_end]
    if which == "all":
        return e.input_ids[:-1]
    raise ValueError(f"reconstruction_targets must be one of {RECONSTRUCTION_TARGETS}, got {which!r}")


@dataclass
class TrainCollator:
    """Collates ``TrainExample`` lists into ``{"query", "positive"[, "negative"][, "*_targets"]}`` dicts.
    ``reconstruction``: ``None`` (Stage II), ``"text"`` or ``"all"`` (Stage I: adds ``query_targets``,
    ``positive_targets`` and :data:`COUNTS_KEY`); ``instruction_separator``: ``None`` keeps the template's own."""

    tokenizer: object
    template: templates.TemplateSpec
    max_length: int
    pad_token_id: int
    with_negative: bool = False
    reconstruction: str | None = None
    query_instructions: bool = True
    instruction_separator: str | None = None

    @classmethod
    def for_encoder(cls, encoder, **kwargs) -> TrainCollator:
        return cls(encoder.tokenizer, encoder.template, encoder.max_length, encoder.pad_token_id, **kwargs)

    def _encode(self, items):
        spec = self.template
        if self.instruction_separator is not None:
            spec = spec.with_separator(self.instruction_separator)
        return templates.encode(self.tokenizer, spec, items, self.max_length)

    def __call__(self, examples: Sequence[TrainExample]) -> dict:
        queries = self._encode([(ex.query_instruction if self.query_instructions else "", ex.query) for ex in examples])
        positives = self._encode([("", ex.positive) for ex in examples])
        batch = {"query": pad_batch(queries, self.pad_token_id), "positive": pad_batch(positives, self.pad_token_id)}
        if self.with_negative:
            missing = [i for i, ex in enumerate(examples) if not ex.negative]
            if missing:
                raise ValueError(
                    f"hard negatives are required but {len(missing)} example(s) of this batch have none "
                    f"(source {examples[missing[0]].source!r})"
                )
            batch["negative"] = pad_batch(self._encode([("", ex.negative) for ex in examples]), self.pad_token_id)
        if self.reconstruction is not None:
            for name, encoded in (("query_targets", queries), ("positive_targets", positives)):
                batch[name] = pad_targets(
                    [reconstruction_targets(e, self.reconstruction) for e in encoded], self.pad_token_id
                )
            batch[COUNTS_KEY] = target_counts(batch["query_targets"], batch["positive_targets"])
        return batch


def check_examples(collator: TrainCollator, examples: Sequence[TrainExample]) -> int:
    """Run ``collator`` on one example of each distinct query instruction before step 1; a :class:`DataError`
    names the ``file:line`` of one that cannot be collated. Returns how many were checked."""
    from .dataset import DataError

    first: dict[str, TrainExample] = {}
    for ex in examples:
        first.setdefault(ex.query_instruction if collator.query_instructions else "", ex)
    for ex in first.values():
        try:
            collator([ex])
        except (ValueError, TypeError) as e:
            where = ex.origin or f"an example of source {ex.source!r}"
            raise DataError(
                f"{where}: this example cannot be tokenized for training: {e} (max_length is max_seq_length)"
            ) from None
    return len(first)


def step_counts(
    batches: list[dict], device: torch.device, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> list[dict]:
    """The micro-batches of one optimizer step, each with the step's :data:`COUNTS_KEY`: summed over the micro-batches
    and, with ``reduce`` (a sum over processes), over all processes. No batch is changed in place."""
    counted = [b for b in batches if COUNTS_KEY in b]
    if not counted:
        return batches
    names = sorted(counted[0][COUNTS_KEY])
    local = torch.stack([sum(b[COUNTS_KEY][k] for b in counted) for k in names]).to(device)
    if reduce is not None:
        local = reduce(local)
    summed = dict(zip(names, local))
    return [{**b, COUNTS_KEY: summed} if COUNTS_KEY in b else b for b in batches]


def loss_weight(batch: dict, processes: int, accumulation_steps: int) -> float:
    """What a micro-batch's loss is multiplied by before backward: ``processes`` for a batch divided by the step's
    counts (DDP averages the gradients), else ``1 / accumulation_steps``."""
    if COUNTS_KEY in batch:
        return float(processes)
    return 1.0 / accumulation_steps
