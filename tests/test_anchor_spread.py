"""``experiments/demo/anchor_spread.py``: the anchor measures over held-out pairs, with a standard error by module."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo import anchor_spread  # noqa: E402


def _terms(modules: int, per_module: int, seed: int) -> tuple[list[dict], list[str]]:
    """Pairs whose gains share a module effect (strong within-module correlation) and vary in length."""
    rng = random.Random(seed)
    terms, groups = [], []
    for g in range(modules):
        effect = rng.gauss(0.05, 0.2)
        for _ in range(rng.randint(1, per_module)):
            tokens = rng.randint(5, 40)
            own = rng.uniform(2.0, 4.0) * tokens
            terms.append({"loss": own, "rolled": own + (effect + rng.gauss(0, 0.05)) * tokens, "tokens": tokens})
            groups.append(f"m{g}")
    return terms, groups


def _module_bootstrap(terms, groups, resamples: int, seed: int) -> float:
    """The reference: the SD of the gain over resamples of whole modules with replacement."""
    names = sorted(set(groups))
    y = np.array([sum(t["rolled"] - t["loss"] for t, g in zip(terms, groups) if g == n) for n in names])
    x = np.array([sum(t["tokens"] for t, g in zip(terms, groups) if g == n) for n in names])
    picks = np.random.default_rng(seed).integers(0, len(names), size=(resamples, len(names)))
    return float((y[picks].sum(1) / x[picks].sum(1)).std())


def test_the_module_clustered_error_agrees_with_a_bootstrap_over_modules():
    terms, groups = _terms(modules=60, per_module=6, seed=1)
    got = anchor_spread.clustered(terms, groups, ("rolled", "loss"), "tokens")
    gain = sum(t["rolled"] - t["loss"] for t in terms) / sum(t["tokens"] for t in terms)
    assert got["value"] == pytest.approx(gain, rel=1e-12) and got["modules"] == 60
    # the analytic error carries the small-sample factor C / (C - 1) that the plain bootstrap lacks
    reference = _module_bootstrap(terms, groups, 20000, seed=2) * math.sqrt(60 / 59)
    assert got["se"] == pytest.approx(reference, rel=0.08)


def test_copies_of_pairs_inside_their_module_do_not_shrink_the_error():
    """What treating pairs as independent gets wrong: four copies of every pair in its own module leave the
    clustered error exactly as it was, where an error over pairs would halve."""
    terms, groups = _terms(modules=30, per_module=4, seed=3)
    once = anchor_spread.clustered(terms, groups, ("rolled", "loss"), "tokens")
    four = anchor_spread.clustered(terms * 4, groups * 4, ("rolled", "loss"), "tokens")
    assert four["value"] == pytest.approx(once["value"], rel=1e-12)
    assert four["se"] == pytest.approx(once["se"], rel=1e-9)
    alone = anchor_spread.clustered(terms, [f"p{i}" for i in range(len(terms))], ("rolled", "loss"), "tokens")
    alone4 = anchor_spread.clustered(terms * 4, [f"p{i}" for i in range(4 * len(terms))], ("rolled", "loss"), "tokens")
    assert alone4["se"] == pytest.approx(alone["se"] / 2, rel=0.02)


def test_a_share_by_hand():
    """Rank accuracy as a mean of credits over 4 pairs in 2 modules: value 0.5; Y_g - R X_g = 0.5, -0.5; so
    Var = 2 / 1 x (0.25 + 0.25) / 16 and SE = sqrt(1 / 16) = 0.25."""
    terms = [{"hit": h} for h in (1.0, 0.5, 0.0, 0.5)]
    got = anchor_spread.clustered(terms, ["a", "a", "b", "b"], ("hit",), None)
    assert (got["value"], got["se"], got["modules"]) == (0.5, pytest.approx(0.25), 2)


def test_an_object_belongs_to_the_longest_module_that_names_it():
    modules = ["pkg", "pkg.sub", "pkg.subway", "other"]
    assert anchor_spread.module_of("pkg.sub.Class.method", modules) == "pkg.sub"
    assert anchor_spread.module_of("pkg.subway", modules) == "pkg.subway"
    assert anchor_spread.module_of("pkg.subtle.f", modules) == "pkg"
    assert anchor_spread.module_of("lonely.f", modules) == "lonely.f"


def _corpus(folder: Path, n: int) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    ids = [f"mod{i % 3}.f{i}" for i in range(n)]
    lines = {
        "corpus": [{"_id": ids[i], "text": f"{words[i % 8]} {words[(3 * i) % 8]} doc {i}"} for i in range(n)],
        "queries": [{"_id": f"q{i}", "text": f"what is {words[i % 8]} {i}"} for i in range(n)],
        "qrels": [{"query-id": f"q{i}", "corpus-id": ids[i], "score": 1} for i in range(n)],
    }
    (folder / "val").mkdir(parents=True)
    for name, rows in lines.items():
        (folder / "val" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "manifest.json").write_text(json.dumps({"val_modules": ["mod0", "mod1", "mod2"]}))
    return folder


def test_the_values_are_a_runs_evaluation_of_the_pairs_after_the_skipped_ones(tmp_path, capsys):
    """Pairs 4 to 12 of the validation choice (the first 4 skipped), measured in batches of 4: each value equals
    anchor_gain over the same batches (what a run's evaluation logs), on a model loaded on its own."""
    from demo.stages import validation_rows

    from llm2vec.anchor_gain import anchor_gain
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q
    from llm2vec.testing import save_tiny_model

    model_dir = save_tiny_model("smollm2", tmp_path / "model")
    data = _corpus(tmp_path / "corpus", 14)
    out = tmp_path / "spread.json"
    argv = ["--model", str(model_dir), "--data", str(data), "--skip", "4", "--pairs", "8", "--batch", "4"]
    assert anchor_spread.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())[0]
    assert (result["pairs"], result["batches"], result["skip"]) == (8, 2, 4)

    pairs = anchor_spread.validation_pairs(data, 8, skip=4)
    chosen = validation_rows(data / "val", 12)
    assert [p["query"] for p in pairs] == [r["query"] for r in chosen[4:]]
    assert [p["module"] for p in pairs] == [f"mod{int(r['positive'].split()[-1]) % 3}" for r in chosen[4:]]
    model = LLM2Vec_q2d_d2q.load(str(model_dir), max_length=64, alpha=0.2)
    collate = TrainCollator.for_encoder(model, reconstruction="text")
    examples = [TrainExample(p["query"], p["positive"], None, p["instruction"], "val") for p in pairs]
    run = anchor_gain(model, [collate(examples[a : a + 4]) for a in (0, 4)])
    for key in ("loss_d2q", "anchor_gain_q2d", "anchor_gain_first4_d2q", "rank_accuracy_q2d", "rank_chance"):
        assert result["spread"][key]["value"] == pytest.approx(run[key], abs=1e-6), key
        assert result["spread"][key]["modules"] == 3
    assert "| anchor_gain |" in capsys.readouterr().out


def test_more_pairs_than_the_split_holds_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="3 validation pairs after --skip 2, --pairs asks for 5"):
        anchor_spread.validation_pairs(_corpus(tmp_path, 5), 5, skip=2)
