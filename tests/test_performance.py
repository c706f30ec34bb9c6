"""Memory-bounded Stage I: blockwise LM-head cross-entropy and token-budget chunks of pairs.

Both are exact rewrites of the plain computation; every test compares them with it (loss and gradients).
"""

import pytest
import torch
import torch.nn.functional as F
from test_stage_I import PAIRS as STAGE_I_PAIRS
from torch import nn

from llm2vec.loss.linear_cross_entropy import linear_cross_entropy_sum

# ---------------------------------------------------------------------------------------------- LM head + CE


def plain_nll(hidden, lm_head, targets):
    """The reference: all (N, V) logits at once, float32 cross-entropy summed over the rows."""
    return F.cross_entropy(lm_head(hidden).float(), targets, reduction="sum")


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_blockwise_cross_entropy_equals_full_logits(chunk_rows, bias):
    torch.manual_seed(0)
    n, h, v = 23, 16, 50
    head = nn.Linear(h, v, bias=bias)
    hidden0 = torch.randn(n, h)
    targets = torch.randint(0, v, (n,))

    def run(fn):
        head.zero_grad()
        hidden = hidden0.clone().requires_grad_(True)
        loss = fn(hidden)
        loss.backward()
        grads = {"hidden": hidden.grad, "weight": head.weight.grad.clone()}
        if bias:
            grads["bias"] = head.bias.grad.clone()
        return loss.detach(), grads

    ref_loss, ref = run(lambda x: plain_nll(x, head, targets))
    loss, got = run(lambda x: linear_cross_entropy_sum(x, head, targets, chunk_rows=chunk_rows))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_gradients(got, ref, rtol=1e-6)


