"""Helpers for the Stage II tests: a tiny LoRA encoder, and one rank of the two-process (gloo) step."""

from __future__ import annotations

import os

import torch

LR = 0.5


def build_encoder(checkpoint: str, seed: int = 0, loss_scale: float = 20.0):
    """A tiny ``LLM2VecContrastive`` with LoRA (no dropout) whose B matrices are random, so A gets gradients too."""
    from transformers import AutoTokenizer

    from llm2vec.arguments import ExperimentArguments, ModelArguments
    from llm2vec.llm2vec_contrastive import LLM2VecContrastive
    from llm2vec.stage_II import load_lora_model

    exp = ExperimentArguments(stage="II", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    torch.manual_seed(seed)  # peft's random A matrices
    peft_model = load_lora_model(ModelArguments(model_name_or_path=checkpoint), exp, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return LLM2VecContrastive(peft_model, AutoTokenizer.from_pretrained(checkpoint), loss_scale=loss_scale)


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
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = build_encoder(checkpoint)
        batch = torch.load(batch_file)
        rows = batch["query"]["input_ids"].shape[0] // world_size
        local = slice_batch(batch, rank * rows, (rank + 1) * rows)
        ddp = DistributedDataParallel(model)
        loss = ddp(**local).loss
        sgd_step(model, loss)
        torch.save({"loss": loss.detach(), "lora": lora_state(model)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
