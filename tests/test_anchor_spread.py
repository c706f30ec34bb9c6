"""``experiments/demo/anchor_spread.py``: the anchor measures batch by batch, with their standard error."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo import anchor_spread  # noqa: E402


def test_the_standard_error_is_the_sample_sd_over_the_root_of_the_batch_count():
    got = anchor_spread.spread([{"g": 1.0}, {"g": 3.0}, {"g": 2.0}, {"g": 6.0}])
    # by hand: mean 3; deviations -2, 0, -1, 3 -> sum of squares 14, sample variance 14 / 3
    assert got["g"]["mean"] == pytest.approx(3.0)
    assert got["g"]["se"] == pytest.approx(math.sqrt(14 / 3) / 2)


def _corpus(folder: Path, n: int) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    lines = {
        "corpus": [{"_id": f"d{i}", "text": f"{words[i % 8]} {words[(3 * i) % 8]} doc {i}"} for i in range(n)],
        "queries": [{"_id": f"q{i}", "text": f"what is {words[i % 8]} {i}"} for i in range(n)],
        "qrels": [{"query-id": f"q{i}", "corpus-id": f"d{i}", "score": 1} for i in range(n)],
    }
    (folder / "val").mkdir(parents=True)
    for name, rows in lines.items():
        (folder / "val" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_each_batch_is_measured_as_a_run_alone_would_measure_it(tmp_path, capsys):
    """The per-batch values are those of anchor_gain on each batch of the chosen pairs, in their order, measured
    on a model loaded on its own; the table and the JSON file carry them."""
    from llm2vec.anchor_gain import anchor_gain
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q
    from llm2vec.testing import save_tiny_model

    model_dir = save_tiny_model("smollm2", tmp_path / "model")
    data = _corpus(tmp_path / "corpus", 12)
    out = tmp_path / "spread.json"
    argv = ["--model", str(model_dir), "--data", str(data), "--pairs", "8", "--batch", "4", "--out", str(out)]
    assert anchor_spread.main(argv) == 0
    result = json.loads(out.read_text())[0]
    assert (result["pairs"], result["batches"]) == (8, 2)

    pairs = anchor_spread.validation_pairs(data, 8)
    model = LLM2Vec_q2d_d2q.load(str(model_dir), max_length=64, alpha=0.2)
    collate = TrainCollator.for_encoder(model, reconstruction="text")
    examples = [TrainExample(p["query"], p["positive"], None, p["instruction"], "val") for p in pairs]
    alone = [anchor_gain(model, [collate(examples[a : a + 4])]) for a in (0, 4)]
    for key in ("loss_d2q", "anchor_gain_q2d", "anchor_gain_first4_d2q", "rank_accuracy_q2d"):
        assert result["spread"][key]["mean"] == pytest.approx((alone[0][key] + alone[1][key]) / 2, abs=1e-6)
        assert result["spread"][key]["se"] == pytest.approx(abs(alone[0][key] - alone[1][key]) / 2, abs=1e-6)
    assert "| anchor_gain |" in capsys.readouterr().out


def test_more_pairs_than_the_split_holds_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="3 validation pairs, --pairs asks for 5"):
        anchor_spread.validation_pairs(_corpus(tmp_path, 3), 5)
