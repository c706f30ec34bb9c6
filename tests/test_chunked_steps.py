"""The memory-bounded steps of both stages (llm2vec.chunked_steps) with two gloo processes whose batches need
different numbers of chunks, under DDP and under FSDP2.

The rule under test: every process runs as many chunks as the largest plan (so FSDP's weight gathers in every
forward pair up; a process that ran fewer would leave the other waiting until the 60 s gloo timeout). The
references are independent of the chunked step and of the processes: one process, every example alone.

- Stage I: the gradient of the global loss is the sum, over the pairs, of each pair run alone through the plain
  forward with the step-wide target counts (the loss is a sum of token NLLs divided by those counts).
- Stage II: every text of the global batch embedded alone (its real tokens, no padding), and the InfoNCE loss of
  the global batch written out here in float64 (scaled cosine scores, a log-sum-exp per query).
"""

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from _chunked_steps_worker import WORLD, run_rank
from _stage_II_dist_worker import build_encoder, slice_batch
from test_gradcache import assert_grads_close, random_batch

from llm2vec.dataset import TrainExample

# rank 0's pairs are long, rank 1's short: with the budget below, rank 0 alone needs 2 chunks, rank 1 alone 1
RANK_PAIRS = [
    [
        (
            "Given a question, retrieve passages that answer it",
            "What is the capital of France, and which river runs through it?",
            "Paris is the capital of France. Berlin is the capital of Germany. Rome is in Italy.",
        ),
        (
            "Retrieve semantically similar text",
            "Large language models are trained on text",
            "Anchor embeddings reconstruct the document from the query and the query from the document.",
        ),
    ],
    [("", "fox", "The lazy dog."), ("", "Rome", "Italy.")],
]


def loop_cost(lengths, pairs):
    """Padded positions of running ``pairs`` together: per decoder call, the longest pair times the pairs."""
    return sum(max(lengths[i][c] for i in pairs) * len(pairs) for c in range(len(lengths[0])))


def spawn(stage, how, checkpoint, batch_file, budget, tmp_path):
    init = tmp_path / f"init{stage}{how}"
    mp.spawn(
        run_rank,
        args=(stage, how, str(init), checkpoint, str(batch_file), budget, str(tmp_path)),
        nprocs=WORLD,
        join=True,
    )
    return [torch.load(tmp_path / f"{stage}{how}{r}.pt") for r in range(WORLD)]


def stage_I_reference(model, collate, counts):
    """Sum over every pair of the global batch run alone (plain forward, step-wide counts): loss and gradients."""
    model.train()
    model.zero_grad(set_to_none=True)
    total = 0.0
    for pairs in RANK_PAIRS:
        for instruction, query, document in pairs:
            example = TrainExample(
                query=query, positive=document, negative=None, query_instruction=instruction, source="t"
            )
            loss = model(**{**collate([example]), "target_counts": counts}).loss
            loss.backward()
            total += loss.item()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_stage_I_chunks_with_unequal_plans_equal_every_pair_alone(llama_checkpoint, tmp_path, how):
    from llm2vec.chunked_steps import decoder_call_lengths
    from llm2vec.collator import TrainCollator
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    model = LLM2Vec_q2d_d2q.load(llama_checkpoint, alpha=0.2, attn_implementation="eager")
    collate = TrainCollator.for_encoder(model, reconstruction="text")
    batches = [collate([TrainExample(q, d, None, i, "t") for i, q, d in pairs]) for pairs in RANK_PAIRS]
    counts = {k: batches[0]["target_counts"][k] + batches[1]["target_counts"][k] for k in batches[0]["target_counts"]}
    lengths = [decoder_call_lengths(b, ("q2d", "d2q")).tolist() for b in batches]
    budget = max(loop_cost(lengths[1], [0, 1]), loop_cost(lengths[0], [0]), loop_cost(lengths[0], [1]))
    assert loop_cost(lengths[0], [0, 1]) > budget  # rank 0 alone: 2 chunks; rank 1 alone: 1
    ref_loss, ref_grads = stage_I_reference(model, collate, counts)
    torch.save({"ranks": batches, "counts": counts}, tmp_path / "batch.pt")

    ranks = spawn("I", how, llama_checkpoint, tmp_path / "batch.pt", budget, tmp_path)
    assert [r["own_plan"] for r in ranks] == [2, 1]
    assert [r["forwards"] for r in ranks] == [2, 2]  # rank 1 split its batch to match rank 0
    assert sum(r["loss"].item() for r in ranks) == pytest.approx(ref_loss, rel=1e-5)
    for r in ranks:
        assert_grads_close(r["grads"], ref_grads)


# Stage II: rank 0's texts are long, rank 1's short (query, positive, negative rows per rank)
RANK_0_LENGTHS = ([30, 28], [40, 36], [33, 31])
RANK_1_LENGTHS = ([6, 5], [8, 7], [9, 4])
STAGE_II_BUDGET = 40  # rank 0 alone: 6 chunks; rank 1 alone: 2


def alone(features, row):
    """Row ``row`` of a padded batch as a batch of one, cut to its real tokens."""
    mask = features["attention_mask"][row].bool()
    return {k: v[row][mask].unsqueeze(0) for k, v in features.items()}


def stage_II_reference(model, batch):
    """Every text embedded alone; the global batch's InfoNCE (mean over all queries) in float64."""
    model.train()
    model.zero_grad(set_to_none=True)
    n = batch["query"]["input_ids"].shape[0]
    e = {side: torch.cat([model.embed(alone(batch[side], i)) for i in range(n)]).double() for side in batch}
    q = F.normalize(e["query"], dim=-1)
    candidates = F.normalize(torch.cat([e["positive"], e["negative"]]), dim=-1)
    scores = model.loss_fn.scale * q @ candidates.T
    loss = torch.stack([torch.logsumexp(scores[i], 0) - scores[i, i] for i in range(n)]).mean()
    loss.backward()
    return loss.item(), {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_stage_II_gradient_cache_with_unequal_plans_equals_every_text_alone(llama_checkpoint, tmp_path, how):
    model = build_encoder(llama_checkpoint)
    lengths = [a + b for a, b in zip(RANK_0_LENGTHS, RANK_1_LENGTHS)]  # rows 0-1 on rank 0, rows 2-3 on rank 1
    batch = random_batch(lengths, model.pad_token_id, seed=5)
    ref_loss, ref_grads = stage_II_reference(model, batch)
    torch.save({"ranks": [slice_batch(batch, 0, 2), slice_batch(batch, 2, 4)]}, tmp_path / "batch.pt")

    ranks = spawn("II", how, llama_checkpoint, tmp_path / "batch.pt", STAGE_II_BUDGET, tmp_path)
    assert [r["own_plan"] for r in ranks] == [6, 2]
    assert [r["forwards"] for r in ranks] == [12, 12]  # two passes over 6 chunks on each rank
    assert sum(r["loss"].item() for r in ranks) / WORLD == pytest.approx(ref_loss, rel=1e-5)
    for r in ranks:
        assert_grads_close(r["grads"], ref_grads)
