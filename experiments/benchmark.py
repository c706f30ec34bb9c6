"""Benchmark: each formulation of a step in its own process, against a reference, with equal losses checked.

    python experiments/benchmark.py                                  # SmolLM2-135M-Instruct (cache/models)
    python experiments/benchmark.py --tiny                           # a tiny random Llama-3 model (CI)
    python experiments/benchmark.py --json                           # one JSON object per measurement
    python experiments/benchmark.py --only stage_I --stage_I_batches 8
    python experiments/benchmark.py --only stage_II_st --stage_II_st_batches 64   # Stage II: project vs ST

Benches (the first variant of each is the reference of its ratios): ``stage_I``: ``authors`` (left-padded batches,
four decoder calls, full-vocabulary logits masked afterwards: :func:`authors_stage_I_loss`), ``plain`` (this
project's step, its memory bounds off), ``optimised`` (:data:`OPTIMISED_STAGE_I`), ``packed`` (and packed decoder
calls), ``checkpointed`` (and activation checkpointing: every setting of the paper configs); ``stage_II``: ``plain``
vs ``cached`` (:data:`OPTIMISED_STAGE_II`); ``encode``: ``bare`` forwards vs ``LLM2Vec.encode``; ``stage_II_st`` (only
when named in ``--only``): this project's cached Stage II step vs sentence-transformers' cached loss on the same
model (:func:`stage_II_st_step`). Each variant runs in
a fresh process (:func:`in_own_process`, which ``research/benchmark_data.py`` uses too), so ``peak_rss_mib`` is its
own; ``seconds`` is the median of ``--repeats`` steps after a warm-up. The losses of a bench's variants must agree
(1e-4 relative; 1e-2 in bf16) before any ratio is printed. Texts are the standard library's docstrings (first
sentence as the query, another object of the module as the negative).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = HERE.parent / "cache" / "models" / "SmolLM2-135M-Instruct"

# what "optimised" means: the settings the paper configs and the demo use (see docs/training.md)
OPTIMISED_STAGE_I: dict = {"token_budget": 1024, "logit_chunk_rows": 512}
OPTIMISED_STAGE_II: dict = {"embedding_token_budget": 2048}

REFERENCE = {"stage_I": "authors", "stage_II": "plain", "encode": "bare", "stage_II_st": "project"}


# ------------------------------------------------------------------------------ one process per measurement


def status_mib() -> dict[str, float]:
    """The memory lines of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``, ...) in MiB."""
    with open("/proc/self/status") as f:
        rows = [line.partition(":") for line in f]
    return {key: int(rest.split()[0]) / 1024 for key, _, rest in rows if rest.strip().endswith("kB")}


def peak_rss_mib() -> float:
    """The peak resident memory of this process: ``VmHWM``, which starts afresh at ``exec`` (``ru_maxrss`` would
    carry the peak of the process that started this one)."""
    return status_mib()["VmHWM"]


def in_own_process(script: str, job: dict, label: str, identity: dict) -> dict:
    """Runs ``script --worker JOB`` in a fresh Python (``job`` as JSON) and returns the JSON record its last line
    prints. A worker killed by SIGKILL (on Linux the out-of-memory killer: the variant did not fit) gives
    ``identity`` with ``failed``; any other failure stops the run, naming ``label``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, script, "--worker", json.dumps(job, default=str)]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode in (-9, 137):
        print(f"{label} was killed (out of memory?)", file=sys.stderr)
        return {**identity, "failed": "killed (out of memory)"}
    if result.returncode != 0:
        raise SystemExit(f"{label} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ the steps


def stdlib_triples(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """``n`` (query, document, negative) triples from standard-library docstrings, in a fixed order."""
    import random

    from demo.stdlib_data import collect_module, read_module_list

    triples = []
    for module in read_module_list():
        objects = collect_module(module)
        for i, obj in enumerate(objects):
            if len(objects) > 1:
                triples.append((obj.query, obj.text, objects[(i + 1) % len(objects)].text))
        if len(triples) >= 4 * n:
            break
    random.Random(seed).shuffle(triples)
    if len(triples) < n:
        raise SystemExit(f"benchmark: only {len(triples)} standard-library examples, {n} needed")
    return triples[:n]


def training_batch(encoder, n: int, device: str, **collator) -> dict:
    """A collated batch of ``n`` standard-library triples on ``device``."""
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample

    examples = [TrainExample(q, d, neg, "", "stdlib") for q, d, neg in stdlib_triples(n)]
    return to_device(TrainCollator.for_encoder(encoder, **collator)(examples), device)


def train_step(encoder, batch):
    """Forward and backward of one batch as the trainer takes it: the model's ``step_in_parts`` when it has chunks
    (a token budget, a gradient cache), else one forward of the whole batch. Returns the output."""
    out = encoder.step_in_parts(encoder, batch, lambda t, grad=None: t.backward(grad), contextlib.nullcontext)
    if out is None:
        out = encoder(**batch)
        out.loss.backward()
    return out


def load_causal_lm(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.tiny:
        from llm2vec.testing import build_tiny_model

        model, tokenizer = build_tiny_model("llama3", hidden_size=64, num_layers=2)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32, attn_implementation=args.attn_implementation, trust_remote_code=False
        )
    return model.to(device=args.device, dtype=getattr(torch, args.dtype)), tokenizer


def to_device(batch, device):
    return {
        k: {n: t.to(device) for n, t in v.items()} if isinstance(v, dict) else v.to(device) for k, v in batch.items()
    }


def authors_stage_I_loss(encoder, batch, alpha: float):
    """The authors' formulation of Eq. 3-5 (see the module docstring), same number as ``LLM2Vec_q2d_d2q``."""
    import torch
    import torch.nn.functional as F

    from llm2vec.llm2vec import decoder_body

    body, head = decoder_body(encoder.model), encoder.model.get_output_embeddings()

    def left_pad(features):
        ids, mask = features["input_ids"], features["attention_mask"]
        order = torch.argsort(mask, dim=1, stable=True)  # padding first, real tokens in order after it
        return ids.gather(1, order), mask.gather(1, order)

    def embed(features):
        ids, mask = left_pad(features)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
        return hidden[:, -1]  # left padding: the anchor is the last column

    def reconstruct(anchor, targets):
        ids, mask = left_pad(targets)
        embeds = torch.cat([anchor[:, None], body.get_input_embeddings()(ids)], dim=1)
        full_mask = torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)  # anchor in column 0, then padding
        positions = (full_mask.cumsum(1) - 1).clamp(min=0)
        hidden = body(
            inputs_embeds=embeds, attention_mask=full_mask, position_ids=positions, use_cache=False
        ).last_hidden_state
        logits = head(hidden[:, :-1]).float()  # every position, the whole vocabulary
        # column t predicts ids[:, t]; with left padding the anchor predicts the first real target
        first = mask.argmax(dim=1)
        predicted_by = torch.arange(ids.shape[1], device=ids.device)[None, :].expand_as(ids)
        target_mask = mask.bool()
        source = torch.where(predicted_by == first[:, None], torch.zeros_like(predicted_by), predicted_by)
        picked = logits.gather(1, source[..., None].expand(-1, -1, logits.shape[-1]))
        nll = F.cross_entropy(picked.reshape(-1, logits.shape[-1]), ids.reshape(-1), reduction="none")
        return (nll * target_mask.reshape(-1)).sum(), target_mask.sum()

    e_q, e_d = embed(batch["query"]), embed(batch["positive"])
    q2d, n_d = reconstruct(e_q, batch["positive_targets"])
    d2q, n_q = reconstruct(e_d, batch["query_targets"])
    return alpha * q2d / n_d + (1 - alpha) * d2q / n_q


def stage_I_step(args, variant: str, batch_size: int):
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    model, tokenizer = load_causal_lm(args)
    packed = {**OPTIMISED_STAGE_I, "packing": True}
    options = {"optimised": OPTIMISED_STAGE_I, "packed": packed, "checkpointed": packed}.get(variant, {})
    encoder = LLM2Vec_q2d_d2q(model, tokenizer, alpha=0.2, max_length=args.max_length, **options).train()
    if variant == "checkpointed":
        encoder.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    batch = training_batch(encoder, batch_size, args.device, reconstruction="text")
    tokens = int(batch["query"]["attention_mask"].sum() + batch["positive"]["attention_mask"].sum())

    def step():
        encoder.zero_grad(set_to_none=True)
        if variant == "authors":
            loss = authors_stage_I_loss(encoder, batch, 0.2)
            loss.backward()
            return loss.item()
        return train_step(encoder, batch).loss.item()

    return step, {"tokens": tokens}


def paper_lora():
    """The paper's Stage II LoRA (r 16, alpha 32) on every projection, without dropout so that steps compare."""
    from peft import LoraConfig, TaskType

    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    kind = TaskType.FEATURE_EXTRACTION
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type=kind, target_modules=projections)


