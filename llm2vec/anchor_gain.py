"""What the anchor tells the decoder: the anchor's information gain on held-out pairs.

Stage I is meant to teach the anchor embedding e_X to hold its text (paper Sec. 3.2). Under teacher
forcing the decoder can lower the reconstruction loss of Eq. 3-4 without reading e_X at all: it learns
the language of the data and predicts each target token from the targets before it. The loss alone
therefore cannot tell whether the anchor carries anything. This module measures it directly. For the
held-out pairs (Q_i, D_i), batch by batch (B pairs, shift s = B // 2), per direction:

    true_i   = - sum_t log P(y_t^i | e^i,     y_<t^i)     (the pair's own anchor: Eq. 3 or 4)
    rolled_i = - sum_t log P(y_t^i | e^(i+s), y_<t^i)     (the anchor of pair (i + s) mod B of the batch)

    loss   = sum_i true_i   / T        (the validation reconstruction loss, nats per target token)
    gain   = sum_i rolled_i / T - loss

where T counts the direction's target tokens over all held-out pairs, e = e_Q and y = D for EBQ2D, e = e_D
and y = Q for EBD2Q. The gain is 0 when the decoder ignores its anchor (or all anchors are the same
vector), and grows as the anchor tells the decoder which text it is reconstructing: it is what Stage I is
for, and what its loss cannot show. Shuffle the held-out pairs (:func:`llm2vec.dataset.hold_out` does)
so that the other pair of a batch is not a near twin of the same topic.

Both passes are the model's own forward (the reconstruction pass of the training loss, through whatever
wraps the model: DDP, FSDP), with ``anchor_shift`` for the rolled one, without gradients, in eval mode
(no dropout) and with autocast off: float32 for a float32 model. The numbers are in the units of the
training log's ``loss_q2d`` / ``loss_d2q``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .loss.reconstruction import target_counts


def _on(value, device: torch.device):
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    return value.to(device) if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def anchor_gain(
    model: torch.nn.Module, batches: Iterable[dict], device: torch.device | None = None
) -> dict[str, float]:
    """The validation reconstruction loss and the anchor's information gain (module docstring).

    Args:
        model: a Stage I model (:class:`llm2vec.llm2vec_q2d_d2q.LLM2Vec_q2d_d2q`), possibly wrapped (DDP, FSDP).
        batches: collated Stage I batches (:class:`llm2vec.collator.TrainCollator` with ``reconstruction``)
            of held-out pairs, each of at least 2 pairs.
        device: where the batches go (default: the device of the model's first parameter).

    Returns, for each direction ``d`` the model computes (``q2d``, ``d2q``; a direction of weight 0 is not):
    ``loss_d`` (own anchors), ``rolled_d`` (other pairs' anchors) and ``anchor_gain_d`` (their difference),
    in nats per target token; and ``pairs``, the number of pairs measured.
    """
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    tokens: dict[str, int] = {}
    pairs = 0
    try:
        with torch.autocast(device_type=device.type, enabled=False):
            for batch in batches:
                batch = _on({k: v for k, v in batch.items() if k != "target_counts"}, device)
                size = batch["query"]["input_ids"].shape[0]
                if size < 2:
                    raise ValueError(f"the anchor gain needs batches of at least 2 pairs, got one of {size}")
                counts = target_counts(batch["query_targets"], batch["positive_targets"])
                pairs += size
                for kind, shift in (("loss", 0), ("rolled", size // 2)):
                    out = model(**batch, target_counts=counts, anchor_shift=shift)
                    for name, mean in out.loss_parts.items():  # loss_q2d, loss_d2q: token means of this batch
                        direction = name.removeprefix("loss_")
                        key = f"{kind}_{direction}"
                        sums[key] = sums.get(key, 0.0) + float(mean) * int(counts[direction])
                        if kind == "loss":
                            tokens[direction] = tokens.get(direction, 0) + int(counts[direction])
    finally:
        model.train(was_training)
    if not pairs:
        raise ValueError("the anchor gain needs held-out pairs; got no batches")
    out: dict[str, float] = {"pairs": float(pairs)}
    for direction, count in tokens.items():
        loss, rolled = sums[f"loss_{direction}"] / count, sums[f"rolled_{direction}"] / count
        out.update(
            {f"loss_{direction}": loss, f"rolled_{direction}": rolled, f"anchor_gain_{direction}": rolled - loss}
        )
    return out
