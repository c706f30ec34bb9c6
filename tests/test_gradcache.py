"""Stage II gradient cache (embedding_token_budget): the chunk plan, and the cached step against the plain one and
against a reference that shares none of its code (tests/_references.py): every text run alone through the LoRA
model, then InfoNCE (Eq. 6-7) query by query in float64, its LoRA gradients by autograd.

Gradients are compared per LoRA parameter, relative to the parameter's largest gradient entry, in float32.
"""

import contextlib
import json

import pytest
import torch
from _drivers import tiny_run_flags
from _references import stage_II_loss_by_hand
from _stage_II_dist_worker import build_encoder, run_gradcache_rank
from _tiny_data import write_tiny_e5

from llm2vec import chunked_steps
from llm2vec.arguments import ConfigError, parse_config
from llm2vec.chunked_steps import collate_rows, plan_chunks, rows_of
from llm2vec.llm2vec_contrastive import LLM2VecContrastive

SIDES = ("query", "positive", "negative")


def random_features(lengths, pad_token_id, generator, padding_side="right", prefix=2):
    """A padded batch of random token ids with these real lengths; ``text_mask`` leaves out ``prefix`` tokens (as an
    instruction would be) so that mean pooling depends on it."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    attention, text = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        start = width - n if padding_side == "left" else 0
        ids[row, start : start + n] = torch.randint(5, 300, (n,), generator=generator)
        attention[row, start : start + n] = 1
        text[row, start + min(prefix, n - 1) : start + n] = 1
    return {"input_ids": ids, "attention_mask": attention, "text_mask": text}


def random_batch(lengths_by_side, pad_token_id, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {side: random_features(lengths, pad_token_id, g) for side, lengths in zip(SIDES, lengths_by_side)}


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def plain_step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, lora_grads(model)


def cached_step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model.step_in_parts(model, batch, lambda tensor, grad=None: tensor.backward(grad), contextlib.nullcontext)
    assert out is not None, "the cached step fell back to the plain step"
    return out, lora_grads(model)


def by_hand(model, batch):
    """The reference loss and LoRA gradients: texts alone, InfoNCE query by query in float64 (no dropout)."""
    model.zero_grad(set_to_none=True)
    loss = stage_II_loss_by_hand(model, batch)
    loss.backward()
    return loss.detach(), lora_grads(model)


def assert_grads_close(got, expected, rel=1e-5):
    """Each tensor of ``got`` within ``rel`` x (largest entry of the expected tensor) of the expected one."""
    assert got.keys() == expected.keys()
    for name in expected:
        scale = expected[name].abs().max().item()
        assert scale > 0, name  # every LoRA matrix gets a gradient (the B matrices are random)
        error = (got[name] - expected[name]).abs().max().item()
        assert error <= rel * scale, f"{name}: max error {error:.3g} vs largest entry {scale:.3g}"


def max_relative_difference(a, b):
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


# ---------------------------------------------------------------- the chunk plan


def test_plan_chunks_by_hand():
    lengths = [5, 9, 3, 9, 7]
    # sorted longest first, ties in input order: 1 (9), 3 (9), 4 (7), 0 (5), 2 (3)
    assert plan_chunks(lengths, 18) == [[1, 3], [4, 0], [2]]
    assert plan_chunks(lengths, 100) == [[1, 3, 4, 0, 2]]
    assert plan_chunks(lengths, 1) == [[1], [3], [4], [0], [2]]  # a row over the budget is a chunk of its own
    with pytest.raises(ValueError):
        plan_chunks(lengths, 0)
    # at least 4 chunks: the largest padded chunk is halved, (1, 3) -> (1), (3)
    assert plan_chunks(lengths, 18, min_chunks=4) == [[1], [3], [4, 0], [2]]
    assert plan_chunks(lengths, 100, min_chunks=3) == [[1, 3], [4], [0, 2]]
    assert plan_chunks(lengths, 100, min_chunks=5) == [[1], [3], [4], [0], [2]]
    with pytest.raises(ValueError):
        plan_chunks(lengths, 100, min_chunks=6)


@pytest.mark.parametrize("budget", [1, 7, 20, 33, 1000])
@pytest.mark.parametrize("min_chunks", [1, 9])
def test_plan_chunks_covers_every_row_once_within_the_budget(budget, min_chunks):
    lengths = torch.randint(1, 30, (40,), generator=torch.Generator().manual_seed(budget)).tolist()
    greedy = plan_chunks(lengths, budget)
    chunks = plan_chunks(lengths, budget, min_chunks=min_chunks)
    assert len(chunks) == max(len(greedy), min_chunks)
    if min_chunks == 1:
        # greedy: the next chunk's first row would not have fitted into the previous chunk
        for previous in chunks[:-1]:
            assert (len(previous) + 1) * max(lengths[i] for i in previous) > budget
    assert sorted(i for chunk in chunks for i in chunk) == list(range(40))
    for chunk in chunks:
        padded = len(chunk) * max(lengths[i] for i in chunk)
        assert padded <= budget or len(chunk) == 1
    flat = [lengths[i] for chunk in chunks for i in chunk]
    assert flat == sorted(lengths, reverse=True)


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("pooling_mode", ["eos_token", "mean"])
def test_rows_re_collated_embed_as_the_padded_batch(llama_checkpoint, padding_side, pooling_mode):
    """Cutting rows to their real tokens and right-padding them again changes no embedding (padding either side)."""
    model = build_encoder(llama_checkpoint)
    model.pooling_mode = pooling_mode
    batch = random_features([7, 12, 3, 9], model.pad_token_id, torch.Generator().manual_seed(0), padding_side)
    rows = rows_of(batch)
    assert [len(r["input_ids"]) for r in rows] == [7, 12, 3, 9]
    with torch.no_grad():
        whole = model.embed(batch)
        one_by_one = torch.cat([model.embed(collate_rows([r], model.pad_token_id)) for r in rows])
        regrouped = model.embed(collate_rows([rows[3], rows[0]], model.pad_token_id))
    torch.testing.assert_close(one_by_one, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(regrouped, whole[[3, 0]], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the cached step, one process

LENGTHS = ([11, 17, 6, 14, 9], [30, 22, 25, 19, 28], [12, 24, 8, 20, 16])  # query, positive, negative rows


@pytest.mark.parametrize("with_negative", [True, False])
@pytest.mark.parametrize("budget", [1, 30, 61, 150, 450])  # 1: every text its own chunk; 450: one chunk
def test_cached_step_equals_plain_step(llama_checkpoint, budget, with_negative):
    model = build_encoder(llama_checkpoint)
    model.train()
    batch = random_batch(LENGTHS, model.pad_token_id)
    if not with_negative:
        del batch["negative"]
    plain, expected = plain_step(model, batch)
    model.embedding_token_budget = budget
    cached, got = cached_step(model, batch)
    torch.testing.assert_close(cached.loss, plain.loss.detach(), rtol=1e-5, atol=0)
    for side in ("query_embedding", "positive_embedding", "negative_embedding"):  # back in their original order
        if getattr(plain, side) is not None:
            assert_grads_close({side: getattr(cached, side)}, {side: getattr(plain, side).detach()})
    assert not cached.loss.requires_grad
    assert_grads_close(got, expected)
    reference, reference_grads = by_hand(model, batch)
    torch.testing.assert_close(cached.loss.double(), reference, rtol=1e-5, atol=0)
    assert_grads_close(got, reference_grads)


def test_cached_step_on_a_collated_batch(llama_checkpoint):
    """The collator's batch (template, instruction, hard negatives): the same loss and gradients as the plain step."""
    from test_stage_II import union_batch

    model = build_encoder(llama_checkpoint)
    model.train()
    batch = union_batch(model, n=4)
    plain, expected = plain_step(model, batch)
    model.embedding_token_budget = 2 * batch["positive"]["input_ids"].shape[1]
    cached, got = cached_step(model, batch)
    torch.testing.assert_close(cached.loss, plain.loss.detach(), rtol=1e-5, atol=0)
    assert_grads_close(got, expected)
    reference, reference_grads = by_hand(model, batch)
    torch.testing.assert_close(cached.loss.double(), reference, rtol=1e-5, atol=0)
    assert_grads_close(got, reference_grads)