def stage_II_step(args, variant: str, batch_size: int):
    from peft import get_peft_model

    from llm2vec.llm2vec import decoder_body
    from llm2vec.llm2vec_contrastive import LLM2VecContrastive

    causal, tokenizer = load_causal_lm(args)
    options = OPTIMISED_STAGE_II if variant == "cached" else {}
    body = get_peft_model(decoder_body(causal), paper_lora())
    encoder = LLM2VecContrastive(body, tokenizer, max_length=args.stage_II_max_length, **options).train()
    batch = training_batch(encoder, batch_size, args.device, with_negative=True)
    tokens = int(sum(batch[k]["attention_mask"].sum() for k in ("query", "positive", "negative")))

    def step():
        encoder.zero_grad(set_to_none=True)
        return train_step(encoder, batch).loss.item()

    return step, {"tokens": tokens}


def encode_step(args, variant: str, batch_size: int):
    import torch

    from llm2vec import LLM2Vec
    from llm2vec.collator import pad_batch

    causal, tokenizer = load_causal_lm(args)
    encoder = LLM2Vec(causal.model, tokenizer, max_length=args.max_length).eval()
    texts = [d for _, d, _ in stdlib_triples(args.encode_texts)]
    tokens = sum(len(e.input_ids) for e in encoder.encode_ids([("", t) for t in texts]))

    def bare():  # tokenization included, as in encode: what differs is only encode's own work
        encoded = encoder.encode_ids([("", t) for t in texts])
        order = sorted(range(len(texts)), key=lambda i: -len(encoded[i].input_ids))
        out = []
        with torch.no_grad():
            for s in range(0, len(order), batch_size):
                features = pad_batch([encoded[i] for i in order[s : s + batch_size]], encoder.pad_token_id, "left")
                features = to_device(features, args.device)
                ids, mask = features["input_ids"], features["attention_mask"]
                positions = (mask.cumsum(1) - 1).clamp(min=0)
                hidden = causal.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
                out.append(hidden.last_hidden_state[:, -1])
        embeddings = torch.empty(len(texts), out[0].shape[-1], device=out[0].device, dtype=out[0].dtype)
        embeddings[order] = torch.cat(out)
        return embeddings

    def step():
        if variant == "bare":
            embeddings = bare()
        else:
            embeddings = encoder.encode(
                texts, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False, device=args.device
            )
        return embeddings.double().norm(dim=-1).mean().item()  # the same number when the embeddings are equal

    return step, {"tokens": tokens}


