"""Gathering embeddings across data-parallel processes for Stage II's in-batch negatives.

Under data parallelism each of the W processes holds B examples of the global batch. Every query must
be scored against the documents of the *whole* global batch, so the positives and hard negatives are
gathered from all processes, with a gradient:

- forward: all-gather the (B, H) slices in rank order into (W * B, H); this rank's slice is the local
  tensor itself, so the local autograd graph is kept;
- backward: each process's loss covers only its own B queries but scores every process's documents, so
  the gradient for this rank's slice has a part from every process's loss. The backward sums the
  incoming (W * B, H) gradients over processes (one all-reduce) and returns this rank's slice.

With DDP, which averages parameter gradients over processes, this gives exactly the gradient of the
mean loss over all W * B queries, as if one process had held the whole batch (tested with two
processes in ``tests/test_stage_II.py``). Replacing the local slice alone, without the backward
all-reduce, would drop the gradient that the other processes' queries send to this rank's documents.

Order and labels: candidates are ``cat(gathered positives, gathered negatives)``, each in rank order,
so the positive of local query i on rank r sits at row ``r * B + i`` (:func:`positive_labels`). Every
process must hold the same number of examples (the training data is arranged in full global batches).

In a single process (or without ``torch.distributed`` initialised) everything here is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        rank, size = world()
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local)
        parts[rank] = local
        ctx.rank, ctx.rows = rank, local.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def gather_with_grad(local: torch.Tensor) -> torch.Tensor:
    """(B, ...) on each of W processes -> (W * B, ...) in rank order, differentiable (see the module doc)."""
    _, size = world()
    if size == 1:
        return local
    _check_equal_rows(local)
    return _GatherWithGrad.apply(local)


def _check_equal_rows(local: torch.Tensor) -> None:
    rows = torch.tensor([local.shape[0]], device=local.device)
    every = [torch.empty_like(rows) for _ in range(world()[1])]
    dist.all_gather(every, rows)
    sizes = [int(r.item()) for r in every]
    if len(set(sizes)) != 1:
        raise RuntimeError(f"gather_with_grad needs the same batch size on every process, got {sizes}")


def positive_labels(local_batch_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Row of each local query's positive among the gathered candidates: ``rank * B + i``."""
    rank, _ = world()
    return rank * local_batch_size + torch.arange(local_batch_size, device=device)


def release_process_group() -> None:
    """Destroy the default process group, after freeing what still holds it.

    A driver's training leaves the process group (set up by transformers / accelerate) alive and the Trainer's
    DDP wrapper unreferenced but not yet collected. Left to the interpreter's exit, their native threads can be
    torn down in the wrong order and abort the process after a finished run ("terminate called without an
    active exception", seen with gloo). This collects the unreferenced wrappers first, then destroys the group.
    No collective call: a process whose peer failed must not wait here.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    import gc

    gc.collect()
    dist.destroy_process_group()


_release_registered = False


def release_process_group_at_exit() -> None:
    """Register :func:`release_process_group` to run at the interpreter's exit (once per process)."""
    global _release_registered
    if not _release_registered:
        import atexit

        atexit.register(release_process_group)
        _release_registered = True
