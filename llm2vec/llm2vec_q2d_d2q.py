"""Stage I model: the encoder plus its causal LM head, trained by bidirectional reconstruction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from .anchor_gain import anchor_gain
from .chunked_steps import COUNTS_KEY, decoder_call_lengths, decoder_positions, reconstruction_step
from .llm2vec import LLM2Vec, decoder_body
from .loss import ReconstructionLoss
from .loss.reconstruction import target_counts as count_targets


@dataclass
class StageIOutput:
    loss: torch.Tensor
    loss_q2d: torch.Tensor | None
    loss_d2q: torch.Tensor | None
    query_embedding: torch.Tensor
    document_embedding: torch.Tensor
    positions: int = 0  # positions the decoder calls processed, padding included
    real_positions: torch.Tensor | int = 0  # of which real tokens (a tensor: no device sync in the step)
    chunks: int = 1  # forward/backward passes the batch took (token_budget)

    @property
    def loss_parts(self) -> dict[str, torch.Tensor]:
        """The loss's parts, logged under these names."""
        parts = {"loss_q2d": self.loss_q2d, "loss_d2q": self.loss_d2q}
        return {name: value for name, value in parts.items() if value is not None}

    @property
    def metrics(self) -> dict[str, torch.Tensor | float]:
        """Logged as means over micro-batches: the padded share of the decoder calls' positions, and the chunks."""
        padding = 1 - self.real_positions / self.positions if self.positions else 0.0
        return {"padding_fraction": padding, "chunks": float(self.chunks)}

    @classmethod
    def combine(cls, parts: list[StageIOutput], chunks: list[list[int]]) -> StageIOutput:
        """One detached output of a batch run in ``chunks`` (pair indices) with outputs ``parts``: losses summed
        (each is its share of the step-wide mean), embeddings in batch order."""
        order = torch.tensor([i for rows in chunks for i in rows], device=parts[0].loss.device)
        inverse = torch.argsort(order)

        def total(name):
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.stack([v.detach() for v in values]).sum()

        return cls(
            total("loss"),
            total("loss_q2d"),
            total("loss_d2q"),
            torch.cat([p.query_embedding.detach() for p in parts])[inverse],
            torch.cat([p.document_embedding.detach() for p in parts])[inverse],
            positions=sum(p.positions for p in parts),
            real_positions=sum(p.real_positions for p in parts),
            chunks=len(parts),
        )


