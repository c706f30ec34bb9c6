"""One rank of the two-process tests of tests/test_chunked_steps.py (spawned with torch.multiprocessing, gloo).

Each rank holds its half of a global batch, takes one memory-bounded step (Stage I's chunks of pairs or Stage II's
gradient cache) on an encoder wrapped by DDP or sharded by FSDP2 (``fully_shard``), and saves: the number of chunks
its own batch alone would need, the forward passes it ran, the loss, and every trainable parameter's full gradient
after the processes' reduction. The references are computed by the test, in one process.
"""

from __future__ import annotations

import contextlib
import os

import torch

WORLD = 2


def wrap(encoder, how: str):
    """(the model the step calls, its ``no_sync``): DDP, or FSDP2 sharding the encoder's parameters over ranks."""
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(encoder)
        return ddp, ddp.no_sync
    from torch.distributed.fsdp import fully_shard

    fully_shard(encoder)  # every forward all-gathers the weights: the ranks must run the same number of forwards

    @contextlib.contextmanager
    def no_sync():
        encoder.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            encoder.set_requires_gradient_sync(True)

    return encoder, no_sync


def full_grads(encoder) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient, whole (FSDP2 holds a shard of it as a DTensor)."""
    out = {}
    for name, p in encoder.named_parameters():
        if p.requires_grad:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = grad.detach().clone()
    return out


def build(stage: str, checkpoint: str, budget: int):
    if stage == "I":
        from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

        return LLM2Vec_q2d_d2q.load(checkpoint, alpha=0.2, token_budget=budget, attn_implementation="eager")
    from _stage_II_dist_worker import build_encoder

    return build_encoder(checkpoint, embedding_token_budget=budget)


def run_rank(rank: int, stage: str, how: str, init_file: str, checkpoint: str, batch_file: str, budget: int, out: str):
    """One rank: its half of the batch in ``batch_file`` (``{"ranks": [batch of rank 0, batch of rank 1], ...}``),
    one chunked step with the trainer's loss weight, the results saved to ``out/<stage><how><rank>.pt``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from _gloo import run_in_group

    # a short timeout: ranks running different numbers of collectives fail the test instead of hanging it
    run_in_group(
        rank, WORLD, init_file, lambda: chunked_step(rank, stage, how, checkpoint, batch_file, budget, out), 60
    )


def chunked_step(rank: int, stage: str, how: str, checkpoint: str, batch_file: str, budget: int, out: str) -> None:
    from llm2vec.chunked_steps import decoder_call_lengths, plan_chunks, rows_of

    data = torch.load(batch_file)
    batch = data["ranks"][rank]
    encoder = build(stage, checkpoint, budget)
    encoder.train()
    forwards = []
    encoder.register_forward_pre_hook(lambda module, args: forwards.append(1))
    model, no_sync = wrap(encoder, how)
    if stage == "I":
        batch = {**batch, "target_counts": data["counts"]}  # summed over both ranks, as the trainer does
        lengths = decoder_call_lengths(batch, encoder.loss_fn.directions()).tolist()
        weight = float(WORLD)  # the trainer's weight for a batch with step-wide counts (DDP/FSDP average)
    else:
        lengths = [len(r["input_ids"]) for side in ("query", "positive", "negative") for r in rows_of(batch[side])]
        weight = 1.0  # the trainer's weight for a per-micro-batch mean loss, no accumulation

    def backward(tensor, grad=None):
        if grad is None:
            (tensor * weight).backward()
        else:
            tensor.backward(grad * weight)

    out_step = encoder.step_in_parts(model, batch, backward, no_sync)
    torch.save(
        {
            "own_plan": len(plan_chunks(lengths, budget)),
            "forwards": len(forwards),
            "loss": out_step.loss.detach(),  # this rank's loss, unweighted
            "grads": full_grads(encoder),
        },
        os.path.join(out, f"{stage}{how}{rank}.pt"),
    )