def test_one_chunk_graph_at_a_time_and_all_but_the_last_under_no_sync(llama_checkpoint):
    """What bounds the memory: every forward embeds one chunk within the budget, each graph is back-propagated
    before the next forward with a graph, and only the last chunk's backward is outside ``no_sync``."""
    model = build_encoder(llama_checkpoint)
    model.train()
    batch = random_batch(LENGTHS, model.pad_token_id)
    model.embedding_token_budget = 61
    events, synced = [], [True]

    class Wrapped(torch.nn.Module):  # stands for DDP: forwards to the encoder
        def __init__(self):
            super().__init__()
            self.module = model

        def forward(self, **kwargs):
            features = kwargs["features"]
            events.append(("forward", torch.is_grad_enabled(), features["input_ids"].numel()))
            return self.module(**kwargs)

    @contextlib.contextmanager
    def no_sync():
        synced[0] = False
        yield
        synced[0] = True

    def backward(tensor, grad=None):
        events.append(("backward", synced[0]))
        tensor.backward(grad)

    model.step_in_parts(Wrapped(), batch, backward, no_sync)
    chunks = len(plan_chunks([n for side in LENGTHS for n in side], 61))
    assert chunks > 2
    pass_1, pass_2 = events[:chunks], events[chunks:]
    assert all(e[0] == "forward" and not e[1] and e[2] <= 61 for e in pass_1)
    assert pass_2[0::2] == [(e[0], True, e[2]) for e in pass_1]  # the same chunks again, with a graph
    assert pass_2[1::2] == [("backward", False)] * (chunks - 1) + [("backward", True)]


