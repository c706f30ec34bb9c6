"""One rank of the two-process (gloo) validation test: each process embeds its shard, the metrics are gathered."""

from __future__ import annotations

import json
import os

import torch
from _stage_II_dist_worker import build_encoder, fox_triples


def validation_triples(n: int = 7):
    """``n`` triples whose positives repeat every 5 (7 triples share 5 documents)."""
    return fox_triples(n, "v", query="which fox number {} jumps over the dog?", distinct_positives=5)


def measure(encoder, model=None, batch_size: int = 2, contrastive_batch: int = 3) -> dict:
    from llm2vec.collator import TrainCollator
    from llm2vec.validation import contrastive_validation

    collate = TrainCollator.for_encoder(encoder, with_negative=True)
    return contrastive_validation(
        model if model is not None else encoder,
        validation_triples(),
        collate,
        batch_size=batch_size,
        contrastive_batch=contrastive_batch,
        scale=encoder.loss_fn.scale,
        device=torch.device("cpu"),
    )


def run_validation_rank(rank: int, world_size: int, init_file: str, checkpoint: str, out_dir: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from _gloo import run_in_group

    def body():
        from torch.nn.parallel import DistributedDataParallel

        encoder = build_encoder(checkpoint)
        metrics = measure(encoder, DistributedDataParallel(encoder))
        with open(os.path.join(out_dir, f"validation{rank}.json"), "w") as f:
            json.dump(metrics, f)

    run_in_group(rank, world_size, init_file, body)
