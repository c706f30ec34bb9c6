"""Gathering embeddings across data-parallel processes for Stage II's in-batch negatives."""

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
    """(B, ...) on each of W processes -> (W * B, ...) in rank order, differentiable (docs/design.md)."""
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
    """Destroy the default process group (no collective call), after collecting the unreferenced DDP wrappers that
    still hold it (left to the interpreter's exit, their threads can abort a finished run)."""
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
