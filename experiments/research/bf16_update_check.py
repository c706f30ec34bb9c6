"""How many weights one pure-bf16 AdamW step leaves unchanged (the ``master_weights`` choice, in numbers).

    python experiments/research/bf16_update_check.py                      # cache/models/SmolLM2-135M-Instruct
    python experiments/research/bf16_update_check.py --model PATH --lr 4e-5 2e-4
    python experiments/research/bf16_update_check.py --tiny               # a random tiny Llama-3 model, no files needed

One Stage I batch (the paper's reconstruction loss, alpha 0.2, on built-in (query, passage) pairs) gives a
gradient of the model in bfloat16, as a pure-bf16 run computes it. From the same bf16 weights, one AdamW
step (the Trainer's defaults: betas 0.9 / 0.999, eps 1e-8, no weight decay) is taken twice:

- pure bf16 (``master_weights: bf16``, the authors'): the weights and AdamW states are bf16; the new
  weight is the old one plus the update, rounded to bf16;
- fp32 master weights (``master_weights: fp32``): a float32 copy of the same weights takes the step.

Adam's first step moves every weight with a non-negligible gradient by about the learning rate
(``lr * g / (|g| + eps)``), so 4e-5 is below half the bf16 spacing of any weight of magnitude >= 2^-7
(0.0078) and rounds away there. Printed: the fraction of weights the bf16 step leaves exactly unchanged,
overall and per kind of tensor, next to the fraction the fp32 step leaves unchanged (zero gradients).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

from llm2vec.collator import TrainCollator
from llm2vec.dataset import TrainExample
from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

DEFAULT_MODEL = "cache/models/SmolLM2-135M-Instruct"
PAIRS = [
    (
        "Given a question, retrieve Wikipedia passages that answer the question",
        "what is the capital of france",
        "Paris is the capital and largest city of France, on the Seine.",
    ),
    (
        "Given a web search query, retrieve relevant passages that answer the query",
        "how do index funds work",
        "An index fund holds the securities of a market index and tracks its return at low cost.",
    ),
    (
        "Given a claim, retrieve documents that support or refute the claim",
        "the moon is made of cheese",
        "The Moon's crust is made of rock: anorthosite in the highlands and basalt in the maria.",
    ),
    (
        "Retrieve semantically similar text",
        "a man is playing a guitar on stage",
        "A musician performs a song with his guitar in front of an audience.",
    ),
    (
        "Given a question, retrieve questions that are semantically equivalent to the given question",
        "how can i learn python quickly",
        "What is the fastest way to learn the Python programming language?",
    ),
    (
        "Retrieve Wikipedia passages that answer the question",
        "who wrote the iliad",
        "The Iliad is an ancient Greek epic poem traditionally attributed to Homer.",
    ),
    (
        "Given a multi-hop question, retrieve documents that can help answer the question",
        "which river flows through the city where the eiffel tower stands",
        "The Seine flows through Paris, where the Eiffel Tower was built for the 1889 World's Fair.",
    ),
    (
        "Provided a user question, retrieve the highest voted answers on Reddit ELI5 forum",
        "why is the sky blue",
        "Sunlight is scattered by air molecules, and blue light is scattered much more than red light.",
    ),
]


KINDS = {"embed_tokens": "embeddings", "lm_head": "lm_head", "norm": "norms", "self_attn": "attention", "mlp": "mlp"}


def kind(name: str) -> str:
    return next((label for key, label in KINDS.items() if key in name), "other")


def load(args) -> LLM2Vec_q2d_d2q:
    if args.tiny:
        from llm2vec.testing import build_tiny_model

        causal_lm, tokenizer = build_tiny_model("llama3", hidden_size=64)
        return LLM2Vec_q2d_d2q(causal_lm.to(torch.bfloat16), tokenizer, max_length=args.max_length)
    if not os.path.isdir(args.model):
        how = "convert SmolLM2 first (python experiments/demo/smollm2.py), pass --model, or use --tiny"
        raise SystemExit(f"error: no model at {args.model}; {how}")
    return LLM2Vec_q2d_d2q.load(args.model, dtype=torch.bfloat16, max_length=args.max_length)


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], lr: float) -> list[torch.Tensor]:
    """One AdamW step on copies of ``params`` (their dtype) with ``grads``; returns the new values."""
    leaves = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for leaf, g in zip(leaves, grads):
        leaf.grad = g.to(leaf.dtype).clone()
    torch.optim.AdamW(leaves, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    return [leaf.detach() for leaf in leaves]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a causal LM folder (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama-3 model instead of --model")
    parser.add_argument("--lr", type=float, nargs="+", default=[4e-5], help="learning rates (default: 4e-5)")
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = load(args)
    model.train()
    examples = [
        TrainExample(query=q, positive=d, negative=None, query_instruction=i, source="check") for i, q, d in PAIRS
    ]
    batch = TrainCollator.for_encoder(model, reconstruction="text", instruction_separator="; ")(examples)
    loss = model(**batch).loss
    loss.backward()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p.detach() for _, p in named]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in named]
    total = sum(p.numel() for p in params)
    source = "random tiny Llama-3" if args.tiny else args.model
    print(
        f"model: {source}, {total / 1e6:.1f} M trainable parameters in bfloat16; one Stage I batch of "
        f"{len(PAIRS)} pairs, loss {loss.item():.3f}; AdamW betas (0.9, 0.999), eps 1e-8, no weight decay"
    )
    for lr in args.lr:
        bf16 = adamw_step(params, grads, lr)
        fp32 = adamw_step([p.float() for p in params], [g.float() for g in grads], lr)
        sizes, same_bf16, same_fp32 = defaultdict(int), defaultdict(int), defaultdict(int)
        for (name, p), new_bf16, new_fp32 in zip(named, bf16, fp32):
            sizes[kind(name)] += p.numel()
            same_bf16[kind(name)] += int((new_bf16 == p).sum())
            same_fp32[kind(name)] += int((new_fp32 == p.float()).sum())
        print(f"\nlr {lr:g}: weights left exactly unchanged by one step")
        print(f"  {'tensors':<12}{'weights':>12}{'bf16 (pure)':>14}{'fp32 master':>14}")
        for k in sorted(sizes):
            print(f"  {k:<12}{sizes[k]:>12,}{same_bf16[k] / sizes[k]:>14.1%}{same_fp32[k] / sizes[k]:>14.1%}")
        print(
            f"  {'all':<12}{total:>12,}{sum(same_bf16.values()) / total:>14.1%}{sum(same_fp32.values()) / total:>14.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
