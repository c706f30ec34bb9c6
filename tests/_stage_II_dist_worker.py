"""Helpers for the Stage II tests: a tiny LoRA encoder, training triples for it, and one rank of the two-process
(gloo) step."""

from __future__ import annotations

import os

import torch

LR = 0.5


def build_encoder(
    checkpoint: str, seed: int = 0, loss_scale: float = 20.0, lora_dropout: float = 0.0, embedding_token_budget: int = 0
):
    """A tiny ``LLM2VecContrastive`` with LoRA (no dropout by default) whose B matrices are random, so A gets
    gradients too."""
    from llm2vec.arguments import ModelArguments, StageIIArguments
    from llm2vec.llm2vec_contrastive import LLM2VecContrastive

    stage = StageIIArguments(
        lora_r=4,
        lora_alpha=8,
        lora_dropout=lora_dropout,
        loss_scale=loss_scale,
        embedding_token_budget=embedding_token_budget,
    )
    torch.manual_seed(seed)  # peft's random A matrices
    model = LLM2VecContrastive.build(ModelArguments(model_name_or_path=checkpoint), stage, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return model


def fox_triples(
    n: int, source: str, query: str = "which fox {} jumps over the dog?", distinct_positives: int | None = None
) -> list:
    """``n`` training triples of ``source`` with the instruction "Retrieve passages": query ``query.format(i)``,
    a positive about fox ``i`` (fox ``i % distinct_positives`` with ``distinct_positives``), a negative about Berlin."""
    from llm2vec.dataset import TrainExample

    return [
        TrainExample(
            query=query.format(i),
            positive=f"The quick brown fox {i % (distinct_positives or n)} jumps.",
            negative=f"Berlin is the capital of Germany, {i} times.",
            query_instruction="Retrieve passages",
            source=source,
        )
        for i in range(n)
    ]


def lora_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def slice_batch(batch: dict, start: int, stop: int) -> dict:
    return {side: {k: v[start:stop] for k, v in features.items()} for side, features in batch.items()}


def sgd_step(model, loss: torch.Tensor) -> None:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def run_rank(rank: int, world_size: int, init_file: str, checkpoint: str, batch_file: str, out_dir: str) -> None:
    """One process: DDP-wrapped encoder, this rank's rows of the union batch, one SGD step; saves loss and LoRA."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from _gloo import run_in_group

    def body():
        from torch.nn.parallel import DistributedDataParallel

        model = build_encoder(checkpoint)
        batch = torch.load(batch_file)
        rows = batch["query"]["input_ids"].shape[0] // world_size
        local = slice_batch(batch, rank * rows, (rank + 1) * rows)
        ddp = DistributedDataParallel(model)
        loss = ddp(**local).loss
        sgd_step(model, loss)
        torch.save({"loss": loss.detach(), "lora": lora_state(model)}, os.path.join(out_dir, f"rank{rank}.pt"))

    run_in_group(rank, world_size, init_file, body)


def run_gather_rank(rank: int, world_size: int, init_file: str, data_file: str, out_dir: str) -> None:
    """One process: InfoNCE of this rank's queries against the gathered candidates; saves the loss and the
    gradients of this rank's query, positive and negative embeddings."""
    torch.set_num_threads(1)
    from _gloo import run_in_group

    def body():
        from llm2vec.loss.infonce import InfoNCELoss

        data = torch.load(data_file)
        rows = data["query"].shape[0] // world_size
        local = {k: v[rank * rows : (rank + 1) * rows].clone().requires_grad_(True) for k, v in data.items()}
        loss = InfoNCELoss(data["scale"].item() if "scale" in data else 20.0)(
            local["query"], local["positive"], local["negative"]
        )
        loss.backward()
        torch.save(
            {"loss": loss.detach(), **{k: v.grad for k, v in local.items()}}, os.path.join(out_dir, f"gather{rank}.pt")
        )

    run_in_group(rank, world_size, init_file, body)


def run_gradcache_rank(
    rank: int, world_size: int, init_file: str, checkpoint: str, batch_files: list[str], budget: int, out_dir: str
) -> None:
    """One process: on each batch in turn (consecutive steps of the same two DDP-wrapped encoders), the plain step
    on one encoder and the gradient-cached step (token budget ``budget``) on the other, this rank's rows; saves per
    batch both losses, both sets of LoRA gradients (after DDP's all-reduce), the number of chunks this rank's texts
    alone would make and the number of forward passes of the cached step."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from _gloo import run_in_group

    def body():
        from torch.nn.parallel import DistributedDataParallel

        from llm2vec.chunked_steps import plan_chunks, rows_of

        plain = DistributedDataParallel(build_encoder(checkpoint))
        encoder = build_encoder(checkpoint, embedding_token_budget=budget)
        cached = DistributedDataParallel(encoder)
        forwards = []
        encoder.register_forward_pre_hook(lambda module, args: forwards.append(1))
        for case, batch_file in enumerate(batch_files):
            batch = torch.load(batch_file)
            rows = batch["query"]["input_ids"].shape[0] // world_size
            local = slice_batch(batch, rank * rows, (rank + 1) * rows)
            plain.zero_grad(set_to_none=True)
            encoder.zero_grad(set_to_none=True)
            plain_loss = plain(**local).loss
            plain_loss.backward()
            forwards.clear()
            out = encoder.step_in_parts(cached, local, lambda t, grad=None: t.backward(grad), cached.no_sync)
            lengths = [len(r["input_ids"]) for side in local.values() for r in rows_of(side)]
            grads = {n: p.grad.clone() for n, p in plain.module.named_parameters() if p.requires_grad}
            cached_grads = {n: p.grad.clone() for n, p in encoder.named_parameters() if p.requires_grad}
            torch.save(
                {
                    "plain_loss": plain_loss.detach(),
                    "cached_loss": out.loss.detach(),
                    "plain": grads,
                    "cached": cached_grads,
                    "own_plan": len(plan_chunks(lengths, budget)),
                    "forwards": len(forwards),
                },
                os.path.join(out_dir, f"gradcache{case}_{rank}.pt"),
            )

    run_in_group(rank, world_size, init_file, body)


def run_autocast_rank(
    rank: int, world_size: int, init_file: str, checkpoint: str, batch_file: str, budget: int, out_dir: str
) -> None:
    """One process under bf16 autocast (as the Trainer's mixed precision wraps the model's forward): the plain step
    and the gradient-cached step on this rank's rows, each through a DDP-wrapped encoder. Saves, per step, the loss,
    this rank's embeddings and the gradient of the loss with respect to them (what the step back-propagates into the
    encoder: ``retain_grad`` for the plain step, the cache handed to ``backward`` for the cached one)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from _gloo import run_in_group

    def body():
        from torch.nn.parallel import DistributedDataParallel

        batch = torch.load(batch_file)
        rows = batch["query"]["input_ids"].shape[0] // world_size
        local = slice_batch(batch, rank * rows, (rank + 1) * rows)
        results = {}
        plain_encoder = build_encoder(checkpoint)
        plain_encoder.train()
        plain = DistributedDataParallel(plain_encoder)
        results["plain"] = autocast_plain_step(plain, local)
        encoder = build_encoder(checkpoint, embedding_token_budget=budget)
        encoder.train()
        cached = DistributedDataParallel(encoder)
        results["cached"] = autocast_cached_step(encoder, cached, local)
        torch.save(results, os.path.join(out_dir, f"autocast{rank}.pt"))

    run_in_group(rank, world_size, init_file, body)


