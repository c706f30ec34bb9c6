"""References that share no code path with the batched steps they check (packing, the gradient cache).

Each text goes through the model alone: its real tokens as a batch of one, no padding, no packing, no mask, the
model's own default positions. Losses are written from the paper's equations, one pair or one query at a time,
and accumulated in float64:

- :func:`stage_I_loss_by_hand`: Eq. 3-5, one decoder call per text and per reconstruction;
- :func:`infonce_by_hand`: Eq. 6-7, the candidates of each query listed in a Python loop.

Back-propagating these losses gives the reference gradients (autograd through the float32 model).
"""

from __future__ import annotations

import torch


def real_rows(features: dict) -> list[tuple[torch.Tensor, int]]:
    """Each row of a padded batch as (its real token ids, the index of its first text token among them)."""
    rows = []
    for ids, real, text in zip(features["input_ids"], features["attention_mask"], features["text_mask"]):
        real = real.bool()
        text_flags = text[real].tolist()
        rows.append((ids[real], text_flags.index(1) if 1 in text_flags else len(text_flags)))
    return rows


def target_rows(targets: dict) -> list[torch.Tensor]:
    """The real ids of each row of right- or left-padded reconstruction targets."""
    return [ids[real.bool()] for ids, real in zip(targets["input_ids"], targets["attention_mask"])]


def pool_by_layout(states: torch.Tensor, text_start: int, mode: str) -> torch.Tensor:
    """One text's vector from its (n, H) states, by position: the paper's Eq. 1 (``eos_token``: the state of the
    appended anchor, the last token) and the other pooling modes of the project."""
    if mode == "eos_token":
        return states[-1]
    if mode == "last_token":
        return states[-2]
    text = states[text_start:]  # the text's tokens and the anchor; no template prefix, no instruction
    weights = torch.ones(len(text)) if mode == "mean" else torch.arange(1, len(text) + 1, dtype=torch.float32)
    return (weights[:, None].to(text.dtype) * text).sum(0) / weights.sum()


def embed_alone(body, features: dict, mode: str = "eos_token") -> torch.Tensor:
    """(B, H): each row's real tokens through ``body`` (the decoder, or a PEFT model around it) on their own."""
    vectors = []
    for ids, text_start in real_rows(features):
        states = body(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        vectors.append(pool_by_layout(states, text_start, mode))
    return torch.stack(vectors)


def reconstruction_nll_alone(body, lm_head, anchor: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-sum_t log P(y_t | anchor, y_<t) for one pair (Eq. 3 or 4): [anchor ; Embed(y_1..y_m)] through the decoder
    alone, the state at t - 1 predicting y_t; the log-probabilities in float64."""
    sequence = torch.cat([anchor[None], body.get_input_embeddings()(targets)])
    states = body(inputs_embeds=sequence[None], use_cache=False).last_hidden_state[0]
    logits = lm_head(states[:-1]).double()
    return -logits.log_softmax(-1).gather(1, targets[:, None]).sum()


def stage_I_loss_by_hand(causal_lm, batch: dict, alpha: float) -> dict[str, torch.Tensor]:
    """Eq. 5 over a collated Stage I batch, pair by pair (float64): ``{"loss", "q2d", "d2q"}``.

    Each direction is its NLL summed over every pair, divided by the number of target tokens of the batch
    (the token mean of :mod:`llm2vec.loss.reconstruction`); a direction of weight 0 is left out (``None``)."""
    body, lm_head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
    queries, documents = real_rows(batch["query"]), real_rows(batch["positive"])
    query_targets, document_targets = target_rows(batch["query_targets"]), target_rows(batch["positive_targets"])
    sums = {"q2d": torch.zeros((), dtype=torch.float64), "d2q": torch.zeros((), dtype=torch.float64)}
    for (q_ids, _), (d_ids, _), y_q, y_d in zip(queries, documents, query_targets, document_targets):
        e_q = body(input_ids=q_ids[None], use_cache=False).last_hidden_state[0, -1]  # Eq. 1: the anchor's state
        e_d = body(input_ids=d_ids[None], use_cache=False).last_hidden_state[0, -1]
        if alpha != 0:
            sums["q2d"] = sums["q2d"] + reconstruction_nll_alone(body, lm_head, e_q, y_d)  # EBQ2D: D from e_Q
        if alpha != 1:
            sums["d2q"] = sums["d2q"] + reconstruction_nll_alone(body, lm_head, e_d, y_q)  # EBD2Q: Q from e_D
    parts = {
        "q2d": sums["q2d"] / sum(len(y) for y in document_targets) if alpha != 0 else None,
        "d2q": sums["d2q"] / sum(len(y) for y in query_targets) if alpha != 1 else None,
    }
    loss = sum(weight * parts[name] for name, weight in (("q2d", alpha), ("d2q", 1 - alpha)) if weight != 0)
    return {"loss": loss, **parts}


def infonce_by_hand(query, positive, negative, scale: float) -> torch.Tensor:
    """Eq. 6-7 one query at a time in float64: for query i, -log of exp(sim(Q_i, D+_i)) over the sum of exp(sim)
    over every positive and every hard negative of the batch, sim = scale x cosine; the mean over the queries."""
    query, positive = query.double(), positive.double()
    candidates = list(positive) + ([] if negative is None else list(negative.double()))
    losses = []
    for i, q in enumerate(query):
        sims = torch.stack([scale * (q @ d) / (q.norm() * d.norm()) for d in candidates])
        losses.append(torch.logsumexp(sims, 0) - sims[i])
    return torch.stack(losses).mean()


def stage_II_loss_by_hand(model, batch: dict) -> torch.Tensor:
    """The Stage II loss of a collated (or random) batch of an ``LLM2VecContrastive``: every text embedded alone
    (:func:`embed_alone`), then :func:`infonce_by_hand`."""
    vectors = {side: embed_alone(model.model, batch[side], model.pooling_mode) for side in batch}
    return infonce_by_hand(vectors["query"], vectors["positive"], vectors.get("negative"), model.loss_fn.scale)


def loss_and_grads(loss_fn, model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss_fn()`` and the gradient of every parameter that gets one (autograd on the reference)."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads
