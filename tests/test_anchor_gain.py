"""The anchor's information gain (llm2vec.anchor_gain) against a per-pair reference, and on constructed cases
where it must be zero and where it must be clearly positive."""

import pytest
import torch
from test_stage_I import PAIRS, examples, reference_direction_nll

from llm2vec.anchor_gain import anchor_gain
from llm2vec.collator import TrainCollator
from llm2vec.dataset import TrainExample
from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q
from llm2vec.templates import encode as template_encode
from llm2vec.testing import FAMILIES, build_tiny_model


def reference(model, pairs, shift):
    """Per-direction (true, rolled) token means from one unpadded causal-LM forward per (anchor, target) pair:
    pair i's targets read the anchor of pair (i + shift) mod n."""
    lm, tokenizer, spec = model.model, model.tokenizer, model.template
    n = len(pairs)
    out = {}
    for direction in ("q2d", "d2q"):
        sums, tokens = {"true": 0.0, "rolled": 0.0}, 0
        for i, (instruction, query, doc) in enumerate(pairs):
            for kind, j in (("true", i), ("rolled", (i + shift) % n)):
                instruction_j, query_j, doc_j = pairs[j]
                if direction == "q2d":
                    nll, count = reference_direction_nll(lm, tokenizer, spec, (instruction_j, query_j), ("", doc))
                else:
                    nll, count = reference_direction_nll(lm, tokenizer, spec, ("", doc_j), (instruction, query))
                sums[kind] += float(nll)
            tokens += count
        out[direction] = (sums["true"] / tokens, sums["rolled"] / tokens)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_gain_equals_a_per_pair_reference(tiny_models, family):
    lm, tokenizer = tiny_models[family]
    model = LLM2Vec_q2d_d2q(lm, tokenizer)
    pairs = PAIRS + [("Retrieve code", "sort a list", "sorted(iterable) returns a new list")]
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples(pairs))
    got = anchor_gain(model, [batch])
    expected = reference(model, pairs, shift=len(pairs) // 2)
    assert got["pairs"] == len(pairs)
    for direction, (true, rolled) in expected.items():
        assert got[f"loss_{direction}"] == pytest.approx(true, rel=1e-5)
        assert got[f"rolled_{direction}"] == pytest.approx(rolled, rel=1e-5)
        assert got[f"anchor_gain_{direction}"] == pytest.approx(rolled - true, abs=1e-4)


def test_gain_is_the_token_weighted_mean_over_batches(tiny_models):
    """Two batches (each rolled within itself) give the token-weighted mean of their per-pair references."""
    lm, tokenizer = tiny_models["llama3"]
    model = LLM2Vec_q2d_d2q(lm, tokenizer)
    collate = TrainCollator.for_encoder(model, reconstruction="text")
    parts = [PAIRS[:2], [PAIRS[2], ("", "sort a list", "sorted(iterable) returns a new list")]]
    batches = [collate(examples(p)) for p in parts]
    got = anchor_gain(model, batches)
    refs = [reference(model, p, shift=1) for p in parts]
    for direction, targets in (("q2d", "positive_targets"), ("d2q", "query_targets")):
        tokens = [int(b[targets]["attention_mask"].sum()) for b in batches]
        for kind, index in (("loss", 0), ("rolled", 1)):
            mean = sum(r[direction][index] * t for r, t in zip(refs, tokens)) / sum(tokens)
            assert got[f"{kind}_{direction}"] == pytest.approx(mean, rel=1e-5)


def test_gain_is_zero_when_every_anchor_is_the_same(tiny_models):
    """Identical pairs have identical anchors: the rolled pass reads the same vector, so the gain is 0."""
    lm, tokenizer = tiny_models["qwen2"]
    model = LLM2Vec_q2d_d2q(lm, tokenizer)
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples([PAIRS[0]] * 4))
    got = anchor_gain(model, [batch])
    assert got["loss_d2q"] > 1.0  # an untrained model: the reconstruction is far from perfect ...
    assert got["anchor_gain_q2d"] == pytest.approx(0.0, abs=1e-6)  # ... but the anchor carries nothing here
    assert got["anchor_gain_d2q"] == pytest.approx(0.0, abs=1e-6)


def _memorising_pairs():
    """Four pairs whose targets share their first words, so that only the anchor tells them apart."""
    words = ["apple", "violet", "copper", "meadow"]
    return [("", f"item {w}", f"the answer is {w} {w}") for w in words]


def test_gain_grows_when_the_decoder_must_read_the_anchor():
    """Trained on four pairs whose targets differ only where the anchor can tell them apart, the decoder
    learns to read the anchor: the gain becomes clearly positive in both directions; the training loss is
    the package's Stage I loss."""
    torch.manual_seed(0)
    lm, tokenizer = build_tiny_model("llama3", seed=3, hidden_size=64)
    model = LLM2Vec_q2d_d2q(lm, tokenizer, alpha=0.5)
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples(_memorising_pairs()))
    before = anchor_gain(model, [batch])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = anchor_gain(model, [batch])
    assert model.training  # restored after the measurement
    for direction in ("q2d", "d2q"):
        assert abs(before[f"anchor_gain_{direction}"]) < 0.3
        assert after[f"anchor_gain_{direction}"] > 0.2, after


def test_a_batch_of_one_pair_is_refused(tiny_models):
    lm, tokenizer = tiny_models["llama3"]
    model = LLM2Vec_q2d_d2q(lm, tokenizer)
    batch = TrainCollator.for_encoder(model, reconstruction="text")([TrainExample("q", "d", None, "", "t")])
    with pytest.raises(ValueError, match="at least 2 pairs"):
        anchor_gain(model, [batch])


def reference_token_nll(model, source_item, target_item):
    """-log P(y_t | anchor of source, y_<t) per target token, from plain unpadded causal-LM forwards."""
    lm, tokenizer, spec = model.model, model.tokenizer, model.template
    src, tgt = template_encode(tokenizer, spec, [source_item, target_item], max_length=512)
    with torch.no_grad():
        anchor = lm.model(input_ids=torch.tensor([src.input_ids])).last_hidden_state[0, -1]
        y = list(tgt.input_ids[tgt.text_start : tgt.text_end])
        embeds = torch.cat([anchor[None], lm.get_input_embeddings()(torch.tensor(y))])
        logp = torch.log_softmax(lm(inputs_embeds=embeds[None]).logits[0].float(), -1)
    return [float(-logp[t, token]) for t, token in enumerate(y)]


def reference_cross(model, pairs):
    """``{direction: {(i, j): token NLLs of pair i's target read from pair j's anchor}}``, pair by pair."""
    n = len(pairs)
    out = {"q2d": {}, "d2q": {}}
    for i in range(n):
        for j in range(n):
            instruction_i, query_i, doc_i = pairs[i]
            instruction_j, query_j, doc_j = pairs[j]
            out["q2d"][i, j] = reference_token_nll(model, (instruction_j, query_j), ("", doc_i))
            out["d2q"][i, j] = reference_token_nll(model, ("", doc_j), (instruction_i, query_i))
    return out


FIVE_PAIRS = PAIRS + [
    ("Retrieve code", "sort a list", "sorted(iterable) returns a new list"),
    ("", "the tallest mountain", "Mount Everest is the highest mountain above sea level."),
]


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_first_tokens_gain_and_rank_accuracy_equal_a_per_pair_reference(tiny_models, family):
    """gain@k and the rank accuracy of a batch of 5 (rolled by 2; 4 rank candidates) against the same numbers
    computed from one unpadded causal-LM forward per (target, anchor) pair."""
    lm, tokenizer = tiny_models[family]
    model = LLM2Vec_q2d_d2q(lm, tokenizer)
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples(FIVE_PAIRS))
    got = anchor_gain(model, [batch], first_tokens=3, rank_candidates=4)
    ref = reference_cross(model, FIVE_PAIRS)
    n = len(FIVE_PAIRS)
    for d in ("q2d", "d2q"):
        c = ref[d]
        own = sum(sum(c[i, i][:3]) for i in range(n))
        rolled = sum(sum(c[i, (i + 2) % n][:3]) for i in range(n))
        count = sum(len(c[i, i][:3]) for i in range(n))
        assert got[f"anchor_gain_first3_{d}"] == pytest.approx((rolled - own) / count, abs=1e-4)
        hits = 0
        for i in range(n):
            totals = {j: sum(c[i, j]) for j in ((i + k) % n for k in range(4))}
            hits += totals[i] < min(v for j, v in totals.items() if j != i)
        assert got[f"rank_accuracy_{d}"] == pytest.approx(hits / n)
    assert got["rank_chance"] == pytest.approx(1 / 4)


def test_every_measure_is_at_chance_when_every_anchor_is_the_same(tiny_models):
    """Identical pairs: every anchor is the same vector, so each gain is 0 and the rank accuracy is exactly chance
    (each own anchor ties with every candidate), in the batch and within each source."""
    lm, tokenizer = tiny_models["qwen2"]
    model = LLM2Vec_q2d_d2q(lm, tokenizer)
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples([PAIRS[0]] * 6))
    got = anchor_gain(model, [batch], sources=[["a", "a", "a", "b", "b", "b"]], rank_candidates=4)
    for d in ("q2d", "d2q"):
        for key in (f"anchor_gain_{d}", f"anchor_gain_first4_{d}", f"anchor_gain_in_source_{d}"):
            assert got[key] == pytest.approx(0.0, abs=1e-6), key
        assert got[f"rank_accuracy_{d}"] == pytest.approx(1 / 4)
        assert got[f"rank_accuracy_in_source_{d}"] == pytest.approx(1 / 3)
    assert got["rank_chance"] == pytest.approx(1 / 4) and got["rank_chance_in_source"] == pytest.approx(1 / 3)


def _train(model, batch, steps=150):
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_rank_accuracy_and_first_tokens_gain_are_high_when_the_anchor_decides():
    """After the decoder learns four pairs that only the anchor tells apart, every own anchor ranks first and
    the gain over the first target tokens (where the pairs differ) exceeds the per-token gain."""
    torch.manual_seed(0)
    lm, tokenizer = build_tiny_model("llama3", seed=3, hidden_size=64)
    model = LLM2Vec_q2d_d2q(lm, tokenizer, alpha=0.5)
    pairs = [("", f"{w} item", f"{w} {w} is the answer") for w in ["apple", "violet", "copper", "meadow"]]
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples(pairs))
    before = anchor_gain(model, [batch])
    _train(model, batch)
    after = anchor_gain(model, [batch])
    for d in ("q2d", "d2q"):
        assert before[f"rank_accuracy_{d}"] < 1.0
        assert after[f"rank_accuracy_{d}"] == 1.0
        assert after[f"anchor_gain_first4_{d}"] > after[f"anchor_gain_{d}"] > 0.2


def test_within_a_source_the_measures_do_not_count_telling_sources_apart():
    """Two sources of two identical pairs each: trained, the anchors tell the sources apart (the batch-wide gain and
    rank accuracy are high) but nothing within a source (its gain is 0, its rank accuracy chance)."""
    torch.manual_seed(0)
    lm, tokenizer = build_tiny_model("llama3", seed=3, hidden_size=64)
    model = LLM2Vec_q2d_d2q(lm, tokenizer, alpha=0.5)
    pairs = [("", "apple item", "the answer is apple apple")] * 2 + [("", "violet item", "the answer is violet")] * 2
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples(pairs))
    _train(model, batch)
    got = anchor_gain(model, [batch], sources=[["a", "a", "b", "b"]])
    assert got["pairs_in_source"] == 4
    for d in ("q2d", "d2q"):
        assert got[f"anchor_gain_{d}"] > 0.2
        assert got[f"anchor_gain_in_source_{d}"] == pytest.approx(0.0, abs=1e-5)
        assert got[f"rank_accuracy_in_source_{d}"] == pytest.approx(0.5)
    # alone in its source, a pair is not measured within it
    single = anchor_gain(model, [batch], sources=[["a", "b", "c", "c"]])
    assert single["pairs_in_source"] == 2


# ---------------------------------------------------------------------------------------------- during a run


def test_hold_out_is_a_seeded_slice_never_trained_on():
    from llm2vec.dataset import TrainDataset, hold_out

    by_source = {
        s: [TrainExample(f"{s} q{i}", f"{s} d{i}", None, "", s) for i in range(n)] for s, n in (("a", 30), ("b", 13))
    }
    rest, held = hold_out(by_source, 0.25, seed=7)
    assert len(held) == round(0.25 * 43) and len({e.query for e in held}) == len(held)
    trained = {e.query for examples_ in rest.values() for e in examples_}
    assert trained.isdisjoint({e.query for e in held})
    assert trained | {e.query for e in held} == {e.query for ex in by_source.values() for e in ex}
    assert [e.query for e in hold_out(by_source, 0.25, seed=7)[1]] == [e.query for e in held]  # a resume: the same
    assert {e.query for e in hold_out(by_source, 0.25, seed=8)[1]} != {e.query for e in held}
    assert len(hold_out(by_source, 5, seed=7)[1]) == 5  # a count
    # the slice does not depend on the global batch (hence on the number of processes), and is never arranged
    for global_batch in (1, 4, 8):
        dataset = TrainDataset.from_sources(by_source, global_batch, seed=7, validation_size=0.25)
        assert [e.query for e in dataset.held_out] == [e.query for e in held]
        assert {e.query for e in dataset.examples}.isdisjoint({e.query for e in held})


def test_a_stage_I_run_logs_the_anchor_gain_of_its_validation_pairs(tmp_path):
    """validation_size + eval_steps: the run's log history holds, at every evaluation, the validation
    reconstruction loss and the anchor gain per direction; the last one equals the gain measured afterwards on the
    saved model over the same pairs (held out by the seed), itself tested against the per-pair reference above."""
    import json

    from _tiny_data import write_tiny_e5
    from test_stage_I import driver_args, run_stage_I

    from llm2vec.dataset import load_e5
    from llm2vec.testing import save_tiny_model

    model = save_tiny_model("llama3", tmp_path / "model")
    data = write_tiny_e5(tmp_path / "data")
    out = tmp_path / "run"
    argv = driver_args(model, data, out, max_steps=2, validation_size=6, eval_steps=1, per_device_eval_batch_size=3)
    run_stage_I(argv)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = [h for h in history if "eval_anchor_gain_d2q" in h]
    assert [h["step"] for h in evals] == [1, 2]
    for h in evals:
        assert h["eval_pairs"] == 6
        for d in ("q2d", "d2q"):
            assert h[f"eval_anchor_gain_{d}"] == pytest.approx(h[f"eval_rolled_{d}"] - h[f"eval_loss_{d}"], abs=1e-5)
        assert h["eval_loss"] == pytest.approx(0.2 * h["eval_loss_q2d"] + 0.8 * h["eval_loss_d2q"], rel=1e-5)
    held = load_e5(
        str(data), global_batch_size=4, seed=7, sources=["nq", "fever"], require_negative=False, validation_size=6
    ).held_out
    trained = LLM2Vec_q2d_d2q.load(str(out))
    collate = TrainCollator.for_encoder(trained, reconstruction="text")
    after = anchor_gain(trained, [collate(held[i : i + 3]) for i in (0, 3)])
    for d in ("q2d", "d2q"):
        assert evals[-1][f"eval_loss_{d}"] == pytest.approx(after[f"loss_{d}"], rel=1e-4)
        assert evals[-1][f"eval_anchor_gain_{d}"] == pytest.approx(after[f"anchor_gain_{d}"], abs=1e-4)


def test_evaluation_without_validation_pairs_is_refused(tmp_path):
    from test_stage_I import driver_args

    from llm2vec.arguments import ConfigError, parse_config

    (tmp_path / "m").mkdir()  # a model folder (the model is not read before this check)
    config = parse_config("I", driver_args(tmp_path / "m", tmp_path / "d", tmp_path / "o", eval_strategy="steps"))
    with pytest.raises(ConfigError, match="validation_file or validation_size"):
        config.validate()
    with pytest.raises(ConfigError, match="validation_size"):
        parse_config("I", driver_args(tmp_path / "m", tmp_path / "d", tmp_path / "o", validation_size=2.5))


def test_stop_decoder_gradient_trains_only_through_the_anchor(tiny_models):
    """With stop_decoder_gradient the Stage I gradient is that of a loss whose reconstruction pass runs a frozen copy
    of the model (the reference: another module, no weight shared), fed the live model's anchors."""
    import copy

    from llm2vec.loss.reconstruction import reconstruction_nll

    lm, tokenizer = tiny_models["mistral"]  # an LM head of its own (Qwen2.5's and Llama-3.2's are the embedding)
    assert not lm.config.tie_word_embeddings
    live = LLM2Vec_q2d_d2q(copy.deepcopy(lm), tokenizer, alpha=0.3, stop_decoder_gradient=True)
    batch = TrainCollator.for_encoder(live, reconstruction="text")(examples(PAIRS))
    live(**batch).loss.backward()

    reference = LLM2Vec_q2d_d2q(copy.deepcopy(lm), tokenizer)
    frozen = copy.deepcopy(lm).requires_grad_(False)
    e_q, e_d = reference.embed(batch["query"]), reference.embed(batch["positive"])
    loss = 0
    for weight, anchor, targets in ((0.3, e_q, batch["positive_targets"]), (0.7, e_d, batch["query_targets"])):
        nll = reconstruction_nll(frozen.model, frozen.lm_head, anchor, targets["input_ids"], targets["attention_mask"])
        loss = loss + weight * nll / targets["attention_mask"].sum()
    loss.backward()
    grads = dict(reference.named_parameters())
    changed = 0
    for name, p in live.named_parameters():
        expected = grads[name].grad
        if expected is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6, msg=name)
        changed += 1
    assert changed > 0
    # the LM head is used by the reconstruction pass only: with the option it gets no gradient, without it does
    assert dict(live.named_parameters())["model.lm_head.weight"].grad is None
    plain = LLM2Vec_q2d_d2q(copy.deepcopy(lm), tokenizer, alpha=0.3)
    plain(**batch).loss.backward()
    assert dict(plain.named_parameters())["model.lm_head.weight"].grad.abs().sum() > 0


def _by_hand(lm, anchor, prefix_ids, target_ids, dropped=()):
    """-sum log P(y_t | prefix, anchor, y_<t) of one pair from one unpadded forward in float64 logits; the target
    inputs at positions ``dropped`` are zero vectors."""
    embed = lm.get_input_embeddings()
    inputs = [embed(torch.tensor(prefix_ids, dtype=torch.long)), anchor[None]]
    targets = embed(torch.tensor(target_ids))
    for t in dropped:
        targets = targets.clone()
        targets[t] = 0
    hidden = lm.model(inputs_embeds=torch.cat(inputs + [targets])[None]).last_hidden_state[0]
    logp = torch.log_softmax(lm.lm_head(hidden).double(), -1)
    k = len(prefix_ids)
    return -sum(logp[k + t, y] for t, y in enumerate(target_ids))


