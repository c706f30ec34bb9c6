"""Memory-bounded training steps of both stages: a batch run in chunks, with the gradient of the whole batch.

Contract: Stage I's token-budget chunks and Stage II's gradient cache give the plain step's gradient up to float
rounding; every process runs the same number of chunks (:func:`agreed_plan`), as DDP, FSDP and ZeRO-3 need."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collator import COUNTS_KEY
from .distributed import world
from .loss.infonce import autocast_off

FEATURE_KEYS = ("input_ids", "attention_mask", "text_mask")
TARGETS_OF = {"q2d": "positive_targets", "d2q": "query_targets"}  # the targets each reconstruction pass reads

Lengths = Sequence[int] | Sequence[Sequence[int]]

# ---------------------------------------------------------------------------------------------- the planner


def _per_call(lengths: Lengths) -> list[tuple[int, ...]]:
    """Every item's lengths as a tuple over its decoder calls (an int: an item of one call)."""
    return [tuple(int(n) for n in x) if isinstance(x, Sequence) else (int(x),) for x in lengths]


def chunk_cost(lengths: Lengths, items: Sequence[int], packed: bool = False) -> int:
    """Positions the decoder calls of ``items`` process together: padded, ``|items| x sum over calls of the
    longest item in that call``; ``packed``, the sum of the items' real lengths."""
    if not items:
        return 0
    rows = _per_call(lengths)
    if packed:
        return sum(sum(rows[i]) for i in items)
    return len(items) * sum(max(rows[i][c] for i in items) for c in range(len(rows[items[0]])))


def plan_chunks(lengths: Lengths, budget: int, *, packed: bool = False, min_chunks: int = 1) -> list[list[int]]:
    """Chunks of item indices (each once), each costing at most ``budget`` positions (:func:`chunk_cost`) unless
    one item does; at least ``min_chunks``. ``lengths[i]``: item i's real length, or its lengths in each call."""
    if budget < 1:
        raise ValueError(f"budget must be a positive number of positions, got {budget}")
    if not 1 <= min_chunks <= max(1, len(lengths)):
        raise ValueError(f"min_chunks must be between 1 and the number of items ({len(lengths)}), got {min_chunks}")
    rows = _per_call(lengths)
    order = sorted(range(len(rows)), key=lambda i: (-sum(rows[i]), i))
    chunks: list[list[int]] = []
    for i in order:
        if chunks and chunk_cost(rows, chunks[-1] + [i], packed) <= budget:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    while len(chunks) < min_chunks:
        k = max(
            (k for k in range(len(chunks)) if len(chunks[k]) > 1), key=lambda k: chunk_cost(rows, chunks[k], packed)
        )
        half = (len(chunks[k]) + 1) // 2
        chunks[k : k + 1] = [chunks[k][:half], chunks[k][half:]]
    return chunks