def test_blockwise_cross_entropy_with_a_tied_head():
    """An LM head that shares its weight with the input embedding (SmolLM2, Llama-3.2): the gradient reaching the
    shared weight through both uses is the same."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(30, 8), nn.Linear(8, 30, bias=False)
    head.weight = embed.weight
    ids, targets = torch.randint(0, 30, (11,)), torch.randint(0, 30, (11,))
    grads = []
    for rows in (0, 4):
        embed.zero_grad()
        linear_cross_entropy_sum(torch.tanh(embed(ids)), head, targets, chunk_rows=rows).backward()
        grads.append({"shared": embed.weight.grad.clone()})
    assert_same_gradients(grads[1], grads[0], rtol=1e-6)


def test_blockwise_cross_entropy_never_holds_more_than_one_block():
    """Every LM-head call, in forward and in the recomputation of backward, sees at most ``chunk_rows`` rows;
    and the only logits kept for backward are none (each block is recomputed)."""
    torch.manual_seed(0)
    head = nn.Linear(8, 40)
    hidden = torch.randn(10, 8, requires_grad=True)
    targets = torch.randint(0, 40, (10,))
    rows_seen = []
    head.register_forward_hook(lambda module, args, out: rows_seen.append(out.shape[0]))
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = linear_cross_entropy_sum(hidden, head, targets, chunk_rows=4)
    assert rows_seen == [4, 4, 2]  # forward, one block at a time
    assert not [s for s in saved if s[-1] == 40], f"logits kept for backward: {saved}"
    loss.backward()
    assert sorted(rows_seen[3:]) == [2, 4, 4]  # each block recomputed once in backward


def test_reconstruction_loss_with_logit_blocks_equals_plain(tiny_models):
    """The Stage I loss and every parameter's gradient are the same with LM-head blocks of 5 rows."""
    from llm2vec.collator import TrainCollator
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    causal_lm, tokenizer = tiny_models["qwen2"]
    plain = LLM2Vec_q2d_d2q(causal_lm, tokenizer)
    blocks = LLM2Vec_q2d_d2q(causal_lm, tokenizer, logit_chunk_rows=5)
    batch = TrainCollator.for_encoder(plain, reconstruction="text")(examples())
    ref_loss, ref = loss_and_grads(plain, batch)
    loss, got = loss_and_grads(blocks, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_gradients(got, ref, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- helpers

PAIRS = [
    *STAGE_I_PAIRS,  # the Stage I tests' pairs, and two more of other lengths
    ("", "fox", "Anchor embeddings reconstruct the document from the query and the query from the document."),
    ("Retrieve the answer", "Large language models", "vectors"),
]


def examples(pairs=PAIRS):
    from llm2vec.dataset import TrainExample

    return [TrainExample(query=q, positive=d, negative=None, query_instruction=i, source="t") for i, q, d in pairs]


def loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.loss.detach(), grads


def assert_same_gradients(got, ref, rtol):
    assert set(got) == set(ref) and ref
    for name, g in ref.items():
        # relative to the tensor's scale: elementwise relative error is meaningless for entries near 0
        err = (got[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err <= rtol, f"{name}: relative error {err:.2e}"


# ---------------------------------------------------------------------------------------------- token budget


def loop_cost(lengths, pairs):
    """Padded positions of running ``pairs`` together, call by call with plain loops."""
    total = 0
    for c in range(len(lengths[0])):
        widest = 0
        for i in pairs:
            widest = max(widest, lengths[i][c])
        total += widest * len(pairs)
    return total


@pytest.mark.parametrize("budget", [1, 40, 90, 150, 10_000])
def test_chunks_cover_every_pair_once_within_the_budget(budget):
    from llm2vec.chunked_steps import chunk_cost, plan_chunks

    generator = torch.Generator().manual_seed(budget)
    lengths = torch.randint(1, 20, (13, 4), generator=generator).tolist()
    chunks = plan_chunks(lengths, budget)
    assert sorted(i for rows in chunks for i in rows) == list(range(13))
    for rows in chunks:
        assert chunk_cost(lengths, rows) == loop_cost(lengths, rows)
        assert len(rows) == 1 or loop_cost(lengths, rows) <= budget
    # greedy: a chunk closes only when the next pair (longest first) would break the budget
    order = sorted(range(13), key=lambda i: (-sum(lengths[i]), i))
    flat = [i for rows in chunks for i in sorted(rows, key=order.index)]
    assert flat == order
    for rows, following in zip(chunks, chunks[1:]):
        assert loop_cost(lengths, rows + [min(following, key=order.index)]) > budget
    if budget == 1:
        assert all(len(rows) == 1 for rows in chunks)
    if budget == 10_000:
        assert chunks == [order]  # one chunk, longest first


def test_select_pairs_trims_padding_on_either_side():
    from llm2vec.chunked_steps import select_pairs
    from llm2vec.collator import pad_batch
    from llm2vec.templates import EncodedText

    encoded = [EncodedText(input_ids=tuple(range(10, 10 + n)), text_start=1, text_end=n - 1) for n in (7, 3, 5)]
    for side in ("right", "left"):
        full = pad_batch(encoded, pad_token_id=0, padding_side=side)
        before = {k: v.clone() for k, v in full.items()}
        part = select_pairs({"query": full, "target_counts": {"q2d": 1}}, [1, 2])
        assert part["target_counts"] == {"q2d": 1}
        for row, n in zip(part["query"]["input_ids"], (3, 5)):  # each row's real tokens, in order
            mask = full["attention_mask"].new_tensor([t != 0 for t in row.tolist()])
            assert row[mask.bool()].tolist() == list(range(10, 10 + n))
        assert part["query"]["input_ids"].shape == (2, 5)
        torch.testing.assert_close(part["query"]["attention_mask"].sum(1), torch.tensor([3, 5]))
        expected = pad_batch(encoded[1:], pad_token_id=0, padding_side=side)
        for name in expected:
            assert torch.equal(part["query"][name], expected[name]), (side, name)
        assert all(torch.equal(full[k], before[k]) for k in full)  # the batch itself is not changed


def chunked_step(model, batch):
    """``step_in_parts`` as the trainer calls it (weight 1); records which backward calls ran under no_sync."""
    import contextlib

    synced = []
    state = {"no_sync": False}

    @contextlib.contextmanager
    def no_sync():
        state["no_sync"] = True
        try:
            yield
        finally:
            state["no_sync"] = False

    def backward(tensor, grad=None):
        synced.append(not state["no_sync"])
        tensor.backward(grad)

    model.zero_grad()
    out = model.step_in_parts(model, batch, backward, no_sync)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out, grads, synced


@pytest.mark.parametrize("family", ["llama3", "mistral"])
@pytest.mark.parametrize("budget", [1, 150, 260])
def test_token_budget_step_equals_plain_step(tiny_models, family, budget):
    from llm2vec.chunked_steps import decoder_call_lengths, plan_chunks
    from llm2vec.collator import TrainCollator
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    causal_lm, tokenizer = tiny_models[family]
    plain = LLM2Vec_q2d_d2q(causal_lm, tokenizer, alpha=0.2)
    chunked = LLM2Vec_q2d_d2q(causal_lm, tokenizer, alpha=0.2, token_budget=budget)
    batch = TrainCollator.for_encoder(plain, reconstruction="text")(examples())
    # step-wide counts as the trainer hands them (say, this batch is half of the step's targets)
    batch = {**batch, "target_counts": {k: 2 * v for k, v in batch["target_counts"].items()}}
    chunks = plan_chunks(decoder_call_lengths(batch, ("q2d", "d2q")).tolist(), budget)
    assert len(chunks) > 1 and (budget != 1 or len(chunks) == len(PAIRS))

    plain.zero_grad()
    ref = plain(**batch)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}
    plain.zero_grad()
    out, grads, synced = chunked_step(chunked, batch)

    assert synced == [False] * (len(chunks) - 1) + [True]  # one all-reduce, after the last chunk
    assert out.chunks == len(chunks) and not out.loss.requires_grad
    torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.loss_q2d, ref.loss_q2d.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.loss_d2q, ref.loss_d2q.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out.query_embedding, ref.query_embedding.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.document_embedding, ref.document_embedding.detach(), rtol=1e-5, atol=1e-6)
    assert_same_gradients(grads, ref_grads, rtol=1e-5)
    # chunks of pairs of like length carry less padding than the whole batch
    assert out.metrics["padding_fraction"] < ref.metrics["padding_fraction"]
    assert out.real_positions == ref.real_positions


def test_token_budget_with_one_direction_and_logit_blocks(tiny_models):
    """alpha = 1 (OnlyQ2D: no d2q pass, so its widths are not counted) with LM-head blocks as well."""
    from llm2vec.collator import TrainCollator
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    causal_lm, tokenizer = tiny_models["qwen2"]
    plain = LLM2Vec_q2d_d2q(causal_lm, tokenizer, alpha=1.0)
    chunked = LLM2Vec_q2d_d2q(causal_lm, tokenizer, alpha=1.0, token_budget=100, logit_chunk_rows=4)
    batch = TrainCollator.for_encoder(plain, reconstruction="all")(examples())
    ref_loss, ref_grads = loss_and_grads(plain, batch)
    out, grads, _ = chunked_step(chunked, batch)
    assert out.chunks > 1 and out.loss_d2q is None
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=0)
    assert_same_gradients(grads, ref_grads, rtol=1e-5)


def test_budget_off_takes_the_plain_step_and_a_batch_within_it_one_chunk(tiny_models):
    """Budget 0: ``None`` (the trainer's plain step). A budget the whole batch fits: still the chunked step (so that
    every process takes the same step), one chunk whose loss and gradients are the plain forward's."""
    from llm2vec.collator import TrainCollator
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    causal_lm, tokenizer = tiny_models["llama3"]
    off = LLM2Vec_q2d_d2q(causal_lm, tokenizer, token_budget=0)
    batch = TrainCollator.for_encoder(off, reconstruction="text")(examples())
    assert off.step_in_parts(off, batch, None, None) is None
    ref_loss, ref_grads = loss_and_grads(off, batch)
    within = LLM2Vec_q2d_d2q(causal_lm, tokenizer, token_budget=10**6)
    out, grads, synced = chunked_step(within, batch)
    assert out.chunks == 1 and synced == [True]
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-6, atol=0)
    assert_same_gradients(grads, ref_grads, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- end to end


def test_training_with_a_token_budget_equals_training_without(tmp_path):
    """Two optimizer steps (2 micro-batches each) of the Stage I driver, with and without chunks and LM-head
    blocks: the same weights; the padding fraction is logged, and one pair per chunk has no padding at all."""
    from _drivers import tiny_run_flags
    from _tiny_data import write_tiny_e5
    from safetensors.torch import load_file

    from llm2vec.testing import save_tiny_model
    from llm2vec.training import run

    model, data = save_tiny_model("llama3", tmp_path / "model"), write_tiny_e5(tmp_path / "data")

    def train(name, **extra):
        fields = {"learning_rate": 1e-3, "max_steps": 2, "gradient_accumulation_steps": 2, "optim": "sgd", **extra}
        trainer = run("I", tiny_run_flags(model, data, tmp_path / name, **{"save_strategy": "no", **fields}))
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return load_file(tmp_path / name / "model.safetensors"), logs

    plain, plain_logs = train("plain")
    chunked, chunked_logs = train("chunked", token_budget=1, logit_chunk_rows=3)
    base = load_file(tmp_path / "model" / "model.safetensors")
    assert any(not torch.equal(base[k], plain[k]) for k in plain), "the steps changed nothing"
    for k in plain:
        torch.testing.assert_close(chunked[k], plain[k], rtol=0, atol=1e-6, msg=k)
    assert len(plain_logs) == len(chunked_logs) == 2
    for a, b in zip(plain_logs, chunked_logs):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert a["padding_fraction"] > 0 and a["chunks"] == 1
        assert b["padding_fraction"] == 0 and b["chunks"] == 4  # one pair per chunk, trimmed to its own length


def test_token_budget_under_ddp_and_fsdp_equals_one_plain_process(tmp_path):
    """Two gloo processes with one pair per chunk (DDP: all-reduce deferred by no_sync until the last chunk;
    FSDP2 full shard) train the same weights as one process without chunks on the same global batch."""
    import json
    import subprocess
    import sys

    from _drivers import launcher, subprocess_env
    from _tiny_data import write_tiny_e5
    from test_fsdp import FSDP_ON_TWO, ROOT, check, flags, run_checked, weights

    from llm2vec.testing import save_tiny_model

    model, data = save_tiny_model("llama3", tmp_path / "model"), write_tiny_e5(tmp_path / "data")
    common = {"max_steps": 2, "save_strategy": "no", "optim": "sgd"}
    run_checked(
        [sys.executable, str(ROOT / "experiments/run_stage_I.py"), *flags(model, data, tmp_path / "single", **common)],
        "one process",
    )
    base, one = weights(model), weights(tmp_path / "single")
    assert any(not torch.equal(base[k], one[k]) for k in one), "training changed nothing"
    runs = {
        "ddp": [
            "experiments/run_stage_I.py",
            *flags(
                model,
                data,
                tmp_path / "ddp",
                per_device_train_batch_size=2,
                ddp_backend="gloo",
                token_budget=1,
                logit_chunk_rows=3,
                **common,
            ),
        ],
        "fsdp": [
            "tests/_fsdp_worker.py",
            str(tmp_path / "reports"),
            *flags(model, data, tmp_path / "fsdp", **FSDP_ON_TWO, token_budget=1, **common),
        ],
    }
    for name, (script, *argv) in runs.items():
        result = subprocess.run(
            [*launcher(2), str(ROOT / script), *argv],
            env=subprocess_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        check(result, name)
        got = weights(tmp_path / name)
        for k in one:
            torch.testing.assert_close(got[k], one[k], rtol=0, atol=2e-6, msg=f"{name}: {k}")
    history = json.loads((tmp_path / "reports" / "rank0.json").read_text())["log_history"]
    assert all(h["chunks"] == 2 and h["padding_fraction"] == 0 for h in history if "loss" in h)


# ------------------------------------------------------------------------------------------- benchmark


def test_benchmark_runs_every_variant_in_its_own_process_with_equal_losses():
    """``experiments/benchmark.py --tiny --json``: one JSON line per measurement with the documented fields,
    the variants of a bench agree on the loss (the authors' formulation included), each ran in its own process."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            sys.executable,
            str(root / "experiments" / "benchmark.py"),
            "--tiny",
            "--json",
            "--repeats",
            "1",
            "--stage_I_batches",
            "4",
            "8",
            "--stage_II_batches",
            "4",
            "--encode_texts",
            "16",
            "--encode_batch",
            "8",
            "--max_length",
            "96",
            "--stage_II_max_length",
            "48",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    seen = {(r["bench"], r["variant"], r["batch"]) for r in records}
    assert seen == {
        ("stage_I", "authors", 4),
        ("stage_I", "plain", 4),
        ("stage_I", "optimised", 4),
        ("stage_I", "checkpointed", 4),
        ("stage_I", "packed", 4),
        ("stage_I", "optimised", 8),
        ("stage_I", "checkpointed", 8),
        ("stage_II", "plain", 4),
        ("stage_II", "cached", 4),
        ("encode", "bare", 8),
        ("encode", "encode", 8),
    }
    for r in records:
        assert {"bench", "variant", "batch", "seconds", "peak_rss_mib", "loss"} <= r.keys()
        assert r["seconds"] > 0 and r["peak_rss_mib"] > 0
    for bench, batch in {(r["bench"], r["batch"]) for r in records}:
        losses = [r["loss"] for r in records if (r["bench"], r["batch"]) == (bench, batch)]
        assert max(losses) - min(losses) <= 1e-4 * max(abs(x) for x in losses), (bench, batch, losses)


def test_benchmark_refuses_to_compare_variants_that_disagree():
    import benchmark

    records = [
        {"bench": "stage_I", "variant": "authors", "batch": 8, "loss": 5.0},
        {"bench": "stage_I", "variant": "plain", "batch": 8, "loss": 5.01},
    ]
    with pytest.raises(SystemExit, match="disagree"):
        benchmark.check_and_print(records, as_json=True)


def test_benchmark_reports_a_variant_killed_for_memory_and_goes_on(capsys, monkeypatch):
    """A worker killed by the out-of-memory killer becomes a row that says so; the other variants are still
    checked against each other and printed; any other failure stops the benchmark."""
    import subprocess
    import types

    import benchmark

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=-9, stdout="", stderr=""))
    args = benchmark.build_parser().parse_args(["--tiny"])
    record = benchmark.run_worker(args, "stage_II", "plain", 64)
    assert record == {"bench": "stage_II", "variant": "plain", "batch": 64, "failed": "killed (out of memory)"}
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=1, stdout="", stderr="x"))
    with pytest.raises(SystemExit, match="failed"):
        benchmark.run_worker(args, "stage_II", "plain", 64)
    ok = {"seconds": 2.0, "peak_rss_mib": 100.0, "setup_rss_mib": 50.0, "tokens": 10}
    records = [
        record,
        {"bench": "stage_II", "variant": "cached", "batch": 64, "loss": 2.0, **ok},
        {"bench": "stage_II", "variant": "plain", "batch": 8, "loss": 2.0, **ok},
        {"bench": "stage_II", "variant": "cached", "batch": 8, "loss": 2.0, **ok, "seconds": 3.0},
    ]
    benchmark.check_and_print(records, as_json=False)
    out = capsys.readouterr().out
    assert "killed (out of memory)" in out and "1.50" in out  # cached at 8: 3.0 s / 2.0 s
    records.append({"bench": "stage_II", "variant": "plain", "batch": 32, "loss": 2.0, **ok})
    records.append({"bench": "stage_II", "variant": "cached", "batch": 32, "loss": 2.5, **ok})
    with pytest.raises(SystemExit, match="disagree"):
        benchmark.check_and_print(records, as_json=False)


def test_benchmark_compares_the_stage_II_step_with_sentence_transformers_at_one_loss():
    """``--only stage_II_st``: this project's cached Stage II step and sentence-transformers' cached loss on the same
    tiny model and batch, each in its own process, agree on the loss (checked before any ratio is printed)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    flags = ["--tiny", "--json", "--only", "stage_II_st", "--stage_II_st_batches", "4", "--st_mini_batch", "2"]
    flags += ["--repeats", "1", "--stage_II_max_length", "48", "--threads", "1"]
    result = subprocess.run(
        [sys.executable, str(root / "experiments" / "benchmark.py"), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = {r["variant"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert set(records) == {"project", "st"} and {r["batch"] for r in records.values()} == {4}
    project, st = records["project"]["loss"], records["st"]["loss"]
    assert abs(project - st) <= 1e-5 * abs(project) and project > 0
