"""Check on one GPU, in a few minutes, the claims the CPU test-suite cannot check.

    PYTHONPATH=. python experiments/gpu_check.py           # one CUDA GPU: bf16, every check at its GPU size
    PYTHONPATH=. python experiments/gpu_check.py --quick   # CPU: the same checks on tiny float32 models

Prints the versions and the device, one line per check (``name STATUS numbers``), then ``N PASS, N FAIL, N SKIP``;
exits 1 when a check fails. A check whose subject cannot run here (no CUDA, no flash-attn or liger-kernel) says
SKIP and why: it never runs a stand-in and calls it a pass. Every comparison is per sequence (each text's
embedding, each pair's NLL per target token and direction, each query's InfoNCE term), besides the loss and each
parameter's gradient. The checks, their sizes and why the bf16 tolerances (:class:`Setting`) are what they are:
docs/scaling.md ("Checking on a GPU"). Needs only torch, transformers, peft, accelerate.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import time
import unittest.mock
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmark import paper_lora, peak_rss_mib, train_step  # noqa: E402 - experiments/benchmark.py

from llm2vec import LLM2Vec  # noqa: E402
from llm2vec.compat import disable_activation_checkpointing, enable_activation_checkpointing  # noqa: E402
from llm2vec.llm2vec import decoder_body  # noqa: E402
from llm2vec.packing import accepts_varlen_kwargs  # noqa: E402

WORDS = (
    "the quick brown fox jumps over a lazy dog while anchor embeddings reconstruct each document from its "
    "query and each query from its document so that a decoder learns vectors which capture meaning"
).split()

GPU_SIZE = (1024, 4, 16, 8, 4096)  # hidden, layers, heads, KV heads, MLP: a small Llama-shaped model
QUICK_SIZE = (64, 2, 4, 2, 128)
LLAMA_1B_SIZE = (2048, 16, 32, 8, 8192)  # Llama-3.2-1B (vocabulary 128256, tied embeddings)


@dataclass
class Setting:
    """Where and how the checks run: the GPU run, the CPU quick mode, or (in the tests) quick sizes in bf16."""

    device: torch.device
    dtype: torch.dtype
    fast_attention: str  # flash_attention_2 on a GPU where flash-attn is installed, sdpa otherwise
    quick: bool
    why_not_flash: str = ""  # why fast_attention is not flash_attention_2

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    # the most relative error of one text's embedding (bf16 noise: below 1e-2), of one pair's NLL per target
    # token in one direction, of one query's InfoNCE term (its scale of 20 to 50 magnifies embedding noise) and
    # of the loss; the least cosine of a parameter's gradient
    embedding_rtol = property(lambda self: 5e-2 if self.bf16 else 1e-4)
    nll_rtol = property(lambda self: 2e-3 if self.bf16 else 1e-5)
    infonce_rtol = property(lambda self: 2e-2 if self.bf16 else 1e-5)
    loss_rtol = property(lambda self: 1e-2 if self.bf16 else 1e-5)
    min_cosine = property(lambda self: 0.99 if self.bf16 else 1 - 1e-8)

    @property
    def attention(self) -> str:
        return self.fast_attention + (f" ({self.why_not_flash})" if self.why_not_flash else "")

    def size(self, gpu: tuple = GPU_SIZE) -> tuple:
        return QUICK_SIZE if self.quick else gpu


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str

    def line(self) -> str:
        return f"{self.name:<15} {self.status:<5} {self.detail}"


def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> str:
    """One line: the versions this run uses (CUDA as torch was built for it)."""
    cuda = torch.version.cuda or "none (CPU build)"
    listed = ", ".join(
        f"{p} {version(p)}" for p in ("transformers", "peft", "accelerate", "flash-attn", "liger-kernel")
    )
    return f"versions: Python {platform.python_version()}, torch {torch.__version__} (CUDA {cuda}), {listed}"


def setting(quick: bool) -> Setting:
    if quick or not torch.cuda.is_available():
        why = "quick mode, CPU" if quick else "no CUDA device"
        return Setting(torch.device("cpu"), torch.float32, "sdpa", True, why)
    if importlib.util.find_spec("flash_attn") is None:
        return Setting(torch.device("cuda"), torch.bfloat16, "sdpa", False, "flash-attn not installed")
    return Setting(torch.device("cuda"), torch.bfloat16, "flash_attention_2", False)


def llama(hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, s: Setting, seed: int = 0):
    """A random Llama-3-shaped causal LM (the tiny test tokenizer's special tokens) and that tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llm2vec.testing import build_tokenizer

    tokenizer = build_tokenizer("llama3")
    sizes = dict(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads)
    sizes.update(num_key_value_heads=kv_heads, vocab_size=max(vocab, len(tokenizer)), max_position_embeddings=2048)
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    config = AutoConfig.for_model("llama", tie_word_embeddings=True, **sizes, **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=s.dtype, attn_implementation="sdpa")
    return model.to(s.device), tokenizer


def texts(n: int, min_words: int, max_words: int, seed: int, taken: tuple[str, ...] = ()) -> list[str]:
    """``n`` random texts of the words above, none of them the start of another or of one in ``taken`` (so every
    text's tokens can be told apart in a row of targets)."""
    g = torch.Generator().manual_seed(seed)
    out: list[str] = []
    while len(out) < n:
        k = int(torch.randint(min_words, max_words + 1, (1,), generator=g))
        text = " ".join(WORDS[i] for i in torch.randint(len(WORDS), (k,), generator=g).tolist())
        if not any(t.startswith(text) or text.startswith(t) for t in (*taken, *out)):
            out.append(text)
    return out


@contextlib.contextmanager
def attention(model, name: str, checkpointed: bool = False):
    """The decoder's attention set to ``name`` (and activation checkpointing on, when ``checkpointed``) within the
    block; ``sdpa`` (what :func:`llama` builds) and no checkpointing after it."""
    decoder_body(model).set_attn_implementation(name)
    if checkpointed:
        enable_activation_checkpointing(model, {"use_reentrant": False})
    try:
        yield
    finally:
        decoder_body(model).set_attn_implementation("sdpa")
        if checkpointed:
            disable_activation_checkpointing(model)


def to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


# ---------------------------------------------------------------------------------------------- comparisons


def relative_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row (one text's embedding, or one scalar per pair): |got - ref| / |ref|, in float64."""
    got, ref = got.double().reshape(len(ref), -1), ref.double().reshape(len(ref), -1)
    return (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


@dataclass
class Verdict:
    """Several named comparisons of one check; it passes only when all of them do."""

    parts: list[tuple[str, bool, str]] = field(default_factory=list)

    def add(self, what: str, worst: float, limit: float, above: bool = False) -> None:
        ok = worst >= limit if above else worst <= limit
        self.parts.append((what, ok, f"{what} {worst:.2e} ({'>=' if above else '<='} {limit:.9g})"))

    def per_sequence(self, what: str, got: torch.Tensor, ref: torch.Tensor, limit: float) -> None:
        """The worst relative error over sequences; every sequence must be within ``limit``."""
        self.add(f"worst {what}", relative_errors(got, ref).max().item(), limit)

    def embeddings(self, got, ref, sides: tuple[str, ...], s: Setting) -> None:
        """Each text's embedding of each side (``<side>_embedding`` of two step outputs)."""
        for side in sides:
            what = f"{side}_embedding"
            self.per_sequence(f"{side} embedding", getattr(got, what), getattr(ref, what), s.embedding_rtol)

    def loss_and_gradients(self, got, ref, grads: dict, ref_grads: dict, s: Setting) -> None:
        self.add("loss", relative_errors(got.loss[None], ref.loss.detach()[None]).item(), s.loss_rtol)
        self.gradients(grads, ref_grads, s.min_cosine)

    def gradients(self, got: dict, ref: dict, limit: float) -> None:
        if got.keys() != ref.keys():
            return self.parts.append(
                ("gradients", False, f"gradients of other parameters: {sorted(got.keys() ^ ref.keys())}")
            )
        worst = min(cosine(got[n], ref[n]) for n in ref)
        self.parts.append(("gradients", worst >= limit, f"lowest gradient cosine {worst:.9f} (>= {limit:.9g})"))

    def result(self, name: str, prefix: str) -> Result:
        failed = [what for what, ok, _ in self.parts if not ok]
        detail = "; ".join(text for _, _, text in self.parts)
        if failed:
            detail += f" -- failed: {', '.join(failed)}"
        return Result(name, "FAIL" if failed else "PASS", f"{prefix}: {detail}")


# ---------------------------------------------------------------------------------------------- the checks


def embeddings(model, tokenizer, items: list[str], name: str, packing: bool = False, alone: bool = False):
    """Each text's embedding under attention ``name``: packed, padded, or each text as a batch of one (``alone``)."""
    encoder = LLM2Vec(model.model, tokenizer, max_length=512, packing=packing)
    with attention(model, name), torch.no_grad():
        batches = [[t] for t in items] if alone else [items]
        return torch.cat([encoder.embed(to_device(encoder.tokenize(b), model.device)) for b in batches])


def check_packed(s: Setting, name: str) -> Result:
    """Each text's embedding from one packed call under ``name`` against padded calls (and, for sdpa, each text
    run alone; for flash, padded sdpa)."""
    check = "packed_flash" if name == "flash_attention_2" else "packed_sdpa"
    if s.fast_attention != name and name != "sdpa":
        return Result(check, "SKIP", f"{s.why_not_flash}: FlashAttention was not run")
    model, tokenizer = llama(*s.size(), vocab=1024, s=s)
    items = texts(16, 3, 20 if s.quick else 300, seed=1)
    got = embeddings(model, tokenizer, items, name, packing=True)
    references = {"padded sdpa": ("sdpa", False), "run alone": ("sdpa", True)}
    if name != "sdpa":
        references = {"padded flash": (name, False), "padded sdpa": ("sdpa", False)}
    verdict = Verdict()
    for what, (ref_name, alone) in references.items():
        ref = embeddings(model, tokenizer, items, ref_name, alone=alone)
        verdict.per_sequence(f"text embedding vs {what}", got, ref, s.embedding_rtol)
    if name == "sdpa":
        return verdict.result(check, f"sdpa packed, {len(items)} texts")
    varlen = "cu_seq_lens passed" if accepts_varlen_kwargs(decoder_body(model)) else "boundaries from position ids"
    return verdict.result(check, f"flash_attention_2 packed ({varlen}), {len(items)} texts")


@contextlib.contextmanager
def recorded_nll():
    """Records each call of the reconstruction loss's cross-entropy: its target ids and each row's NLL (float32,
    no gradient), so that each pair's NLL can be read off whatever path (padded, packed, chunked) computed it."""
    from llm2vec.loss import reconstruction

    original = reconstruction.linear_cross_entropy_sum
    calls: list[tuple[list[int], torch.Tensor]] = []

    def recording(hidden, lm_head, targets, chunk_rows=0, fused=True):
        with torch.no_grad():
            rows = [
                F.cross_entropy(lm_head(h).float(), y, reduction="none")
                for h, y in zip(hidden.detach().split(2048), targets.split(2048))
            ]
        calls.append((targets.tolist(), torch.cat(rows).double().cpu() if rows else torch.zeros(0)))
        return original(hidden, lm_head, targets, chunk_rows, fused)

    with unittest.mock.patch.object(reconstruction, "linear_cross_entropy_sum", recording):
        yield calls


def nll_per_sequence(calls, sequences: list[tuple[int, ...]]) -> torch.Tensor:
    """Each target sequence's NLL per token, found in the recorded rows: every call's rows are whole target
    sequences one after another (no sequence is the start of another, so each offset matches one)."""
    where = {seq: i for i, seq in enumerate(sequences)}
    lengths = sorted({len(seq) for seq in sequences}, reverse=True)
    out = torch.full((len(sequences),), float("nan"), dtype=torch.float64)
    for ids, nll in calls:
        offset = 0
        while offset < len(ids):
            n = next((n for n in lengths if tuple(ids[offset : offset + n]) in where), None)
            if n is None:
                break  # rows of the other direction's call: not these sequences
            out[where[tuple(ids[offset : offset + n])]] = nll[offset : offset + n].mean()
            offset += n
    return out


def target_sequences(targets: dict) -> list[tuple[int, ...]]:
    return [tuple(ids[m.bool()].tolist()) for ids, m in zip(targets["input_ids"], targets["attention_mask"])]


def training_batch(model, n: int, max_words: int, seed: int, negatives: bool = False):
    """A collated batch of ``n`` random pairs (Stage I: with their reconstruction targets) or triples (Stage II)."""
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample

    queries = texts(n, 3, max(4, max_words // 4), seed)
    documents = texts(n, 5, max_words, seed + 1, taken=() if negatives else tuple(queries))
    others = texts(n, 5, max_words, seed + 2) if negatives else [None] * n
    instruction = "Retrieve" if negatives else "Retrieve passages"
    examples = [TrainExample(q, d, x, instruction, "t") for q, d, x in zip(queries, documents, others)]
    options = {"with_negative": True} if negatives else {"reconstruction": "text"}
    return TrainCollator.for_encoder(model, **options)(examples)


def stage_I_step(model, batch):
    """One Stage I step as the trainer takes it: the output and the recorded cross-entropy rows."""
    model.zero_grad(set_to_none=True)
    with recorded_nll() as calls:
        return train_step(model, batch), calls


def check_stage_I_step(s: Setting) -> Result:
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    causal_lm, tokenizer = llama(*s.size(), vocab=512 if s.quick else 128256, s=s, seed=2)
    plain = LLM2Vec_q2d_d2q(causal_lm, tokenizer, max_length=512)
    budget, rows = (300, 16) if s.quick else (16384, 4096)
    paper = LLM2Vec_q2d_d2q(
        causal_lm, tokenizer, max_length=512, token_budget=budget, logit_chunk_rows=rows, packing=True
    )
    batch = to_device(training_batch(plain, 8 if s.quick else 32, 24 if s.quick else 400, seed=3), s.device)
    causal_lm.train()
    ref, ref_calls = stage_I_step(plain, batch)
    ref_grads = gradients(causal_lm)
    with attention(causal_lm, s.fast_attention, checkpointed=True):
        got, got_calls = stage_I_step(paper, batch)
    verdict = Verdict()
    verdict.embeddings(got, ref, ("query", "document"), s)
    for direction, side in (("q2d", "positive_targets"), ("d2q", "query_targets")):
        sequences = target_sequences(batch[side])
        got_nll, ref_nll = nll_per_sequence(got_calls, sequences), nll_per_sequence(ref_calls, sequences)
        if torch.isnan(got_nll).any() or torch.isnan(ref_nll).any():
            verdict.parts.append(
                (f"{direction} NLL", False, f"{direction}: a pair's targets were not found in the rows")
            )
        else:
            verdict.per_sequence(f"pair {direction} NLL/token", got_nll, ref_nll, s.nll_rtol)
    verdict.loss_and_gradients(got, ref, gradients(causal_lm), ref_grads, s)
    causal_lm.zero_grad(set_to_none=True)
    prefix = f"{s.attention}, token budget {budget} ({got.chunks} chunks), LM-head blocks {rows}, packed, checkpointed"
    return verdict.result("stage_I_step", prefix)


def check_anchor_measures(s: Setting) -> Result:
    """The validation measures of Stage I (:func:`llm2vec.anchor_gain.anchor_gain`: loss, anchor gain, gain over
    the first tokens) on the device against the same weights in float32 on the CPU, two batches of 8 pairs."""
    from llm2vec.anchor_gain import anchor_gain
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    causal_lm, tokenizer = llama(*s.size(), vocab=512 if s.quick else 128256, s=s, seed=4)
    model = LLM2Vec_q2d_d2q(causal_lm, tokenizer, max_length=512)
    batches = [training_batch(model, 8, 24 if s.quick else 120, seed=5 + k) for k in range(2)]
    got = anchor_gain(model, [to_device(b, s.device) for b in batches])
    causal_lm.to(device="cpu", dtype=torch.float32)
    ref = anchor_gain(LLM2Vec_q2d_d2q(causal_lm, tokenizer, max_length=512), batches)
    verdict = Verdict()
    for direction in ("q2d", "d2q"):
        loss = ref[f"loss_{direction}"]
        verdict.add(f"{direction} loss", abs(got[f"loss_{direction}"] - loss) / loss, s.loss_rtol)
        for measure in ("anchor_gain", "anchor_gain_first4"):
            key = f"{measure}_{direction}"
            verdict.add(f"{direction} {measure} (/ loss)", abs(got[key] - ref[key]) / loss, s.loss_rtol)
    return verdict.result("anchor_measures", f"{s.device.type} {str(s.dtype).split('.')[-1]} against CPU float32")


def infonce_terms(out, scale: float) -> torch.Tensor:
    """Each query's InfoNCE term (Eq. 6-7) of a Stage II step's output in float64: logsumexp_j(scale cos(q_i, c_j)) -
    scale cos(q_i, p_i) over the candidates c = every positive and every hard negative of the batch."""
    q, p, n = out.query_embedding, out.positive_embedding, out.negative_embedding
    candidates = torch.cat([p, n]) if n is not None else p
    sims = scale * F.normalize(q.double(), dim=-1) @ F.normalize(candidates.double(), dim=-1).T
    return sims.logsumexp(-1) - sims.diagonal()[: len(q)]


def check_stage_II_step(s: Setting) -> Result:
    from peft import get_peft_model

    from llm2vec.llm2vec_contrastive import LLM2VecContrastive

    causal_lm, tokenizer = llama(*s.size(), vocab=1024, s=s, seed=4)
    torch.manual_seed(5)
    body = get_peft_model(causal_lm.model, paper_lora())
    with torch.no_grad():  # random B matrices, so every LoRA matrix gets a gradient
        for name, p in body.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.02)
    budget = 200 if s.quick else 16384
    plain = LLM2VecContrastive(body, tokenizer, max_length=512)
    paper = LLM2VecContrastive(body, tokenizer, max_length=512, embedding_token_budget=budget, packing=True)
    n, words = (6, 20) if s.quick else (64, 350)
    batch = to_device(training_batch(plain, n, words, seed=6, negatives=True), s.device)
    body.train()
    body.zero_grad(set_to_none=True)
    ref = train_step(plain, batch)
    ref_grads = gradients(body)
    body.zero_grad(set_to_none=True)
    with attention(causal_lm, s.fast_attention):
        got = train_step(paper, batch)
    verdict = Verdict()
    verdict.embeddings(got, ref, ("query", "positive", "negative"), s)
    terms = [infonce_terms(out, plain.loss_fn.scale) for out in (got, ref)]
    verdict.per_sequence("query InfoNCE term", *terms, s.infonce_rtol)
    verdict.loss_and_gradients(got, ref, gradients(body), ref_grads, s)
    return verdict.result("stage_II_step", f"{s.attention}, gradient cache {budget} tokens, packed, {n} triples")


def check_liger(s: Setting) -> Result:
    from llm2vec.loss.linear_cross_entropy import liger_available, linear_cross_entropy_sum

    if not liger_available(s.device):
        why = "no CUDA device" if s.device.type != "cuda" else "liger-kernel not installed (pip install -e '.[liger]')"
        return Result("liger", "SKIP", f"{why}: Liger's kernel was not run")
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
    verdict = Verdict()
    # each row's share of the gradient with respect to its hidden state: a row-wise comparison
    verdict.per_sequence("row's hidden-state gradient", got["hidden"], ref["hidden"], s.embedding_rtol)
    verdict.add("loss", relative_errors(loss[None], ref_loss[None]).item(), s.loss_rtol)
    verdict.gradients(got, ref, s.min_cosine)
    return verdict.result("liger", "fused vs blocks of 1024 rows, 4096 x 2048 -> 128256")


# ---------------------------------------------------------------------------------------------- throughput and MFU

BF16_PEAK_TFLOPS = (  # dense bf16 tensor-core peaks from NVIDIA's data sheets; the first name contained wins
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),  # SXM, and GH200
    ("A100", 312.0),
    ("L40S", 362.0),
)

PAPER_MFU = 0.14
"""The paper's Stage I MFU for Llama-3.2-1B, estimated from its Table 7:

    available   8 A100 x 312e12 FLOP/s x 4 h x 3600 s                  = 3.59e19 FLOP
    used        2000 steps x 512 pairs x ~660 decoder positions per pair
                x 6 x 1.24e9 parameters                                = 5.03e18 FLOP
    MFU         5.03e18 / 3.59e19                                      = 0.14

where ~660 positions per pair is the encoding of query and document plus their two reconstructions
(each text read twice) at ~330 tokens per E5 pair, template included: an assumption, not a measurement;
attention FLOPs are left out there, as at 512 tokens they add under 10 %."""


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (``torch.cuda.get_device_name``), ``None`` if not in the table."""
    return next((peak for name, peak in BF16_PEAK_TFLOPS if name in device_name), None)


def stage_I_flops(
    body_parameters: int, hidden: int, layers: int, vocab: int, sequence_lengths: list[int], target_rows: int
) -> float:
    """Model FLOPs of one training step (forward + backward) over the given decoder sequences (the formula and its
    terms: docs/results/benchmarks.md; recomputed forwards of activation checkpointing are not counted):

        6 x P_body x sum_s n_s  +  6 x L x H x sum_s n_s^2  +  6 x H x V x target_rows
    """
    tokens = sum(sequence_lengths)
    squares = sum(n * n for n in sequence_lengths)
    return 6.0 * body_parameters * tokens + 6.0 * layers * hidden * squares + 6.0 * hidden * vocab * target_rows


def body_parameters(causal_lm) -> int:
    """P_body of :func:`stage_I_flops`: the entries of the decoder layers' weight matrices."""
    return sum(p.numel() for p in decoder_body(causal_lm).layers.parameters() if p.dim() == 2)


def stage_I_sequences(batch) -> tuple[list[int], int]:
    """The decoder sequences of a Stage I step (each query and document encoded, each reconstruction: the anchor
    and the targets) and the number of target rows."""
    encode = [int(n) for side in ("query", "positive") for n in batch[side]["attention_mask"].sum(1)]
    targets = [int(n) for side in ("query_targets", "positive_targets") for n in batch[side]["attention_mask"].sum(1)]
    return encode + [1 + n for n in targets], sum(targets)


def check_stage_I_1b(s: Setting, steps: int = 2) -> Result:
    """Throughput, MFU and peak memory of Stage I steps, Llama-3.2-1B's shape (16 layers, hidden 2048, 32 / 8
    heads, MLP 8192, vocabulary 128256, tied embeddings) with random weights and the paper config's settings."""
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    size, cuda = s.size(LLAMA_1B_SIZE), s.device.type == "cuda"
    causal_lm, tokenizer = llama(*size, vocab=512 if s.quick else 128256, s=s, seed=10)
    budget, rows = (400, 64) if s.quick else (16384, 4096)
    model = LLM2Vec_q2d_d2q(
        causal_lm, tokenizer, max_length=512, token_budget=budget, logit_chunk_rows=rows, packing=True
    )
    causal_lm.train()
    optimizer = torch.optim.AdamW(causal_lm.parameters(), lr=4e-5)  # pure bf16 on a GPU, as the paper configs
    pairs = 8 if s.quick else 32
    batches = [training_batch(model, pairs, 30 if s.quick else 420, seed=20 + k) for k in range(steps + 1)]
    if cuda:
        torch.cuda.reset_peak_memory_stats(s.device)
    synchronize = torch.cuda.synchronize if cuda else lambda device: None
    times, tokens, flops = [], [], []
    with attention(causal_lm, s.fast_attention, checkpointed=True):
        for k, batch in enumerate(to_device(b, s.device) for b in batches):
            synchronize(s.device)
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            out = train_step(model, batch)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(s.device)
            if k:  # the first step warms up kernels and the allocator
                times.append(time.perf_counter() - start)
                tokens.append(int(batch["query"]["attention_mask"].sum() + batch["positive"]["attention_mask"].sum()))
                lengths, targets = stage_I_sequences(batch)
                matrices, vocab = body_parameters(causal_lm), causal_lm.config.vocab_size
                flops.append(stage_I_flops(matrices, size[0], size[1], vocab, lengths, targets))
    if not torch.isfinite(out.loss):
        return Result("stage_I_1b", "FAIL", f"loss {out.loss.item()}")
    achieved = sum(flops) / sum(times)
    name = torch.cuda.get_device_name(s.device) if cuda else "CPU"
    peak = peak_tflops(name) if s.bf16 else None
    why = "not a bf16 run" if not s.bf16 else f"no bf16 peak known for {name!r} (BF16_PEAK_TFLOPS)"
    mfu = f"MFU {achieved / (peak * 1e12):.1%} of {peak:g} TFLOP/s" if peak else f"MFU n/a ({why})"
    memory = (
        f"GPU memory allocated {torch.cuda.max_memory_allocated(s.device) / 2**20:.0f}"
        if cuda
        else f"RSS {peak_rss_mib():.0f}"
    )
    parameters = sum(p.numel() for p in causal_lm.parameters())
    detail = (
        f"{parameters / 1e6:.2f} M parameters, {s.fast_attention}, {pairs} pairs per step, "
        f"{sum(tokens) / len(tokens):.0f} real tokens per step (queries + documents): "
        f"{sum(tokens) / sum(times):.0f} tokens/s, {sum(times) / len(times):.2f} s/step, {achieved / 1e12:.1f} model "
        f"TFLOP/s, {mfu} (paper: ~{PAPER_MFU:.0%} on A100); peak {memory} MiB"
    )
    return Result("stage_I_1b", "PASS", detail)


CHECKS = {
    "packed_sdpa": lambda s: check_packed(s, "sdpa"),
    "packed_flash": lambda s: check_packed(s, "flash_attention_2"),
    "stage_I_step": check_stage_I_step,
    "stage_II_step": check_stage_II_step,
    "anchor_measures": check_anchor_measures,
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


def summary(results: list[Result]) -> str:
    return ", ".join(f"{sum(r.status == k for r in results)} {k}" for k in ("PASS", "FAIL", "SKIP"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny float32 models: checks the script itself")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes, not results
    start = time.perf_counter()
    print(versions(), flush=True)
    s = setting(args.quick)
    device = torch.cuda.get_device_name(s.device) if s.device.type == "cuda" else "CPU (quick mode)"
    print(f"device: {device}; dtype {str(s.dtype).split('.')[-1]}; fast attention {s.attention}", flush=True)
    results = run_checks(s, args.only)
    print(f"{summary(results)} ({time.perf_counter() - start:.0f} s)", flush=True)
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