def agreed_plan(lengths: Lengths, budget: int, packed: bool, device: torch.device) -> list[list[int]]:
    """This process's :func:`plan_chunks`, with as many chunks as the largest plan of all processes."""
    chunks = plan_chunks(lengths, budget, packed=packed)
    if world()[1] > 1:
        count = torch.tensor([len(chunks)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if int(count.item()) > len(lengths):
            raise ValueError(
                f"another process's batch needs {int(count.item())} chunks, more than this process's {len(lengths)} "
                "items: every process must hold the same number of examples"
            )
        chunks = plan_chunks(lengths, budget, packed=packed, min_chunks=int(count.item()))
    return chunks


def _run_chunks(chunks: Sequence, step: Callable, no_sync) -> list:
    """``step(k, chunk)`` for each chunk in turn, all but the last under ``no_sync()``; their results."""
    results = []
    for k, chunk in enumerate(chunks):
        with contextlib.nullcontext() if k == len(chunks) - 1 else no_sync():
            results.append(step(k, chunk))
    return results


# ---------------------------------------------------------------------------------------------- Stage I


def decoder_call_lengths(batch: dict, directions: Sequence[str]) -> torch.Tensor:
    """(B, C) real positions of each pair in each decoder call: the query and document encodings, then each
    direction's reconstruction pass (the anchor + the targets)."""
    columns = [batch["query"]["attention_mask"].sum(1), batch["positive"]["attention_mask"].sum(1)]
    columns += [1 + batch[TARGETS_OF[d]]["attention_mask"].sum(1) for d in directions]
    return torch.stack(columns, dim=1)


def decoder_positions(batch: dict, directions: Sequence[str], packed: bool = False) -> int:
    """Positions the decoder calls of ``batch`` process, padding included (packed: the real positions)."""
    if packed:
        return int(decoder_call_lengths(batch, directions).sum())
    widths = [batch["query"]["input_ids"].shape[1], batch["positive"]["input_ids"].shape[1]]
    widths += [1 + batch[TARGETS_OF[d]]["input_ids"].shape[1] for d in directions]
    return batch["query"]["input_ids"].shape[0] * sum(widths)


def _select_rows(features: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows of a padded ``{"input_ids", "attention_mask", ...}`` dict, cut to the columns where one of them
    has a real token (either padding side); every tensor is new."""
    mask = features["attention_mask"].index_select(0, rows)
    keep = mask.bool().any(dim=0).nonzero().squeeze(1)
    return {name: value.index_select(0, rows).index_select(1, keep) for name, value in features.items()}


def select_pairs(batch: dict, pairs: Sequence[int]) -> dict:
    """The sub-batch of ``pairs``, each padded tensor trimmed to its longest row; the step-wide ``target_counts``
    kept as they are."""
    rows = torch.tensor(list(pairs), dtype=torch.long, device=batch["query"]["input_ids"].device)
    return {name: value if name == COUNTS_KEY else _select_rows(value, rows) for name, value in batch.items()}


def reconstruction_step(
    model, inputs: dict, budget: int, packed: bool, directions: Sequence[str], counts: dict, backward, no_sync
) -> tuple[list, list[list[int]]]:
    """Stage I's step in chunks of pairs, each chunk's loss (over the step-wide ``counts``) back-propagated at once;
    returns the chunks' outputs and the chunks (pair indices)."""
    device = inputs["query"]["input_ids"].device
    chunks = agreed_plan(decoder_call_lengths(inputs, directions).tolist(), budget, packed, device)
    batch = {**inputs, COUNTS_KEY: counts}

    def step(_, pairs):
        out = model(**select_pairs(batch, pairs))
        backward(out.loss)
        return out

    return _run_chunks(chunks, step, no_sync), chunks


# ---------------------------------------------------------------------------------------------- Stage II


def rows_of(features: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The rows of a padded batch (``pad_batch``'s keys), each cut to its real tokens: dicts of 1-D tensors."""
    mask = features["attention_mask"].bool()
    return [{k: features[k][row][mask[row]] for k in FEATURE_KEYS} for row in range(mask.shape[0])]


def collate_rows(rows: Sequence[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows from :func:`rows_of` into one batch (the masks are 0 on the padding)."""
    width = max(len(r["input_ids"]) for r in rows)
    first = rows[0]
    ids = first["input_ids"]
    out = {"input_ids": torch.full((len(rows), width), pad_token_id, dtype=ids.dtype, device=ids.device)}
    for k in ("attention_mask", "text_mask"):
        out[k] = torch.zeros((len(rows), width), dtype=first[k].dtype, device=first[k].device)
    for i, r in enumerate(rows):
        for k in FEATURE_KEYS:
            out[k][i, : len(r[k])] = r[k]
    return out


@dataclass
class RngState:
    """The RNG state dropout draws from: torch's CPU generator and, on a CUDA device, that device's generator."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


def gradient_cache_step(
    model, inputs: dict, budget: int, packed: bool, loss_fn, pad_token_id: int, backward, no_sync
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stage II's step with the gradient cache (three passes, docs/design.md) over the texts of ``inputs``;
    ``model(features=...)`` embeds a chunk, ``loss_fn(e_q, e_p, e_n)`` is the InfoNCE loss. Returns the loss and
    each side's embeddings, detached, in the batch's order."""
    sides = [s for s in ("query", "positive", "negative") if inputs.get(s) is not None]
    rows = [row for side in sides for row in rows_of(inputs[side])]
    device = inputs["query"]["input_ids"].device
    chunks = agreed_plan([len(r["input_ids"]) for r in rows], budget, packed, device)
    batches = [collate_rows([rows[i] for i in chunk], pad_token_id) for chunk in chunks]
    indices = [torch.tensor(chunk, device=device) for chunk in chunks]

    # pass 1: every chunk's embeddings without a graph, each chunk's RNG state recorded first
    states, parts = [], []
    with torch.no_grad():
        for batch in batches:
            states.append(RngState.capture(device))
            parts.append(model(features=batch))
    after = RngState.capture(device)
    embeddings = parts[0].new_empty((len(rows), parts[0].shape[-1]))
    for index, part in zip(indices, parts):
        embeddings[index] = part
    # pass 2: the loss over the whole (gathered) batch, back-propagated to the embeddings only: the cache dL/de
    # (float32, autocast off for the loss and its backward: under an enclosing autocast a CPU backward would
    # otherwise run its matmuls in bf16)
    leaves = embeddings.detach().float().requires_grad_(True)
    by_side = dict(zip(sides, leaves.split(inputs["query"]["input_ids"].shape[0])))
    with autocast_off(device):
        loss = loss_fn(by_side["query"], by_side["positive"], by_side.get("negative"))
        loss.backward()
    cache = leaves.grad

    # pass 3: each chunk again with a graph and pass 1's RNG state; its rows' cached gradient back-propagated
    def step(k, batch):
        states[k].restore()
        chunk_embeddings = model(features=batch)
        with autocast_off(device):  # forward under the caller's autocast, backward outside it
            backward(chunk_embeddings, grad=cache[indices[k]].to(chunk_embeddings.dtype))

    _run_chunks(batches, step, no_sync)
    after.restore()
    return loss.detach(), {side: e.detach() for side, e in by_side.items()}


# ---------------------------------------------------------------------------------------------- the trainer's side


def trainer_hooks(accelerator, model, weight: float) -> tuple[Callable, Callable]:
    """The ``backward`` and ``no_sync`` handed to a model's ``step_in_parts``: ``backward(tensor[, grad])``
    back-propagates through ``accelerator`` with the loss weighted by ``weight``; ``no_sync()`` defers the gradient
    all-reduce of the wrapped ``model``."""

    def backward(tensor, grad=None):
        if grad is None:
            accelerator.backward(tensor * weight)
        else:
            accelerator.backward(tensor, gradient=grad * weight)

    def no_sync():
        return accelerator.no_sync(model)

    return backward, no_sync
