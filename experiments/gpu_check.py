"""Check on one GPU, in a few minutes, the claims the CPU test-suite cannot check (issue #19, point 7).

    python experiments/gpu_check.py            # one CUDA GPU: every check, bf16, flash_attention_2 when installed
    python experiments/gpu_check.py --quick    # CPU: the same checks on tiny float32 models (tests the script)

Checks, each printed as one line with its numbers and PASS / FAIL / SKIP (exit status 1 if any fails):

1. ``packed_flash``: embeddings of a packed call under ``flash_attention_2`` (FlashAttention's variable-length
   path, chosen by transformers from the restarting position ids) against padded calls under ``sdpa``, on a
   random Llama-shaped model in bf16 (agreement to bf16 rounding: cosine >= 0.999 per text).
2. ``stage_I_step``: a Stage I step with every setting of the paper configs (token budget chunks, LM-head blocks,
   packing, activation checkpointing, flash_attention_2, bf16) against the plain step (one padded pass, sdpa, all
   logits at once) on the same weights: loss within 1e-2 relative, gradient cosine >= 0.99.
3. ``stage_II_step``: a Stage II step with the paper 7B/8B configs' settings (gradient cache, packing, flash,
   bf16, LoRA without dropout so both steps draw nothing) against the plain padded step: same tolerances.
4. ``liger``: Liger's fused linear cross-entropy against the blockwise one (loss and gradients, bf16 inputs),
   at a Llama-3 vocabulary; skipped without CUDA or without ``liger-kernel``.
5. ``stage_I_1b``: peak GPU memory and tokens per second of Stage I steps of a Llama-3.2-1B-shaped model (random
   weights, bf16, pure-bf16 AdamW, the paper config's per-device batch of 32 pairs, token budget 16384, LM-head
   blocks of 4096, packing, activation checkpointing): the figures to set against docs/training.md's estimates.

``--quick`` runs 1-3 and 5 on CPU with tiny models, sdpa and float32 (tight tolerances: there every path is
exact), so the script's own code is known to work before a GPU is lent; 4 is skipped there. Nothing here has
been run on a GPU yet: the GPU figures are what this command is for.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm2vec import LLM2Vec  # noqa: E402
from llm2vec.llm2vec import decoder_body  # noqa: E402

WORDS = (
    "the quick brown fox jumps over a lazy dog while anchor embeddings reconstruct each document from its "
    "query and each query from its document so that a decoder learns vectors which capture meaning"
).split()


@dataclass
class Setting:
    """Where and how the checks run: the GPU run, or the CPU quick mode."""

    device: torch.device
    dtype: torch.dtype
    fast_attention: str  # the paper configs' attention: flash_attention_2 on a GPU (when installed), sdpa on CPU
    quick: bool

    @property
    def loss_rtol(self) -> float:
        return 1e-2 if self.dtype == torch.bfloat16 else 1e-5

    @property
    def min_cosine(self) -> float:
        return 0.99 if self.dtype == torch.bfloat16 else 1 - 1e-8


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str

    def line(self) -> str:
        return f"{self.name:<14} {self.status:<5} {self.detail}"


def setting(quick: bool) -> Setting:
    if quick or not torch.cuda.is_available():
        return Setting(torch.device("cpu"), torch.float32, "sdpa", True)
    flash = importlib.util.find_spec("flash_attn") is not None
    return Setting(torch.device("cuda"), torch.bfloat16, "flash_attention_2" if flash else "sdpa", False)


def llama(hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, s: Setting, seed: int = 0):
    """A random Llama-3-shaped causal LM (the tiny test tokenizer's special tokens) and that tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm2vec.testing import build_tokenizer

    tokenizer = build_tokenizer("llama3")
    config = AutoConfig.for_model(
        "llama",
        vocab_size=max(vocab, len(tokenizer)),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=s.dtype, attn_implementation="sdpa")
    return model.to(s.device), tokenizer


def texts(n: int, min_words: int, max_words: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(min_words, max_words + 1, (1,), generator=g))
        out.append(" ".join(WORDS[i] for i in torch.randint(len(WORDS), (k,), generator=g).tolist()))
    return out


def use_attention(model, name: str) -> None:
    decoder_body(model).set_attn_implementation(name)


def to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(name: str, s: Setting, loss, ref_loss, grads, ref_grads, extra: str = "") -> Result:
    rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    worst = min(cosine(grads[n], ref_grads[n]) for n in ref_grads) if ref_grads.keys() == grads.keys() else -1.0
    ok = rel <= s.loss_rtol and worst >= s.min_cosine
    detail = (
        f"loss {loss.item():.6f} vs plain {ref_loss.item():.6f} (rel {rel:.1e}); lowest gradient cosine {worst:.6f}"
    )
    return Result(name, "PASS" if ok else "FAIL", detail + extra)


# ---------------------------------------------------------------------------------------------- the checks


def check_packed_flash(s: Setting) -> Result:
    size = (64, 2, 4, 2, 128) if s.quick else (1024, 4, 16, 8, 4096)
    model, tokenizer = llama(*size, vocab=1024, s=s)
    items = texts(16, 3, 20 if s.quick else 300, seed=1)
    padded = LLM2Vec(model.model, tokenizer, max_length=512)
    packed = LLM2Vec(model.model, tokenizer, max_length=512, packing=True)
    features = to_device(padded.tokenize(items), s.device)
    with torch.no_grad():
        use_attention(model, "sdpa")
        ref = padded.embed(features)
        use_attention(model, s.fast_attention)
        got = packed.embed(features)
    use_attention(model, "sdpa")
    cosines = torch.nn.functional.cosine_similarity(got.double(), ref.double(), dim=-1)
    ok = cosines.min().item() >= (0.999 if s.dtype == torch.bfloat16 else 1 - 1e-9)
    tokens = int(features["attention_mask"].sum())
    detail = (
        f"{s.fast_attention} packed vs sdpa padded, {len(items)} texts, {tokens} tokens: lowest cosine "
        f"{cosines.min().item():.6f}, max abs difference {(got - ref).abs().max().item():.2e}"
    )
    return Result("packed_flash", "PASS" if ok else "FAIL", detail)


def stage_I_batch(model, n: int, max_words: int, seed: int):
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample

    queries, documents = texts(n, 3, max_words // 4, seed), texts(n, 5, max_words, seed + 1)
    examples = [
        TrainExample(query=q, positive=d, negative=None, query_instruction="Retrieve passages", source="t")
        for q, d in zip(queries, documents)
    ]
    return TrainCollator.for_encoder(model, reconstruction="text")(examples)


def stage_I_step(model, batch) -> tuple[torch.Tensor, int]:
    """One Stage I step as the trainer takes it (its ``step_in_parts`` when the model has chunks): the loss and the
    number of chunks."""
    model.zero_grad(set_to_none=True)
    out = model.step_in_parts(model, batch, lambda t, grad=None: t.backward(grad), contextlib.nullcontext)
    if out is None:
        out = model(**batch)
        out.loss.backward()
    return out.loss.detach(), int(getattr(out, "metrics", {}).get("chunks", 1))


def check_stage_I_step(s: Setting) -> Result:
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    size = (64, 2, 4, 2, 128) if s.quick else (1024, 4, 16, 8, 4096)
    causal_lm, tokenizer = llama(*size, vocab=128256 if not s.quick else 512, s=s, seed=2)
    plain = LLM2Vec_q2d_d2q(causal_lm, tokenizer, max_length=512)
    budget, rows = (120, 16) if s.quick else (16384, 4096)
    paper = LLM2Vec_q2d_d2q(
        causal_lm, tokenizer, max_length=512, token_budget=budget, logit_chunk_rows=rows, packing=True
    )
    batch = to_device(stage_I_batch(plain, 8 if s.quick else 32, 24 if s.quick else 400, seed=3), s.device)
    causal_lm.train()
    use_attention(causal_lm, "sdpa")
    ref_loss, _ = stage_I_step(plain, batch)
    ref = gradients(causal_lm)
    use_attention(causal_lm, s.fast_attention)
    causal_lm.activation_checkpointing_enable({"use_reentrant": False})
    loss, chunks = stage_I_step(paper, batch)
    got = gradients(causal_lm)
    causal_lm.activation_checkpointing_disable()
    use_attention(causal_lm, "sdpa")
    causal_lm.zero_grad(set_to_none=True)
    return compare(
        "stage_I_step", s, loss, ref_loss, got, ref, f"; token budget {budget} ({chunks} chunks), LM-head blocks {rows}"
    )


def check_stage_II_step(s: Setting) -> Result:
    from peft import LoraConfig, TaskType, get_peft_model

    from llm2vec.llm2vec_contrastive import LLM2VecContrastive

    size = (64, 2, 4, 2, 128) if s.quick else (1024, 4, 16, 8, 4096)
    causal_lm, tokenizer = llama(*size, vocab=1024, s=s, seed=4)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type=TaskType.FEATURE_EXTRACTION
    )
    torch.manual_seed(5)
    body = get_peft_model(causal_lm.model, lora)
    with torch.no_grad():  # random B matrices, so every LoRA matrix gets a gradient
        for name, p in body.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.02)
    budget = 200 if s.quick else 16384
    plain = LLM2VecContrastive(body, tokenizer, max_length=512)
    paper = LLM2VecContrastive(body, tokenizer, max_length=512, embedding_token_budget=budget, packing=True)
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample

    n, words = (6, 20) if s.quick else (64, 350)
    q, p, neg = texts(n, 3, words // 4, 6), texts(n, 5, words, 7), texts(n, 5, words, 8)
    examples = [
        TrainExample(query=a, positive=b, negative=c, query_instruction="Retrieve", source="t")
        for a, b, c in zip(q, p, neg)
    ]
    batch = to_device(TrainCollator.for_encoder(plain, with_negative=True)(examples), s.device)
    body.train()
    use_attention(causal_lm, "sdpa")
    body.zero_grad(set_to_none=True)
    out = plain(**batch)
    out.loss.backward()
    ref_loss, ref = out.loss.detach(), gradients(body)
    use_attention(causal_lm, s.fast_attention)
    body.zero_grad(set_to_none=True)
    cached = paper.step_in_parts(paper, batch, lambda t, grad=None: t.backward(grad), contextlib.nullcontext)
    got = gradients(body)
    use_attention(causal_lm, "sdpa")
    return compare(
        "stage_II_step", s, cached.loss, ref_loss, got, ref, f"; gradient cache {budget} tokens, {n} triples"
    )


def check_liger(s: Setting) -> Result:
    from llm2vec.loss.linear_cross_entropy import liger_available, linear_cross_entropy_sum

    if not liger_available(s.device):
        why = "no CUDA device" if s.device.type != "cuda" else "liger-kernel not installed (pip install -e '.[liger]')"
        return Result("liger", "SKIP", why)
    torch.manual_seed(9)
    head = torch.nn.Linear(2048, 128256, bias=False, device=s.device, dtype=s.dtype)
    hidden0 = torch.randn(4096, 2048, device=s.device, dtype=s.dtype)
    targets = torch.randint(0, 128256, (4096,), device=s.device)
    results = []
    for fused in (False, True):
        head.zero_grad(set_to_none=True)
        hidden = hidden0.clone().requires_grad_(True)
        loss = linear_cross_entropy_sum(hidden, head, targets, chunk_rows=1024, fused=fused)
        loss.backward()
        results.append((loss.detach(), {"hidden": hidden.grad.float(), "weight": head.weight.grad.float()}))
    (ref_loss, ref), (loss, got) = results
    return compare("liger", s, loss, ref_loss, got, ref, "; fused vs blocks of 1024 rows, 4096 x 2048 -> 128256")


def peak_memory_mib(s: Setting) -> float:
    if s.device.type == "cuda":
        return torch.cuda.max_memory_allocated(s.device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux: the process's peak RSS


def check_stage_I_1b(s: Setting, steps: int = 2) -> Result:
    """Throughput and peak memory of Stage I steps, Llama-3.2-1B's shape (16 layers, hidden 2048, 32 / 8 heads,
    MLP 8192, vocabulary 128256, tied embeddings) with random weights and the paper config's settings."""
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    size = (64, 2, 4, 2, 128) if s.quick else (2048, 16, 32, 8, 8192)
    causal_lm, tokenizer = llama(*size, vocab=512 if s.quick else 128256, s=s, seed=10)
    use_attention(causal_lm, s.fast_attention)
    budget, rows = (400, 64) if s.quick else (16384, 4096)
    model = LLM2Vec_q2d_d2q(
        causal_lm, tokenizer, max_length=512, token_budget=budget, logit_chunk_rows=rows, packing=True
    )
    causal_lm.train()
    causal_lm.activation_checkpointing_enable({"use_reentrant": False})
    optimizer = torch.optim.AdamW(causal_lm.parameters(), lr=4e-5)  # pure bf16 on a GPU, as the paper configs
    pairs = 8 if s.quick else 32
    batches = [
        to_device(stage_I_batch(model, pairs, 30 if s.quick else 420, seed=20 + k), s.device) for k in range(steps + 1)
    ]
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(s.device)
    times, tokens = [], []
    for k, batch in enumerate(batches):
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        start = time.perf_counter()
        loss, _ = stage_I_step(model, batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if s.device.type == "cuda":
            torch.cuda.synchronize(s.device)
        if k:  # the first step warms up kernels and the allocator
            times.append(time.perf_counter() - start)
            tokens.append(int(batch["query"]["attention_mask"].sum() + batch["positive"]["attention_mask"].sum()))
    if not torch.isfinite(loss):
        return Result("stage_I_1b", "FAIL", f"loss {loss.item()}")
    parameters = sum(p.numel() for p in causal_lm.parameters())
    rate = sum(tokens) / sum(times)
    detail = (
        f"{parameters / 1e6:.0f} M parameters, {pairs} pairs per step, {sum(tokens) / len(tokens):.0f} real tokens "
        f"per step (queries + documents): {rate:.0f} tokens/s, {sum(times) / len(times):.2f} s/step, peak "
        f"{'GPU memory allocated' if s.device.type == 'cuda' else 'RSS'} {peak_memory_mib(s):.0f} MiB"
    )
    return Result("stage_I_1b", "PASS", detail)


CHECKS = {
    "packed_flash": check_packed_flash,
    "stage_I_step": check_stage_I_step,
    "stage_II_step": check_stage_II_step,
    "liger": check_liger,
    "stage_I_1b": check_stage_I_1b,
}


def run_checks(s: Setting, names=None) -> list[Result]:
    results = []
    for name in names or CHECKS:
        try:
            result = CHECKS[name](s)
        except Exception as e:  # report every check, even after one breaks
            result = Result(name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(result.line(), flush=True)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny float32 models: checks the script itself")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    s = setting(args.quick)
    device = torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else "CPU (quick mode)"
    print(f"device: {device}; dtype {str(s.dtype).split('.')[-1]}; fast attention {s.fast_attention}", flush=True)
    results = run_checks(s, args.only)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