def stage_II_st_step(args, variant: str, batch_size: int):
    """Stage II at one batch through both trainers, each with a gradient cache of ``--st_mini_batch`` texts a chunk:
    ``project`` (LLM2VecContrastive, embedding_token_budget = mini-batch x stage_II_max_length) and ``st`` (the same
    model as a SentenceTransformer, :mod:`llm2vec.st_training`, CachedMultipleNegativesRankingLoss at scale 20). The
    LoRA's B starts at zero, so both first losses are the untouched model's and must agree."""
    import tempfile

    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample

    examples = [TrainExample(q, d, n, "", "stdlib") for q, d, n in stdlib_triples(batch_size)]
    # the tiny model (with --tiny), removed when the step is collected or this worker process ends
    work = tempfile.TemporaryDirectory(prefix="benchmark-")
    path = args.model
    if args.tiny:
        from llm2vec.testing import save_tiny_model

        path = save_tiny_model("llama3", Path(work.name) / "tiny", hidden_size=64)
    if variant == "project":
        from peft import get_peft_model

        from llm2vec.llm2vec_contrastive import LLM2VecContrastive

        budget = args.st_mini_batch * args.stage_II_max_length
        encoder = LLM2VecContrastive.load(str(path), max_length=args.stage_II_max_length, embedding_token_budget=budget)
        encoder.model = get_peft_model(encoder.model, paper_lora())
        batch = TrainCollator.for_encoder(encoder.train(), with_negative=True)(examples)

        def step(_folder=work):  # the folder lives as long as the step
            encoder.zero_grad(set_to_none=True)
            return train_step(encoder, batch).loss.item()

        return step, {"tokens": int(sum(batch[k]["attention_mask"].sum() for k in ("query", "positive", "negative")))}
    from llm2vec.st_training import build_loss, sentence_transformer

    model = sentence_transformer(str(path), lora=paper_lora(), max_length=args.stage_II_max_length).train()
    loss = build_loss("CachedMultipleNegativesRankingLoss", {"mini_batch_size": args.st_mini_batch}, model, 20.0)
    features = [model.preprocess([getattr(e, side) for e in examples]) for side in ("query", "positive", "negative")]

    def step(_folder=work):
        model.zero_grad(set_to_none=True)
        value = loss(features, None)
        value.backward()
        return value.item()

    return step, {"tokens": int(sum(f["attention_mask"].sum() for f in features))}


