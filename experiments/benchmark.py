"""Benchmarks: each optimisation against a plain reference run in the same process; prints ratios.

    python experiments/benchmark.py                        # a small random Llama-family model, CPU
    python experiments/benchmark.py --model cache/models/SmolLM2-135M-Instruct --texts 256

1. encode(): length-sorted batches (what ``LLM2Vec.encode`` does) vs. the same batches in input order.
2. Stage I loss: logits only at target positions (``reconstruction_nll``) vs. a reference that computes
   the full (B, M+1, V) logits and masks the loss afterwards; wall time of forward+backward and the
   size of the logits tensor.
Both pairs give the same numbers (checked here), so only the cost differs.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from llm2vec import LLM2Vec
from llm2vec.collator import TrainCollator
from llm2vec.dataset import TrainExample
from llm2vec.llm2vec import decoder_body
from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q
from llm2vec.pooling import pad_batch


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    return (time.perf_counter() - start) / repeats, out


def random_texts(n: int, seed: int = 0) -> list[str]:
    words = ("the of a retrieval query document anchor embedding model token language python function "
             "returns value list string error file open read write network server data").split()
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.choice([4, 8, 16, 64, 200]))) for _ in range(n)]


def bench_encode(encoder: LLM2Vec, texts: list[str], batch_size: int, repeats: int) -> None:
    def unsorted():
        encoded = encoder.encode_ids([("", t) for t in texts])
        out = []
        with torch.no_grad():
            for s in range(0, len(encoded), batch_size):
                out.append(encoder.embed(pad_batch(encoded[s : s + batch_size], encoder.pad_token_id)))
        return torch.cat(out)

    t_ref, ref = timed(unsorted, repeats)
    t_new, new = timed(lambda: encoder.encode(texts, batch_size=batch_size, convert_to_tensor=True,
                                              show_progress_bar=False), repeats)
    assert torch.allclose(ref, new, atol=1e-4), "sorted and unsorted encode disagree"
    print(f"encode  {len(texts)} texts, batch {batch_size}: input order {t_ref:.3f}s, length-sorted {t_new:.3f}s, "
          f"speed-up x{t_ref / t_new:.2f}")


def full_logits_nll(decoder, lm_head, anchor, ids, mask):
    """Reference: logits at every position, loss masked afterwards."""
    inputs = torch.cat([anchor[:, None], decoder.get_input_embeddings()(ids)], 1)
    attention = torch.cat([torch.ones_like(mask[:, :1]), mask], 1)
    positions = torch.arange(attention.shape[1]).expand_as(attention)
    hidden = decoder(inputs_embeds=inputs, attention_mask=attention, position_ids=positions).last_hidden_state
    logits = lm_head(hidden)[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1), reduction="none")
    return (nll * mask.reshape(-1)).sum(), logits.numel()


def bench_stage_I(model: LLM2Vec_q2d_d2q, texts: list[str], batch_size: int, repeats: int) -> None:
    from llm2vec.loss import reconstruction_nll

    pairs = [TrainExample(texts[i][:80], texts[i + 1], None, "", "b") for i in range(0, 2 * batch_size, 2)]
    batch = TrainCollator.for_encoder(model, reconstruction="text")(pairs)
    decoder, head = decoder_body(model.model), model.model.get_output_embeddings()
    targets = batch["positive_targets"]

    def step(fn):
        model.zero_grad()
        anchor = model.embed(batch["query"])
        total, _ = fn(decoder, head, anchor, targets["input_ids"], targets["attention_mask"])
        total.backward()
        return total.detach()

    t_ref, ref = timed(lambda: step(full_logits_nll), repeats)
    t_new, new = timed(lambda: step(reconstruction_nll), repeats)
    assert torch.allclose(ref, new, rtol=1e-4), "selective and full logits disagree"
    n_targets = int(targets["attention_mask"].sum())
    full = targets["input_ids"].numel() + targets["input_ids"].shape[0]
    print(f"stage I q2d fwd+bwd, batch {batch_size}: full logits {t_ref:.3f}s, target-only {t_new:.3f}s, "
          f"speed-up x{t_ref / t_new:.2f}; logits rows {full} -> {n_targets} (x{full / n_targets:.2f} fewer)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a causal LM folder; default: a random Llama-family model built offline")
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        causal_lm = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        from llm2vec.testing import build_tiny_model

        causal_lm, tokenizer = build_tiny_model("smollm2", hidden_size=128, num_layers=4)
    texts = random_texts(args.texts)
    model = LLM2Vec_q2d_d2q(causal_lm, tokenizer, max_length=256)
    model.eval()
    bench_encode(model, texts, args.batch_size, args.repeats)
    model.train()
    bench_stage_I(model, texts, args.batch_size, args.repeats)


if __name__ == "__main__":
    main()