def test_budget_off_takes_the_plain_step(llama_checkpoint):
    model = build_encoder(llama_checkpoint)
    batch = random_batch(LENGTHS, model.pad_token_id)

    def fail(*args, **kwargs):
        raise AssertionError("no part may be run")

    assert model.step_in_parts(model, batch, fail, fail) is None  # budget 0


# ---------------------------------------------------------------- dropout: the RNG replay


def no_replay(monkeypatch):
    monkeypatch.setattr(chunked_steps.RngState, "restore", lambda self: None)


@pytest.mark.parametrize("replay", [True, False])
def test_cached_step_with_dropout_equals_plain_step_when_chunks_are_the_plain_batches(
    llama_checkpoint, monkeypatch, replay
):
    """With LoRA dropout, the cached step equals the plain step when its chunks are the plain step's three batches
    (all queries longer than all positives, longer than all negatives; budget 50 cuts them there): pass 1 then
    draws the plain step's masks and pass 2 must replay them. Without the replay the gradients differ."""
    model = build_encoder(llama_checkpoint, lora_dropout=0.3)
    model.train()
    batch = random_batch(([25, 25], [20, 20], [12, 12]), model.pad_token_id)
    lengths = [25, 25, 20, 20, 12, 12]
    assert plan_chunks(lengths, 50) == [[0, 1], [2, 3], [4, 5]]
    torch.manual_seed(7)
    plain, expected = plain_step(model, batch)
    rng_after_plain = torch.get_rng_state()
    model.embedding_token_budget = 50
    if not replay:
        no_replay(monkeypatch)
    torch.manual_seed(7)
    cached, got = cached_step(model, batch)
    torch.testing.assert_close(cached.loss, plain.loss.detach(), rtol=1e-5, atol=0)  # pass 1 drew the same masks
    if replay:
        assert_grads_close(got, expected)
        assert torch.equal(torch.get_rng_state(), rng_after_plain)  # the RNG stream goes on as after the plain step
    else:
        assert max_relative_difference(got, expected) > 1e-2