STEPS = {"stage_I": stage_I_step, "stage_II": stage_II_step, "encode": encode_step, "stage_II_st": stage_II_st_step}


def worker(args) -> None:
    import torch

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    step, extra = STEPS[args.bench](args, args.variant, args.batch)
    cuda = args.device.startswith("cuda")
    setup = status_mib()["VmRSS"]
    loss = step()  # warm-up (and the loss the variants must agree on)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        again = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if abs(again - loss) > 1e-5 * max(1.0, abs(loss)):
            raise SystemExit(
                f"benchmark: {args.bench}/{args.variant}: the loss changed between repeats ({loss} then {again})"
            )
    record = {"bench": args.bench, "variant": args.variant, "batch": args.batch}
    record.update(seconds=round(statistics.median(times), 4), peak_rss_mib=round(peak_rss_mib(), 1))
    record.update(setup_rss_mib=round(setup, 1), loss=loss, device=args.device, dtype=args.dtype)
    if cuda:
        record["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    print(json.dumps({**record, **extra}))


# --------------------------------------------------------------------------------------------------- driver


def plan(args) -> list[tuple[str, str, int]]:
    runs = []
    if "stage_I" in args.only:
        first, *larger = args.stage_I_batches
        runs += [("stage_I", v, first) for v in ("authors", "plain", "optimised", "packed", "checkpointed")]
        runs += [("stage_I", v, b) for b in larger for v in ("optimised", "checkpointed")]
    if "stage_II" in args.only:
        runs += [("stage_II", v, b) for b in args.stage_II_batches for v in ("plain", "cached")]
    if "encode" in args.only:
        runs += [("encode", v, args.encode_batch) for v in ("bare", "encode")]
    if "stage_II_st" in args.only:
        runs += [("stage_II_st", v, b) for b in args.stage_II_st_batches for v in ("project", "st")]
    return runs


def run_worker(args, bench: str, variant: str, batch: int) -> dict:
    identity = {"bench": bench, "variant": variant, "batch": batch}
    return in_own_process(
        __file__, {**vars(args), **identity}, f"benchmark: {bench}/{variant} at batch {batch}", identity
    )


def check_and_print(records: list[dict], as_json: bool) -> None:
    done = [r for r in records if "failed" not in r]
    for bench, batch in dict.fromkeys((r["bench"], r["batch"]) for r in done):
        group = [r for r in done if (r["bench"], r["batch"]) == (bench, batch)]
        losses = [r["loss"] for r in group]
        rtol = 1e-4 if all(r.get("dtype", "float32") == "float32" for r in group) else 1e-2  # bf16 rounding
        if max(losses) - min(losses) > rtol * max(abs(x) for x in losses):
            raise SystemExit(
                f"benchmark: {bench} at batch {batch}: the variants disagree: "
                + ", ".join(f"{r['variant']} {r['loss']:.6f}" for r in group)
            )
    references = {(r["bench"], r["batch"]): r for r in done if r["variant"] == REFERENCE[r["bench"]]}

    if as_json:
        for r in records:
            print(json.dumps(r))
        return
    print(
        f"{'bench':9} {'variant':12} {'batch':>5} {'tokens':>7} {'seconds':>8} {'peak MiB':>9} "
        f"{'step MiB':>9} {'time ratio':>10} {'mem ratio':>9}  loss"
    )
    for r in records:
        if "failed" in r:
            print(f"{r['bench']:9} {r['variant']:12} {r['batch']:>5} {r['failed']}")
            continue
        ref = references.get((r["bench"], r["batch"]))
        time_ratio = f"{r['seconds'] / ref['seconds']:.2f}" if ref else "-"
        mem_ratio = f"{r['peak_rss_mib'] / ref['peak_rss_mib']:.2f}" if ref else "-"
        print(
            f"{r['bench']:9} {r['variant']:12} {r['batch']:>5} {r['tokens']:>7} {r['seconds']:>8.3f} "
            f"{r['peak_rss_mib']:>9.0f} {r['peak_rss_mib'] - r['setup_rss_mib']:>9.0f} {time_ratio:>10} "
            f"{mem_ratio:>9}  {r['loss']:.6f}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a causal LM folder (default: %(default)s)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama-3 model instead of --model (CI)")
    p.add_argument("--json", action="store_true", help="one JSON object per measurement instead of the table")
    p.add_argument("--only", nargs="+", default=["stage_I", "stage_II", "encode"], choices=sorted(STEPS))
    batches = "pairs: the first for every variant, the others for optimised and checkpointed"
    p.add_argument("--stage_I_batches", type=int, nargs="+", default=[8, 32], help=batches)
    p.add_argument("--stage_II_batches", type=int, nargs="+", default=[8, 32, 64], help="triples")
    p.add_argument("--stage_II_st_batches", type=int, nargs="+", default=[64], help="triples (--only stage_II_st)")
    p.add_argument("--st_mini_batch", type=int, default=8, help="texts per gradient-cache chunk (stage_II_st)")
    p.add_argument("--encode_batch", type=int, default=32)
    p.add_argument("--encode_texts", type=int, default=128)
    p.add_argument("--max_length", type=int, default=256, help="tokens per Stage I text and encoded text")
    p.add_argument("--stage_II_max_length", type=int, default=128, help="tokens per Stage II text")
    p.add_argument("--repeats", type=int, default=2, help="timed steps after the warm-up step (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]; on CUDA peak_cuda_mib is reported too")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--attn_implementation", default="sdpa", choices=("sdpa", "eager", "flash_attention_2"))
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a measurement's settings as JSON: run it here
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(argparse.Namespace(**json.loads(args.worker)))
        return 0
    if not args.tiny and not (args.model / "config.json").is_file():
        print(
            f"benchmark: error: no model at {args.model}; convert SmolLM2 first (python experiments/demo/smollm2.py)"
            " or pass --model PATH or --tiny",
            file=sys.stderr,
        )
        return 2
    check_and_print([run_worker(args, *run) for run in plan(args)], args.json)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