SIDES = ("query", "positive", "negative")


def autocast_plain_step(model, batch: dict) -> dict:
    """The plain step (loss inside ``forward``) under bf16 autocast: loss, embeddings, d loss / d embeddings."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch)
    embeddings = [getattr(out, f"{side}_embedding") for side in SIDES if side in batch]
    for e in embeddings:
        e.retain_grad()
    out.loss.backward()
    return {
        "loss": out.loss.detach(),
        "embeddings": [e.detach() for e in embeddings],
        "grads": [e.grad.detach() for e in embeddings],
    }


def autocast_cached_step(encoder, wrapped, batch: dict) -> dict:
    """The gradient-cached step under bf16 autocast: loss, pass-1 embeddings and the cached d loss / d embeddings
    (collected from the ``backward`` calls of pass 2 and put back in the embeddings' order)."""
    handed = []

    def backward(tensor, grad=None):
        handed.append(grad.detach().clone())
        tensor.backward(grad)

    no_sync = getattr(wrapped, "no_sync", None) or __import__("contextlib").nullcontext
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = encoder.step_in_parts(wrapped, batch, backward, no_sync)
    from llm2vec.chunked_steps import plan_chunks, rows_of

    sides = [side for side in SIDES if side in batch]
    lengths = [len(r["input_ids"]) for side in sides for r in rows_of(batch[side])]
    chunks = plan_chunks(lengths, encoder.embedding_token_budget, min_chunks=len(handed))
    assert len(chunks) == len(handed), "the chunk plan was not reproduced"
    grads = torch.empty((len(lengths), handed[0].shape[-1]), dtype=handed[0].dtype)
    for chunk, grad in zip(chunks, handed):
        grads[torch.tensor(chunk)] = grad
    embeddings = [getattr(out, f"{side}_embedding") for side in sides]
    return {
        "loss": out.loss,
        "embeddings": embeddings,
        "grads": list(grads.split(batch["query"]["input_ids"].shape[0])),
    }
