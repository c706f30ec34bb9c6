"""Stage II model: the encoder (with LoRA adapters) trained by InfoNCE (paper Sec. 3.3, Eq. 6-7).

For a batch of (query Q, positive D+, hard negative D-) triples:

    e_Q, e_D+, e_D- = LLM2Vec.embed(...)          (the same anchor embedding as evaluation, Eq. 1)
    L = InfoNCE(e_Q ; [all e_D+ of the global batch ; all e_D- of the global batch])   (Eq. 6)

- The three embeddings are computed inside this module's ``forward``, which the trainer calls on the
  DDP-wrapped model, so DDP sees the whole computation and synchronises the gradients. (The authors'
  code computed the embeddings with the unwrapped model inside the trainer.)
- Candidates of other processes are gathered with gradient (:mod:`llm2vec.distributed`).
- ``negative=None`` trains on in-batch negatives only.
- ``encode`` works on the training model too: it calls ``LLM2Vec.embed``, not this ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .llm2vec import LLM2Vec
from .loss.infonce import InfoNCELoss


@dataclass
class ContrastiveOutput:
    loss: torch.Tensor
    query_embedding: torch.Tensor
    positive_embedding: torch.Tensor
    negative_embedding: torch.Tensor | None


class LLM2VecContrastive(LLM2Vec):
    """``LLM2Vec`` whose forward on (query, positive[, negative]) returns the Stage II InfoNCE loss.

    Args:
        model, tokenizer, **kwargs: as for :class:`LLM2Vec` (the model is usually a ``peft.PeftModel``).
        loss_scale: InfoNCE scale = 1 / tau (paper: tau = 0.05, scale 20).
    """

    def __init__(self, model, tokenizer, loss_scale: float = 20.0, **kwargs):
        super().__init__(model, tokenizer, **kwargs)
        self.loss_fn = InfoNCELoss(scale=loss_scale)

    def forward(self, query: dict, positive: dict, negative: dict | None = None):
        e_q = self.embed(query)
        e_p = self.embed(positive)
        e_n = self.embed(negative) if negative is not None else None
        return ContrastiveOutput(self.loss_fn(e_q, e_p, e_n), e_q, e_p, e_n)