def one_graph_over_the_same_chunks(model, batch, budget):
    """The cached step's reference under dropout: the same chunks embedded in one graph, then the loss's backward."""
    sides = [s for s in SIDES if s in batch]
    rows = [row for side in sides for row in rows_of(batch[side])]
    chunks = plan_chunks([len(r["input_ids"]) for r in rows], budget)
    model.zero_grad(set_to_none=True)
    parts = [model.embed(collate_rows([rows[i] for i in chunk], model.pad_token_id)) for chunk in chunks]
    order = [i for chunk in chunks for i in chunk]
    embeddings = torch.cat(parts)[torch.argsort(torch.tensor(order))]
    by_side = dict(zip(sides, embeddings.split(batch["query"]["input_ids"].shape[0])))
    loss = model.loss_fn(by_side["query"], by_side["positive"], by_side.get("negative"))
    loss.backward()
    return loss.detach(), lora_grads(model)


@pytest.mark.parametrize("budget", [1, 61])
def test_cached_step_with_dropout_equals_one_graph_over_its_chunks(llama_checkpoint, monkeypatch, budget):
    """Mixed chunks (queries with documents): pass 2 replays pass 1's dropout masks, so the gradient is that of the
    loss the step reports; removing the replay breaks it."""
    model = build_encoder(llama_checkpoint, lora_dropout=0.3)
    model.train()
    batch = random_batch(LENGTHS, model.pad_token_id)
    torch.manual_seed(11)
    loss, expected = one_graph_over_the_same_chunks(model, batch, budget)
    rng_after = torch.get_rng_state()
    model.embedding_token_budget = budget
    torch.manual_seed(11)
    cached, got = cached_step(model, batch)
    torch.testing.assert_close(cached.loss, loss, rtol=1e-5, atol=0)
    assert_grads_close(got, expected)
    assert torch.equal(torch.get_rng_state(), rng_after)
    no_replay(monkeypatch)
    torch.manual_seed(11)
    _, unreplayed = cached_step(model, batch)
    assert max_relative_difference(unreplayed, expected) > 1e-2


# ---------------------------------------------------------------- two processes (DDP, gloo)


def test_two_processes_cached_step_equals_plain_step(llama_checkpoint, tmp_path):
    """DDP over two gloo processes, two consecutive steps: the cached gradients (after DDP's average) equal the plain
    step's on both ranks, whatever the number of chunks of each rank, including a rank whose batch fits one chunk.
    The second step is where DDP rebuilds its buckets (a collective at the first forward with a graph): a rank
    falling back to the plain step there would hang against a caching one, so the cache never falls back. The ranks
    run the same number of chunks (the largest plan), as FSDP's weight gathers in every forward need."""
    import torch.multiprocessing as mp

    pad = build_encoder(llama_checkpoint).pad_token_id
    rank_0_lengths = ([30, 28], [40, 36], [33, 31])
    cases = [
        (([6, 5], [8, 7], [9, 4]), [6, 2]),  # rank 0 long texts, rank 1 short ones: unequal numbers of chunks
        (([4, 3], [5, 5], [6, 2]), [6, 1]),
    ]  # rank 1's batch fits one chunk
    files = []
    for case, (rank_1_lengths, _) in enumerate(cases):
        lengths = [a + b for a, b in zip(rank_0_lengths, rank_1_lengths)]  # rows 0-1 on rank 0, rows 2-3 on rank 1
        files.append(str(tmp_path / f"batch{case}.pt"))
        torch.save(random_batch(lengths, pad, seed=3 + case), files[-1])
    mp.spawn(
        run_gradcache_rank,
        args=(2, str(tmp_path / "init"), llama_checkpoint, files, 40, str(tmp_path)),
        nprocs=2,
        join=True,
    )
    reference_model = build_encoder(llama_checkpoint)  # the workers' weights (no optimizer step between cases)
    for case, (_, chunks) in enumerate(cases):
        ranks = [torch.load(tmp_path / f"gradcache{case}_{r}.pt") for r in range(2)]
        # the union of the ranks' rows as one batch, by hand: DDP's average is the gradient of its mean loss
        reference, reference_grads = by_hand(reference_model, torch.load(files[case]))
        average = (ranks[0]["cached_loss"] + ranks[1]["cached_loss"]).double() / 2
        torch.testing.assert_close(average, reference, rtol=1e-5, atol=0)
        assert_grads_close(ranks[0]["cached"], reference_grads)
        assert [r["own_plan"] for r in ranks] == chunks
        assert [r["forwards"] for r in ranks] == [2 * max(chunks)] * 2  # the ranks agree on the number of chunks
        for result in ranks:
            torch.testing.assert_close(result["cached_loss"], result["plain_loss"], rtol=1e-5, atol=0)
            assert_grads_close(result["cached"], result["plain"])
        for name in ranks[0]["plain"]:  # DDP averaged: the same gradient on both ranks
            torch.testing.assert_close(ranks[0]["cached"][name], ranks[1]["cached"][name], rtol=0, atol=0)


