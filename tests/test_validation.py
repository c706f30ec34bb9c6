"""Stage II's validation measures (llm2vec.validation) against per-query loops over texts run alone, with two
processes against one, and logged by a Stage II run."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from _stage_II_dist_worker import build_encoder
from _validation_worker import measure, run_validation_rank, validation_triples

from llm2vec.validation import retrieval_metrics


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return str(tiny_checkpoints["llama3"])


def reference_metrics(queries, documents, relevant):
    """One query at a time: sort the documents by cosine similarity (float64), find the relevant one's rank."""
    out = {"ndcg_at_10": 0.0, "recall_at_1": 0.0, "recall_at_10": 0.0, "mrr_at_10": 0.0}
    for q, r in zip(queries.double(), relevant):
        sims = [float(F.cosine_similarity(q, d.double(), dim=0)) for d in documents]
        rank = 1 + sum(s > sims[r] for s in sims)
        out["ndcg_at_10"] += 1 / math.log2(rank + 1) if rank <= 10 else 0.0
        out["recall_at_1"] += rank == 1
        out["recall_at_10"] += rank <= 10
        out["mrr_at_10"] += 1 / rank if rank <= 10 else 0.0
    return {k: v / len(queries) for k, v in out.items()}


def test_retrieval_metrics_equal_a_per_query_loop():
    g = torch.Generator().manual_seed(0)
    documents = torch.randn(30, 8, generator=g)
    relevant = torch.randint(0, 30, (25,), generator=g)
    queries = documents[relevant] + 1.2 * torch.randn(25, 8, generator=g)  # some relevant documents rank low
    got = retrieval_metrics(queries, documents, relevant)
    expected = reference_metrics(queries, documents, relevant.tolist())
    assert 0 < got["recall_at_1"] < got["recall_at_10"] < 1  # the case covers hits, misses and ranks > 10
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, abs=1e-9), k


def test_validation_loss_and_retrieval_equal_texts_run_alone(checkpoint):
    """The loss is InfoNCE (float64, one query at a time) over consecutive batches of 3 triples of embeddings of
    each text run alone; retrieval is over the distinct positives (7 triples share 5)."""
    encoder = build_encoder(checkpoint, lora_dropout=0.1)  # dropout must be off during the measurement
    encoder.train()
    got = measure(encoder, batch_size=2, contrastive_batch=3)
    assert encoder.training
    encoder.eval()
    triples = validation_triples()
    from llm2vec.collator import TrainCollator

    collate = TrainCollator.for_encoder(encoder, with_negative=True)

    def alone(side, t):  # the text exactly as the collator renders it, run alone through the model
        batch = collate([t])[side]
        with torch.no_grad():
            return encoder.embed(batch)[0].double()

    e = {side: torch.stack([alone(side, t) for t in triples]) for side in ("query", "positive", "negative")}
    losses = []
    for start in range(0, len(triples), 3):
        rows = range(start, min(len(triples), start + 3))
        candidates = [e["positive"][j] for j in rows] + [e["negative"][j] for j in rows]
        for k, i in enumerate(rows):
            sims = torch.stack(
                [encoder.loss_fn.scale * F.cosine_similarity(e["query"][i], c, dim=0) for c in candidates]
            )
            losses.append(float(torch.logsumexp(sims, 0) - sims[k]))
    assert got["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    texts = list(dict.fromkeys(t.positive for t in triples))
    documents = torch.stack([e["positive"][[t.positive for t in triples].index(x)] for x in texts])
    relevant = [texts.index(t.positive) for t in triples]
    expected = reference_metrics(e["query"], documents, relevant)
    assert got["documents"] == 5 and got["queries"] == 7
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, abs=1e-9), k


def test_two_processes_give_the_one_process_numbers(checkpoint, tmp_path):
    """Each of two gloo processes embeds its shard (4 and 3 triples, the same number of forward passes) of the
    DDP-wrapped model; the gathered numbers equal one process's."""
    import torch.multiprocessing as mp

    mp.spawn(run_validation_rank, args=(2, str(tmp_path / "init"), checkpoint, str(tmp_path)), nprocs=2, join=True)
    single = measure(build_encoder(checkpoint))
    for rank in range(2):
        got = json.loads((tmp_path / f"validation{rank}.json").read_text())
        assert got.keys() == single.keys()
        for k, v in single.items():
            assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-7), (rank, k)


def test_a_stage_II_run_logs_its_validation_measures(tmp_path):
    from _tiny_data import write_tiny_e5

    from llm2vec.testing import save_tiny_model
    from llm2vec.training import run

    model = save_tiny_model("llama3", tmp_path / "model")
    data = write_tiny_e5(tmp_path / "data", n=24)
    flags = {
        "model_name_or_path": model,
        "output_dir": tmp_path / "run",
        "dataset_file_path": data,
        "e5_sources": '["nq","fever"]',
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "learning_rate": "1e-3",
        "use_cpu": "true",
        "save_strategy": "no",
        "logging_steps": 1,
        "report_to": "none",
        "validation_size": 6,
        "eval_steps": 1,
        "per_device_eval_batch_size": 4,
    }
    run("II", [x for k, v in flags.items() for x in (f"--{k}", str(v))])
    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    evals = [h for h in history if "eval_ndcg_at_10" in h]
    assert [h["step"] for h in evals] == [1, 2]
    for h in evals:
        assert h["eval_queries"] == 6 and 0 < h["eval_loss"] < 10
        assert 0 <= h["eval_recall_at_1"] <= h["eval_recall_at_10"] <= 1