@pytest.mark.parametrize("packed", [False, True])
def test_reconstruction_prefix_and_input_dropout_equal_a_per_pair_reference(tiny_models, packed):
    """The options of the sweep: tokens read before the anchor, and teacher-forced inputs zeroed in training mode
    (never in eval mode), against one unpadded forward per pair."""
    from llm2vec.loss.reconstruction import packed_reconstruction_nll, reconstruction_nll

    lm, tokenizer = tiny_models["llama3"]
    model = LLM2Vec_q2d_d2q(lm, tokenizer)
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples(PAIRS))
    prefix = torch.tensor(tokenizer("ab", add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        anchors = model.embed(batch["positive"])
        ids, mask = batch["query_targets"]["input_ids"], batch["query_targets"]["attention_mask"]
        for p in (0.0, 0.5):
            torch.manual_seed(11)
            if packed:
                (got,) = packed_reconstruction_nll(model.model.model, lm.lm_head, [(anchors, ids, mask)], 0, p, prefix)
            else:
                got = reconstruction_nll(model.model.model, lm.lm_head, anchors, ids, mask, 0, p, prefix)
            torch.manual_seed(11)
            keep = torch.rand(ids.shape) >= p if p else torch.ones(ids.shape, dtype=torch.bool)
            expected = 0.0
            for b in range(len(ids)):
                n = int(mask[b].sum())
                dropped = [t for t in range(n) if not keep[b, t]]
                expected += float(_by_hand(lm, anchors[b], prefix.tolist(), ids[b, :n].tolist(), dropped))
            assert float(got) == pytest.approx(expected, rel=1e-5)
            if p:
                assert not keep[mask.bool()].all()  # some inputs were dropped in this draw
    # the loss module drops only in training mode
    loss_fn = LLM2Vec_q2d_d2q(lm, tokenizer, reconstruction_input_dropout=0.5).loss_fn
    plain = LLM2Vec_q2d_d2q(lm, tokenizer).loss_fn
    args = (model.model.model, lm.lm_head, anchors, anchors, batch["query_targets"], batch["positive_targets"])
    with torch.no_grad():
        assert float(loss_fn.eval()(*args)[0]) == pytest.approx(float(plain.eval()(*args)[0]), rel=1e-6)
        assert float(loss_fn.train()(*args)[0]) != float(plain.train()(*args)[0])


def test_evaluations_reach_tensorboard_and_the_model_card(tmp_path):
    """With report_to tensorboard the Trainer's callback writes every evaluation; read back from the event file,
    the scalars are the log history's; the model card lists each evaluation."""
    import json

    from _tiny_data import write_tiny_e5
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_stage_I import driver_args, run_stage_I

    from llm2vec.testing import save_tiny_model

    model = save_tiny_model("llama3", tmp_path / "model")
    data = write_tiny_e5(tmp_path / "data")
    out = tmp_path / "run"
    argv = driver_args(
        model, data, out, max_steps=2, validation_size=6, eval_steps=1, per_device_eval_batch_size=3,
        report_to="tensorboard",
    )  # fmt: skip
    run_stage_I(argv)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = [h for h in history if "eval_anchor_gain_d2q" in h]
    (event_dir,) = {p.parent for p in out.rglob("events.out.tfevents.*")}  # the Trainer's: output_dir/runs/...
    events = EventAccumulator(str(event_dir))
    events.Reload()
    for name in ("anchor_gain_d2q", "loss_q2d", "rolled_d2q"):
        scalars = events.Scalars(f"eval/{name}")
        assert [s.step for s in scalars] == [h["step"] for h in evals]
        assert [s.value for s in scalars] == pytest.approx([h[f"eval_{name}"] for h in evals], rel=1e-6)
    card = (out / "README.md").read_text()
    assert "Validation (held-out pairs" in card
    assert "geometry_cosine" not in card and all("eval_geometry_cosine_query" in h for h in evals)  # log only
    for h in evals:
        assert f"| {h['step']} | " in card.split("Validation (held-out pairs")[1]


def test_paper_configs_hold_out_a_small_validation_set_and_evaluate_it():
    """Every main paper config (Stage I, Stage II, Baseline) evaluates held-out pairs: a slice of E5 far below 0.1 %
    of its ~1.5 M pairs (PAPER_NOTES), at an interval that leaves several evaluations before the paper's stop."""
    import json
    from pathlib import Path

    from llm2vec.arguments import parse_config

    root = Path(__file__).resolve().parents[1] / "train_configs"
    files = [(f, "I") for f in (root / "stage_I").glob("*.json")]
    files += [(f, "II") for sub in ("stage_II", "baseline") for f in (root / sub).glob("*.json")]
    assert len(files) == 25
    for path, stage in files:
        raw = json.loads(path.read_text())
        config = parse_config(stage, [str(path), "--use_cpu", "true"])
        assert config.data.validation_size >= 256 and config.data.validation_size <= 0.001 * 1.5e6, path.name
        assert str(config.training.eval_strategy.value) == "steps", path.name
        stop = raw["stop_after_n_steps"]
        assert stop // config.training.eval_steps >= 5, path.name