class LLM2Vec_q2d_d2q(LLM2Vec):
    """``LLM2Vec`` over a causal LM, whose forward returns the Stage I loss of a batch of pairs.

    Args:
        model, tokenizer, **kwargs: as for :class:`LLM2Vec`; the model must keep its LM head.
        alpha: weight of EBQ2D in Eq. 5 (the paper's 0.2).
        token_budget: most decoder positions of one forward/backward (0: the whole batch); :meth:`step_in_parts`.
        logit_chunk_rows: LM-head logits built this many target rows at a time (0: all at once).
        reconstruction_input_dropout, reconstruction_prefix, stop_decoder_gradient: options, not the paper's
            (:mod:`llm2vec.loss.reconstruction`): word dropout on the teacher-forced inputs, a text read before
            the anchor, the decoder's weights read without gradient in the reconstruction pass.
    """

    backbone_class = AutoModelForCausalLM

    def __init__(
        self,
        model,
        tokenizer,
        alpha: float = 0.2,
        token_budget: int = 0,
        logit_chunk_rows: int = 0,
        reconstruction_input_dropout: float = 0.0,
        reconstruction_prefix: str = "",
        stop_decoder_gradient: bool = False,
        **kwargs,
    ):
        super().__init__(model, tokenizer, **kwargs)
        if model.get_output_embeddings() is None:
            raise ValueError("Stage I needs a causal LM with its LM head (load it with AutoModelForCausalLM)")
        if token_budget < 0:
            raise ValueError(f"token_budget must be >= 0, got {token_budget}")
        prefix_ids = (
            tokenizer(reconstruction_prefix, add_special_tokens=False)["input_ids"] if reconstruction_prefix else ()
        )
        self.loss_fn = ReconstructionLoss(
            alpha,
            logit_chunk_rows=logit_chunk_rows,
            packed=self.packing,
            input_dropout=reconstruction_input_dropout,
            prefix_ids=prefix_ids,
            stop_decoder_gradient=stop_decoder_gradient,
        )
        self.token_budget = int(token_budget)

    @classmethod
    def build(cls, model_args, stage_args, dtype: torch.dtype) -> LLM2Vec_q2d_d2q:
        """The Stage I model of a run config."""
        return cls.load(
            model_args.model_name_or_path,
            pooling_mode=model_args.pooling_mode,
            max_length=model_args.max_seq_length,
            template=model_args.template,
            dtype=dtype,
            attn_implementation=model_args.attn_implementation,
            alpha=stage_args.alpha,
            token_budget=stage_args.token_budget,
            logit_chunk_rows=stage_args.logit_chunk_rows,
            reconstruction_input_dropout=stage_args.reconstruction_input_dropout,
            reconstruction_prefix=stage_args.reconstruction_prefix,
            stop_decoder_gradient=stage_args.stop_decoder_gradient,
            packing=model_args.use_packing,
            trust_remote_code=model_args.trust_remote_code,
        )

    def describe(self) -> str:
        text = f"template {self.template.name}, alpha {self.loss_fn.alpha:.2f}"
        if self.token_budget:
            counted = "real" if self.packing else "padded"
            text += f", token budget {self.token_budget} {counted} positions per forward/backward"
        if self.loss_fn.logit_chunk_rows:
            text += f", LM-head logits {self.loss_fn.logit_chunk_rows} target rows at a time"
        if self.packing:
            text += ", packed decoder calls (2 per chunk: encoding, both reconstructions)"
        if self.loss_fn.input_dropout:
            text += f", reconstruction input dropout {self.loss_fn.input_dropout:g} (an option, not the paper's)"
        if self.loss_fn.stop_decoder_gradient:
            text += ", decoder weights detached in the reconstruction pass (an option, not the paper's)"
        if self.loss_fn.prefix_ids:
            text += f", {len(self.loss_fn.prefix_ids)} prefix token(s) before the anchor (an option, not the paper's)"
        return text

    def validation_metrics(self, model, pairs, collate, args) -> dict[str, float]:
        """What the trainer logs at each evaluation: the anchor measures per direction
        (:func:`llm2vec.anchor_gain.anchor_gain`, every process all pairs) and their Eq. 5 combination as ``loss``."""
        size = max(2, args.per_device_eval_batch_size)
        starts = list(range(0, len(pairs), size))
        if len(starts) > 1 and len(pairs) - starts[-1] < 2:
            starts.pop()
        ends = starts[1:] + [len(pairs)]
        sources = [getattr(p, "source", None) for p in pairs]
        by_batch = [sources[a:b] for a, b in zip(starts, ends)] if len(set(sources)) > 1 else None
        metrics = anchor_gain(model, [collate(pairs[a:b]) for a, b in zip(starts, ends)], sources=by_batch)
        parts = {d: metrics[f"loss_{d}"] for d in self.loss_fn.directions()}
        weights = {"q2d": self.loss_fn.alpha, "d2q": 1.0 - self.loss_fn.alpha}
        return {"loss": sum(weights[d] * v for d, v in parts.items()), **metrics}

    def forward(
        self,
        query: dict | None = None,
        positive: dict | None = None,
        query_targets: dict | None = None,
        positive_targets: dict | None = None,
        target_counts: dict[str, torch.Tensor] | None = None,
        anchor_shifts: tuple[int, ...] = (),
        *,
        features: dict | None = None,
    ) -> StageIOutput | dict[str, torch.Tensor] | torch.Tensor:
        """Stage I loss of a collated batch; ``target_counts`` as in :class:`ReconstructionLoss`. ``anchor_shifts``
        (s_1..s_S) measures instead (:mod:`llm2vec.anchor_gain`): pair i reconstructed from pair (i + s) mod B's
        anchors, ``{direction: (S, B, M) token NLLs, "anchors": (2, B, H)}``. ``features`` alone: :meth:`embed`."""
        if features is not None:
            return self.embed(features)
        e_q, e_d = self.embed_many([query, positive])
        decoder, lm_head = decoder_body(self.model), self.model.get_output_embeddings()
        if anchor_shifts:
            per_shift = [
                self.loss_fn.token_nll(
                    decoder, lm_head, e_q.roll(-s, dims=0), e_d.roll(-s, dims=0), query_targets, positive_targets
                )
                for s in anchor_shifts
            ]
            out = {name: torch.stack([nll[name] for nll in per_shift]) for name in per_shift[0]}
            return {**out, "anchors": torch.stack([e_q, e_d]).detach()}
        loss, parts = self.loss_fn(decoder, lm_head, e_q, e_d, query_targets, positive_targets, target_counts)
        batch = dict(query=query, positive=positive, query_targets=query_targets, positive_targets=positive_targets)
        directions = self.loss_fn.directions()
        return StageIOutput(
            loss,
            parts.get("q2d"),
            parts.get("d2q"),
            e_q,
            e_d,
            positions=decoder_positions(batch, directions, self.packing),
            real_positions=decoder_call_lengths(batch, directions).sum(),
        )

    def step_in_parts(self, model, inputs: dict, backward, no_sync) -> StageIOutput | None:
        """Forward and backward in token-budget chunks of pairs (step-wide ``target_counts``); ``None``: no budget."""
        if not self.token_budget:
            return None
        counts = inputs.get(COUNTS_KEY) or count_targets(inputs["query_targets"], inputs["positive_targets"])
        directions = self.loss_fn.directions()
        parts, chunks = reconstruction_step(
            model, inputs, self.token_budget, self.packing, directions, counts, backward, no_sync
        )
        return StageIOutput.combine(parts, chunks)
