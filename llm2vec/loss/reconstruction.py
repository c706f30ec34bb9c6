"""The Stage I loss: embedding-based bidirectional reconstruction (paper Sec. 3.2, Eq. 3-5, Algorithm 1)."""

from __future__ import annotations

import torch
from torch import nn

from ..packing import packed_call, packed_positions
from .linear_cross_entropy import linear_cross_entropy_sum

# what each direction predicts: the counterpart's text tokens (the paper's Eq. 3-4), or its whole prompt but the
# anchor (the authors' targets, not their pass: docs/departures.md)
RECONSTRUCTION_TARGETS = ("text", "all")


def pass_inputs(
    embed: nn.Module, anchor, target_ids, target_mask, dropout: float, prefix_ids
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(inputs_embeds, attention_mask, k)`` of one reconstruction pass: ``[Embed(prefix) ; e_X ; Embed(y_1) ; ...
    ; Embed(y_m)]`` (B, k + 1 + M, H), its mask (B, k + 1 + M) and k, the prefix's length."""
    target_embeds = drop_target_inputs(embed(target_ids), dropout)
    lead = anchor_block(embed, anchor, prefix_ids).to(target_embeds.dtype)  # (B, k + 1, H)
    k = lead.shape[1] - 1
    ones = torch.ones_like(target_mask[:, :1])
    return torch.cat([lead, target_embeds], dim=1), torch.cat([ones.expand(-1, k + 1), target_mask], dim=1), k


def reconstruction_states(
    decoder: nn.Module,
    anchor: torch.Tensor,
    target_ids: torch.Tensor,
    target_mask: torch.Tensor,
    input_dropout: float = 0.0,
    prefix_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The padded reconstruction pass: (B, M, H) final-layer states, row t predicting ``target_ids[:, t]``."""
    embed = decoder.get_input_embeddings()
    inputs_embeds, attention_mask, k = pass_inputs(embed, anchor, target_ids, target_mask, input_dropout, prefix_ids)
    batch, width = attention_mask.shape
    position_ids = torch.arange(width, device=attention_mask.device).expand(batch, width)
    hidden = decoder(
        inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    return hidden[:, k:-1]


def reconstruction_nll(
    decoder: nn.Module,
    lm_head: nn.Module,
    anchor: torch.Tensor,
    target_ids: torch.Tensor,
    target_mask: torch.Tensor,
    logit_chunk_rows: int = 0,
    input_dropout: float = 0.0,
    prefix_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over a batch of -log P(y_t | anchor, y_<t): the reconstruction pass.

    Args:
        decoder: the decoder body (``inputs_embeds`` -> ``last_hidden_state``) that made ``anchor``.
        lm_head: the causal LM's output layer.
        anchor: (B, H) anchor embeddings; target_ids, target_mask: (B, M) right-padded targets and their mask.
        logit_chunk_rows: 0 builds all logits at once; R > 0 builds them R rows at a time (the same sum).
        input_dropout: share of teacher-forced target inputs replaced by zero vectors (0: the paper's pass).
        prefix_ids: token ids read before the anchor (``None``: the paper's pass).
    """
    hidden = reconstruction_states(decoder, anchor, target_ids, target_mask, input_dropout, prefix_ids)
    predicting = target_mask.bool()
    return linear_cross_entropy_sum(hidden[predicting], lm_head, target_ids[predicting], logit_chunk_rows)


def reconstruction_token_nll(
    decoder: nn.Module,
    lm_head: nn.Module,
    anchor: torch.Tensor,
    target_ids: torch.Tensor,
    target_mask: torch.Tensor,
    prefix_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, M) float32 -log P(y_t | anchor, y_<t) of every target token (0 on padding), for measurements: the
    terms of :func:`reconstruction_nll`, without dropout."""
    hidden = reconstruction_states(decoder, anchor, target_ids, target_mask, 0.0, prefix_ids)
    logits = lm_head(hidden).float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target_ids, reduction="none")
    return nll * target_mask.to(nll.dtype)


def packed_reconstruction_nll(
    decoder: nn.Module,
    lm_head: nn.Module,
    passes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    logit_chunk_rows: int = 0,
    input_dropout: float = 0.0,
    prefix_ids: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """:func:`reconstruction_nll` of several passes, each ``(anchor, target_ids, target_mask)``, run as one packed
    decoder call; returns one sum per pass."""
    embed = decoder.get_input_embeddings()
    pieces, positions, predicting, labels = [], [], [], []
    for anchor, target_ids, target_mask in passes:
        sequence, sequence_mask, k = pass_inputs(embed, anchor, target_ids, target_mask, input_dropout, prefix_ids)
        real = sequence_mask.bool()
        pieces.append(sequence[real])
        positions.append(packed_positions(sequence_mask))
        # the anchor's column and target t < M predict y_1, y_{t+1} where real; prefix and last column nothing
        none = torch.zeros_like(target_mask[:, :1])
        predicts = torch.cat([none.expand(-1, k), target_mask, none], dim=1)
        predicting.append(predicts[real].bool())
        labels.append(target_ids[target_mask.bool()])
    states = packed_call(decoder, pieces, positions, embeds=True)
    return [
        linear_cross_entropy_sum(h[rows], lm_head, y, logit_chunk_rows)
        for h, rows, y in zip(states, predicting, labels)
    ]


def anchor_block(embed: nn.Module, anchor: torch.Tensor, prefix_ids: torch.Tensor | None) -> torch.Tensor:
    """The reconstruction input before the targets, (B, k + 1, H): ``[Embed(p_1..p_k) ; e_X]`` (the paper's: k = 0)."""
    block = anchor[:, None, :]
    if prefix_ids is None or len(prefix_ids) == 0:
        return block
    prefix = embed(prefix_ids.to(anchor.device))[None].expand(anchor.shape[0], -1, -1)
    return torch.cat([prefix.to(anchor.dtype), block], dim=1)


def drop_target_inputs(target_embeds: torch.Tensor, p: float) -> torch.Tensor:
    """Word dropout on the teacher-forced inputs (an option): each Embed(y_t) zeroed with probability ``p``."""
    if p <= 0.0:
        return target_embeds
    keep = torch.rand(target_embeds.shape[:-1], device=target_embeds.device) >= p
    return target_embeds * keep[..., None].to(target_embeds.dtype)


class WithoutWeightGradient(nn.Module):
    """``module`` run with its parameters detached: gradients reach its inputs, never its weights
    (``stop_decoder_gradient``, an option). Not for FSDP-sharded modules."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, *args, **kwargs):
        params = {name: p.detach() for name, p in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, params, args, kwargs)

    def get_input_embeddings(self) -> nn.Module:
        return WithoutWeightGradient(self.inner.get_input_embeddings())


def target_counts(query_targets: dict, positive_targets: dict) -> dict[str, torch.Tensor]:
    """Target tokens per direction of one batch: q2d predicts the documents, d2q the queries."""
    return {"q2d": positive_targets["attention_mask"].sum(), "d2q": query_targets["attention_mask"].sum()}


class ReconstructionLoss(nn.Module):
    """Eq. 5 over a batch of pairs, each direction a token mean:
    ``L = alpha * L_Q2D + (1 - alpha) * L_D2Q`` (docs/design.md).

    Args:
        alpha: weight of EBQ2D; ``1 - alpha`` weighs EBD2Q. The paper uses 0.2.
        logit_chunk_rows: build the LM-head logits this many target rows at a time (0: all); the same loss.
        packed: both directions in one packed decoder call (:func:`packed_reconstruction_nll`).
        input_dropout: in training mode, the share of teacher-forced target inputs zeroed (0, the paper's).
        prefix_ids: token ids read before the anchor (:func:`anchor_block`; none, the paper's).
        stop_decoder_gradient: the reconstruction pass with the decoder's weights detached (off, the paper's).

    ``forward(decoder, lm_head, query_embedding, document_embedding, query_targets, positive_targets, counts)``
    returns ``(loss, {"q2d": L_Q2D, "d2q": L_D2Q})``; ``counts`` defaults to the batch's :func:`target_counts`.
    """

    def __init__(
        self,
        alpha: float = 0.2,
        logit_chunk_rows: int = 0,
        packed: bool = False,
        input_dropout: float = 0.0,
        prefix_ids: tuple[int, ...] = (),
        stop_decoder_gradient: bool = False,
    ):
        super().__init__()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if logit_chunk_rows < 0:
            raise ValueError(f"logit_chunk_rows must be >= 0, got {logit_chunk_rows}")
        self.alpha = float(alpha)
        self.logit_chunk_rows = int(logit_chunk_rows)
        self.packed = bool(packed)
        if not 0.0 <= input_dropout < 1.0:
            raise ValueError(f"reconstruction_input_dropout must be in [0, 1), got {input_dropout}")
        self.input_dropout = float(input_dropout)
        self.prefix_ids = tuple(int(i) for i in prefix_ids)
        self.stop_decoder_gradient = bool(stop_decoder_gradient)

    def directions(self) -> tuple[str, ...]:
        """The directions computed: those whose weight in Eq. 5 is not 0."""
        return tuple(name for name, weight in (("q2d", self.alpha), ("d2q", 1.0 - self.alpha)) if weight != 0.0)

    def forward(
        self,
        decoder: nn.Module,
        lm_head: nn.Module,
        query_embedding: torch.Tensor,
        document_embedding: torch.Tensor,
        query_targets: dict,
        positive_targets: dict,
        counts: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        counts = counts if counts is not None else target_counts(query_targets, positive_targets)
        directions = {
            "q2d": (self.alpha, query_embedding, positive_targets),
            "d2q": (1.0 - self.alpha, document_embedding, query_targets),
        }
        weights = {name: directions[name][0] for name in self.directions()}
        passes = [directions[name][1:] for name in weights]
        args = [(anchor, targets["input_ids"], targets["attention_mask"]) for anchor, targets in passes]
        dropout = self.input_dropout if self.training else 0.0
        prefix = self.prefix_tensor()
        if self.stop_decoder_gradient:
            decoder, lm_head = WithoutWeightGradient(decoder), WithoutWeightGradient(lm_head)
        if self.packed:
            sums = packed_reconstruction_nll(decoder, lm_head, args, self.logit_chunk_rows, dropout, prefix)
        else:
            sums = [reconstruction_nll(decoder, lm_head, *a, self.logit_chunk_rows, dropout, prefix) for a in args]
        parts, loss = {}, None
        for (name, weight), nll in zip(weights.items(), sums):
            parts[name] = nll / counts[name]
            loss = weight * parts[name] if loss is None else loss + weight * parts[name]
        return loss, parts

    def token_nll(
        self,
        decoder: nn.Module,
        lm_head: nn.Module,
        query_anchor: torch.Tensor,
        document_anchor: torch.Tensor,
        query_targets: dict,
        positive_targets: dict,
    ) -> dict[str, torch.Tensor]:
        """``{direction: (B, M) token NLLs}`` of the directions computed (:func:`reconstruction_token_nll`): padded,
        no dropout, the decoder's own weights, this loss's prefix."""
        sides = {"q2d": (query_anchor, positive_targets), "d2q": (document_anchor, query_targets)}
        prefix = self.prefix_tensor()
        return {
            name: reconstruction_token_nll(
                decoder, lm_head, sides[name][0], sides[name][1]["input_ids"], sides[name][1]["attention_mask"], prefix
            )
            for name in self.directions()
        }

    def prefix_tensor(self) -> torch.Tensor | None:
        """The prefix ids as a tensor (``None`` without a prefix)."""
        return torch.tensor(self.prefix_ids, dtype=torch.long) if self.prefix_ids else None

    def extra_repr(self) -> str:
        text = f"alpha={self.alpha}, logit_chunk_rows={self.logit_chunk_rows}, packed={self.packed}"
        text += f", input_dropout={self.input_dropout}" if self.input_dropout else ""
        text += f", prefix_ids={self.prefix_ids}" if self.prefix_ids else ""
        return text + (", stop_decoder_gradient=True" if self.stop_decoder_gradient else "")
