"""Retrieval scores on BEIR-layout folders (llm2vec/beir.py, llm2vec/retrieval.py).

- The scores equal mteb's own scoring (pytrec_eval and mteb's MRR) of the same score matrix, ties included, and a
  hand computation; the embeddings equal ``LLM2Vec.encode``'s.
"""

import math
import random
from pathlib import Path

import pytest
import torch

from llm2vec import LLM2Vec
from llm2vec.beir import read_beir_folder
from llm2vec.retrieval import Judgments, RetrievalEvaluation, cosine_metrics, embed_items, ranking_metrics
from llm2vec.testing import write_tiny_beir

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = "Given a query, retrieve the passages that answer it"
METRICS = ("ndcg_at_10", "mrr_at_10", "recall_at_100")


# ---------------------------------------------------------------------------------------------- the scores


def test_scores_equal_mteb_scoring_of_the_same_score_matrix_ties_included():
    """Per query, nDCG@10 and Recall@1/10/100 equal pytrec_eval's (through mteb) and MRR@10 mteb's own, on graded
    qrels with several relevant documents and scores rounded so that many are equal (ties broken by document id)."""
    from mteb._evaluators.retrieval_metrics import calculate_retrieval_scores, mrr

    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    nq, nd = 30, 160
    doc_ids = [f"d{i}" for i in range(nd)]
    relevant = []
    for _ in range(nq):
        docs = rng.sample(range(nd), rng.randint(1, 6))
        grades = {d: rng.choice([0, 1, 2, 3]) for d in docs}
        grades[docs[0]] = rng.choice([1, 2, 3])
        relevant.append(grades)
    scores = (torch.randn(nq, nd, generator=g) * 3).round() / 3  # about 20 distinct values a row: ties everywhere
    for q, grades in enumerate(relevant):
        for d in grades:
            scores[q, d] += rng.choice([0.0, 1 / 3, 2.0])
    ours = ranking_metrics(scores, Judgments.build(relevant, doc_ids))
    qrels = {f"q{q}": {doc_ids[d]: g for d, g in r.items()} for q, r in enumerate(relevant)}
    results = {f"q{q}": {doc_ids[d]: float(scores[q, d]) for d in range(nd)} for q in range(nq)}
    theirs = calculate_retrieval_scores(results, qrels, [1, 10, 100]).all_scores
    their_mrr = mrr(qrels, results, [10])["MRR@10"]
    for q in range(nq):
        assert float(ours["ndcg_at_10"][q]) == pytest.approx(theirs[f"q{q}"]["ndcg_cut_10"], abs=1e-12), q
        for k in (1, 10, 100):
            assert float(ours[f"recall_at_{k}"][q]) == pytest.approx(theirs[f"q{q}"][f"recall_{k}"], abs=1e-12), q
        assert float(ours["mrr_at_10"][q]) == pytest.approx(their_mrr[q], abs=1e-12), q
    assert 0 < float(ours["mrr_at_10"].mean()) < 1 and 0 < float(ours["recall_at_100"].mean()) < 1


def test_mrr_at_10_and_recall_at_100_by_hand():
    """150 documents scored in decreasing order of their index, except query 2's, which are all equal (ranked by
    decreasing id: "d99", "d98", ..., "d9", "d149", ...)."""
    nd = 150
    doc_ids = [f"d{i}" for i in range(nd)]
    scores = -torch.arange(nd, dtype=torch.float32).repeat(3, 1)  # document i at rank i + 1
    scores[2] = 0.5
    relevant = [
        {4: 1, 120: 2},  # ranks 5 and 121
        {12: 1, 30: 0},  # rank 13: outside the top 10; the 0 grade counts for nothing
        {99: 1, 0: 3},  # "d99" ranks 1, "d0" ranks 90 + 50 + 1... beyond 100
    ]
    got = ranking_metrics(scores, Judgments.build(relevant, doc_ids))
    by_id = sorted(doc_ids, reverse=True)
    assert by_id[0] == "d99" and by_id.index("d0") + 1 > 100
    expected = {
        "mrr_at_10": [1 / 5, 0.0, 1.0],
        "recall_at_100": [1 / 2, 1.0, 1 / 2],
        "recall_at_10": [1 / 2, 0.0, 1 / 2],
        "ndcg_at_10": [
            (1 / math.log2(6)) / (2 / math.log2(2) + 1 / math.log2(3)),
            0.0,
            (1 / math.log2(2)) / (3 / math.log2(2) + 1 / math.log2(3)),
        ],
    }
    for name, values in expected.items():
        assert got[name].tolist() == pytest.approx(values, abs=1e-12), name


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return LLM2Vec.from_pretrained(str(tiny_checkpoints["llama3"]), device="cpu")


def test_embeddings_equal_encode_and_the_cosine_scores_a_per_query_loop(llama, tmp_path):
    folder = read_beir_folder(write_tiny_beir(tmp_path / "beir", queries=7, documents=30))
    items = [(INSTRUCTION, t) for t in folder.queries.values()] + [("", folder.document_text(i)) for i in folder.corpus]
    got = embed_items(llama, llama, items, 4, torch.device("cpu"))
    assert torch.equal(got, llama.encode([list(i) for i in items], batch_size=4, convert_to_tensor=True))
    q, d = got[: len(folder.queries)], got[len(folder.queries) :]
    judgments = Judgments.of_folder(folder)
    loop = [
        ranking_metrics(torch.cosine_similarity(q[i : i + 1, None], d[None], dim=-1), judgments, i) for i in range(7)
    ]
    for name, value in cosine_metrics(q, d, judgments, rows=3).items():
        assert value == pytest.approx(sum(float(m[name]) for m in loop) / 7, abs=1e-9), name


def test_an_evaluation_restores_the_train_mode_and_leaves_no_gradient(llama, tmp_path):
    evaluation = RetrievalEvaluation.read([(write_tiny_beir(tmp_path / "A"), INSTRUCTION)])
    llama.train()
    seen = []
    handle = llama.model.register_forward_hook(lambda m, a, o: seen.append((m.training, torch.is_grad_enabled())))
    try:
        scores = evaluation(llama, llama, 8, "cpu")
    finally:
        handle.remove()
        llama.eval()
    assert seen and set(seen) == {(False, False)}
    assert sorted(scores) == sorted([f"A_{m}" for m in METRICS] + [f"beir_mean_{m}" for m in METRICS])
