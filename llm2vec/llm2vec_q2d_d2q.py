"""Stage I model: the encoder plus its causal LM head, trained by bidirectional reconstruction.

For a batch of (query Q, document D) pairs (paper Sec. 3.2, Algorithm 1):

    e_Q = f(Q ; [EOS])[-1],   e_D = f(D ; [EOS])[-1]                        (Eq. 1, the anchor embeddings)
    L_Q2D = - sum_t log P(d_t | e_Q, d_<t)                                 (Eq. 3, EBQ2D)
    L_D2Q = - sum_t log P(q_t | e_D, q_<t)                                 (Eq. 4, EBD2Q)
    L     = alpha * L_Q2D + (1 - alpha) * L_D2Q,   alpha = 0.2 by default  (Eq. 5)

- e_Q and e_D are final-layer hidden states at the anchor token, from an encoding pass with the real
  attention mask (the same ``LLM2Vec.embed`` that evaluation uses). They are *not* detached: the
  gradients of both reconstruction losses flow through them into the encoding pass.
- The reconstruction pass (:func:`llm2vec.loss.reconstruction_nll`) reads [e_X ; Embed(y_1..y_m)] with the
  anchor at position 0 and the targets at consecutive positions 1..m, whatever the padding.
- Targets (``reconstruction_targets``): ``"text"`` (default, the paper's Eq. 3-4) predicts the
  counterpart's text tokens only; ``"all"`` (the authors' code) predicts every token of the counterpart's
  prompt except its anchor: BOS, chat header and instruction included.
- Averaging: each direction is a mean over target *tokens*. Under the trainer the denominator is the
  number of target tokens of that direction in the whole optimizer step (all micro-batches of the
  gradient accumulation, all ranks; passed as ``target_counts``), so accumulation and data parallelism
  give the same gradient as one big batch. Without ``target_counts`` the batch's own counts are used.
- A direction whose weight is 0 (alpha = 0 or 1) is not computed at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from .llm2vec import LLM2Vec, decoder_body
from .loss import reconstruction_nll

RECONSTRUCTION_TARGETS = ("text", "all")


@dataclass
class StageIOutput:
    loss: torch.Tensor
    loss_q2d: torch.Tensor | None
    loss_d2q: torch.Tensor | None
    query_embedding: torch.Tensor
    document_embedding: torch.Tensor


class LLM2Vec_q2d_d2q(LLM2Vec):
    """``LLM2Vec`` over a causal LM, whose forward returns the Stage I loss of a batch of pairs."""

    def __init__(self, model, tokenizer, alpha: float = 0.2, reconstruction_targets: str = "text", **kwargs):
        super().__init__(model, tokenizer, **kwargs)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if reconstruction_targets not in RECONSTRUCTION_TARGETS:
            raise ValueError(f"reconstruction_targets must be one of {RECONSTRUCTION_TARGETS}, got {reconstruction_targets!r}")
        if model.get_output_embeddings() is None:
            raise ValueError("Stage I needs a causal LM with its LM head (load it with AutoModelForCausalLM)")
        self.alpha = float(alpha)
        self.reconstruction_targets = reconstruction_targets

    @staticmethod
    def _load_model(path: str, **kwargs):
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)

    @staticmethod
    def count_targets(batch: dict) -> dict[str, torch.Tensor]:
        """Target tokens per direction in a collated batch (the trainer sums these over a whole step)."""
        return {"q2d": batch["positive_targets"]["attention_mask"].sum(), "d2q": batch["query_targets"]["attention_mask"].sum()}

    def _direction(self, anchor: torch.Tensor, targets: dict, count: torch.Tensor | None) -> torch.Tensor:
        lm_head = self.model.get_output_embeddings()
        total, n = reconstruction_nll(decoder_body(self.model), lm_head, anchor, targets["input_ids"], targets["attention_mask"])
        return total / (count if count is not None else n)

    def forward(
        self,
        query: dict,
        positive: dict,
        query_targets: dict,
        positive_targets: dict,
        negative: dict | None = None,
        target_counts: dict[str, torch.Tensor] | None = None,
    ) -> StageIOutput:
        """Stage I loss of a batch; ``negative`` is accepted and ignored (Stage I uses pairs only)."""
        counts = target_counts or {}
        e_q = self.embed(query)
        e_d = self.embed(positive)
        loss_q2d = self._direction(e_q, positive_targets, counts.get("q2d")) if self.alpha > 0 else None
        loss_d2q = self._direction(e_d, query_targets, counts.get("d2q")) if self.alpha < 1 else None
        loss = sum(w * l for w, l in ((self.alpha, loss_q2d), (1 - self.alpha, loss_d2q)) if l is not None)
        return StageIOutput(loss, loss_q2d, loss_d2q, e_q, e_d)
