"""Stage II under bf16 mixed precision: InfoNCE's scores and softmax stay float32 in every path.

The Trainer's bf16 autocast wraps the model's ``forward``. The plain step computes the loss inside ``forward``, the
gradient-cached step outside it; both must give the float32 loss. The reference is Eq. 6-7 in float64, one query
and one candidate at a time, over the embeddings the step itself produced: the loss and the gradient with respect
to those embeddings (what the step back-propagates into the encoder) must match it to float32 rounding. A bf16
matmul of the scores is off by about 1e-2 relative in the gradient, so every test here fails without autocast
switched off in the loss.
"""

import pytest
import torch
import torch.nn.functional as F
from _stage_II_dist_worker import autocast_cached_step, autocast_plain_step, build_encoder, run_autocast_rank

from llm2vec.loss.infonce import InfoNCELoss

LENGTHS = ([11, 17, 6, 14], [30, 22, 25, 19], [12, 24, 8, 20])  # query, positive, negative rows
SCALE = 20.0


def float64_reference(query, positive, negative, ranks: int = 1, scale: float = SCALE):
    """Eq. 6-7 in float64 over the union batch (rows in rank order): each rank's mean loss over its own queries
    against every candidate, and the gradient of the sum of the ranks' losses with respect to every embedding
    (DDP averages parameter gradients, so this sum is what each rank's gather back-propagates)."""
    leaves = [t.detach().double().requires_grad_(True) for t in (query, positive, negative)]
    q, p, n = leaves
    candidates = list(p) + list(n)
    rows = q.shape[0] // ranks
    losses = []
    for r in range(ranks):
        per_query = []
        for i in range(r * rows, (r + 1) * rows):
            sims = torch.stack([scale * F.cosine_similarity(q[i], d, dim=0) for d in candidates])
            per_query.append(torch.logsumexp(sims, 0) - sims[i])
        losses.append(torch.stack(per_query).mean())
    torch.stack(losses).sum().backward()
    return [loss.detach() for loss in losses], [leaf.grad for leaf in leaves]


def assert_close_to_float64(loss, grads, ref_loss, ref_grads, what):
    """Loss within 1e-6 relative, each gradient within 1e-5 of its largest entry (float32 rounding; bf16 scores
    miss both by orders of magnitude)."""
    assert abs(loss.double().item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item()), (
        f"{what}: loss {loss.item():.7f} vs float64 {ref_loss.item():.7f}"
    )
    for side, got, expected in zip(("query", "positive", "negative"), grads, ref_grads):
        scale = expected.abs().max().item()
        error = (got.double() - expected).abs().max().item()
        assert error <= 1e-5 * scale, f"{what}, {side}: gradient off by {error / scale:.2e} of its largest entry"


def random_embeddings(seed=0, rows=6, width=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, width, generator=g) for _ in range(3)]


def test_loss_under_autocast_equals_float64():
    """The loss module alone: called under bf16 autocast it computes what float64 computes."""
    leaves = [t.clone().requires_grad_(True) for t in random_embeddings()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = InfoNCELoss(SCALE)(*leaves)
        scores = InfoNCELoss(SCALE).scores(*leaves)
    assert loss.dtype == scores.dtype == torch.float32
    loss.backward()
    ([ref_loss], ref_grads) = float64_reference(*leaves)
    assert_close_to_float64(loss, [leaf.grad for leaf in leaves], ref_loss, ref_grads, "InfoNCELoss")


def random_batch(encoder, seed=0):
    from test_gradcache import random_batch as padded

    return padded(LENGTHS, encoder.pad_token_id, seed=seed)


def test_plain_step_under_autocast_equals_float64(llama_checkpoint):
    model = build_encoder(llama_checkpoint)
    model.train()
    result = autocast_plain_step(model, random_batch(model))
    ([ref_loss], ref_grads) = float64_reference(*result["embeddings"])
    assert_close_to_float64(result["loss"], result["grads"], ref_loss, ref_grads, "plain step")


@pytest.mark.parametrize("budget", [30, 1000])  # several chunks; one chunk
def test_cached_step_under_autocast_equals_float64(llama_checkpoint, budget):
    model = build_encoder(llama_checkpoint, embedding_token_budget=budget)
    model.train()
    result = autocast_cached_step(model, model, random_batch(model))
    ([ref_loss], ref_grads) = float64_reference(*result["embeddings"])
    assert_close_to_float64(result["loss"], result["grads"], ref_loss, ref_grads, f"cached step, budget {budget}")


def test_two_processes_under_autocast_equal_float64(llama_checkpoint, tmp_path):
    """DDP over two gloo processes under bf16 autocast, the plain and the cached step: each rank's loss and the
    gradient its embeddings receive (its own loss's and, through the gather, the other rank's) equal float64."""
    import torch.multiprocessing as mp

    encoder = build_encoder(llama_checkpoint)
    batch = random_batch(encoder, seed=5)
    torch.save(batch, tmp_path / "batch.pt")
    mp.spawn(
        run_autocast_rank,
        args=(2, str(tmp_path / "init"), llama_checkpoint, str(tmp_path / "batch.pt"), 40, str(tmp_path)),
        nprocs=2,
        join=True,
    )
    ranks = [torch.load(tmp_path / f"autocast{r}.pt") for r in range(2)]
    for step in ("plain", "cached"):
        union = [torch.cat([ranks[r][step]["embeddings"][k] for r in range(2)]) for k in range(3)]
        ref_losses, ref_grads = float64_reference(*union, ranks=2)
        for r in range(2):
            rows = slice(2 * r, 2 * r + 2)
            assert_close_to_float64(
                ranks[r][step]["loss"],
                ranks[r][step]["grads"],
                ref_losses[r],
                [g[rows] for g in ref_grads],
                f"{step} step, rank {r}",
            )