# ---------------------------------------------------------------- the driver, end to end


def test_training_run_with_the_budget_equals_the_run_without(llama_checkpoint, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from llm2vec.training import run

    used = []
    step_in_parts = LLM2VecContrastive.step_in_parts

    def spy(self, *args, **kwargs):
        out = step_in_parts(self, *args, **kwargs)
        used.append(out is not None)
        return out

    monkeypatch.setattr(LLM2VecContrastive, "step_in_parts", spy)
    data = write_tiny_e5(tmp_path / "data", n=16, sources=("nq",))
    flags = tiny_run_flags(
        llama_checkpoint,
        data,
        None,  # each run names its own output_dir
        stage="II",
        e5_sources='["nq"]',
        max_steps=2,
        lora_dropout=0,
        save_strategy="no",
        max_seq_length=64,
        attn_implementation="sdpa",
        optim="sgd",
        learning_rate=0.5,
        activation_checkpointing="true",
    )
    plain = run("II", [*flags, "--output_dir", str(tmp_path / "plain")])
    assert used == [False, False]
    cached = run("II", [*flags, "--output_dir", str(tmp_path / "cached"), "--embedding_token_budget", "64"])
    assert used[2:] == [True, True]
    assert json.loads((tmp_path / "cached" / "run_config.json").read_text())["embedding_token_budget"] == 64
    assert "chunks of at most 64 tokens, padded" in (tmp_path / "cached" / "README.md").read_text()  # the model card
    assert "gradient cache" not in (tmp_path / "plain" / "README.md").read_text()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (plain, cached)]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    a, b = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("plain", "cached"))
    assert all(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # trained: peft starts the B matrices at zero
    # SGD, so the weights move linearly in the gradients (Adam would magnify rounding on near-zero gradients)
    assert_grads_close(b, a, rel=1e-4)


# ---------------------------------------------------------------- configuration


def test_budget_is_checked_against_max_seq_length(tmp_path):
    flags = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--use_cpu", "true", "--max_seq_length", "64"]
    with pytest.raises(ConfigError, match="embedding_token_budget=-1"):
        parse_config("II", [*flags, "--embedding_token_budget", "-1"])
    with pytest.raises(ConfigError, match="below max_seq_length 64"):
        parse_config("II", [*flags, "--embedding_token_budget", "63"]).validate()
    parse_config("II", [*flags, "--embedding_token_budget", "64"]).validate()
    assert parse_config("II", flags).stage.embedding_token_budget == 0  # off by default
