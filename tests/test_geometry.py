"""The geometry of anchor embeddings (llm2vec.geometry) against a plain float64 numpy reference, on constructed
cases (equal vectors at chance, a shared offset that centring removes), and as Stage I and Stage II evaluations
log it from the embeddings they already compute."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_stage_I import PAIRS, examples

from llm2vec.anchor_gain import anchor_gain
from llm2vec.collator import TrainCollator
from llm2vec.geometry import anchor_geometry, query_terms
from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-9


def reference(queries, documents, relevant, scale, per_query=None):
    """Every measure written from its definition, one pair or one query at a time, in numpy float64; each query's
    terms go into ``per_query[suffix][measure]`` when it is given."""
    out = {}
    q_raw, d_raw = np.asarray(queries, np.float64), np.asarray(documents, np.float64)
    variants = {"": (q_raw, d_raw), "_centred": (q_raw - q_raw.mean(0), d_raw - d_raw.mean(0))}
    for suffix, (q, d) in variants.items():
        for side, x in (("query", q), ("document", d)):
            u = [row / np.linalg.norm(row) for row in x]
            n = len(u)
            cosines = [float(u[i] @ u[j]) for i in range(n) for j in range(n) if i != j]
            power = np.linalg.svd(np.stack(u), compute_uv=False) ** 2
            p = power / power.sum()
            out[f"geometry_cosine_{side}{suffix}"] = sum(cosines) / len(cosines)
            out[f"geometry_top_share_{side}{suffix}"] = p[0]
            out[f"geometry_effective_rank_{side}{suffix}"] = math.exp(-sum(x * math.log(x) for x in p if x > 0))
        terms = {"infonce": [], "accuracy_at_1": [], "mrr": []}
        for i, row in enumerate(q):
            z = [scale * float(row @ doc) / (np.linalg.norm(row) * np.linalg.norm(doc)) for doc in d]
            top = max(z)
            log_total = top + math.log(sum(math.exp(v - top) for v in z))
            terms["infonce"].append(sum(log_total - z[r] for r in relevant[i]) / len(relevant[i]))
            best = max(z[r] for r in relevant[i])
            others = [v for j, v in enumerate(z) if j not in relevant[i]]
            above = sum(v > best + TOL for v in others)
            ties = sum(abs(v - best) <= TOL for v in others)
            terms["accuracy_at_1"].append(1 / (ties + 1) if above == 0 else 0.0)
            terms["mrr"].append(sum(1 / (above + 1 + k) for k in range(ties + 1)) / (ties + 1))
        out.update({f"geometry_{k}{suffix}": sum(v) / len(v) for k, v in terms.items()})
        if per_query is not None:
            per_query[suffix] = terms
    out["geometry_infonce_chance"] = math.log(len(d_raw))
    out["geometry_accuracy_at_1_chance"] = sum(len(r) / len(d_raw) for r in relevant) / len(relevant)
    return out


def test_geometry_equals_a_float64_numpy_reference():
    """Embeddings sharing an offset, queries with one or two relevant documents, and a non-relevant copy of a
    relevant document (an exact tie) cover every branch of the definitions."""
    g = torch.Generator().manual_seed(0)
    offset = 3.0 * torch.randn(16, generator=g)
    documents = offset + torch.randn(20, 16, generator=g)
    documents[19] = documents[4]  # document 19 ties with query 4's relevant document
    relevant = [[i] for i in range(12)] + [[12, 13], [14, 2]]
    queries = torch.stack([documents[r[0]] for r in relevant]) + 1.5 * torch.randn(14, 16, generator=g)
    queries[4] = 2.0 * documents[4]  # its own document and the copy score the maximum, equally
    got = anchor_geometry(queries, documents, relevant, scale=20.0)
    expected = reference(queries.numpy(), documents.numpy(), relevant, 20.0)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    terms = query_terms(queries, documents, relevant, 20.0)
    assert float(terms["accuracy_at_1"][4]) == pytest.approx(0.5) and float(terms["mrr"][4]) == pytest.approx(0.75)
    assert 0.1 < got["geometry_accuracy_at_1"] < 0.9 and got["geometry_cosine_document"] > 0.5  # hits and misses


def test_equal_embeddings_score_chance():
    """All anchors the same vector: one direction, every score equal, each query at chance."""
    n = 7
    documents = torch.ones(n, 4)
    got = anchor_geometry(torch.ones(3, 4), documents, [[0], [3], [6]])
    assert got["geometry_cosine_document"] == pytest.approx(1.0)
    assert got["geometry_top_share_query"] == pytest.approx(1.0)
    assert got["geometry_effective_rank_document"] == pytest.approx(1.0)
    assert got["geometry_infonce"] == pytest.approx(math.log(n)) == got["geometry_infonce_chance"]
    assert got["geometry_accuracy_at_1"] == pytest.approx(1 / n) == got["geometry_accuracy_at_1_chance"]
    assert got["geometry_mrr"] == pytest.approx(sum(1 / k for k in range(1, n + 1)) / n)


def test_centring_recovers_what_a_shared_offset_hides():
    """Queries and documents that share a large offset each: their raw cosines are near 1 and retrieve little;
    without the offsets, each query finds its document."""
    g = torch.Generator().manual_seed(1)
    signal = torch.randn(30, 32, generator=g)
    documents = 40.0 * torch.randn(32, generator=g) + signal
    queries = 40.0 * torch.randn(32, generator=g) + signal + 0.1 * torch.randn(30, 32, generator=g)
    got = anchor_geometry(queries, documents, [[i] for i in range(30)])
    assert got["geometry_cosine_query"] > 0.99 and got["geometry_cosine_document"] > 0.99
    assert got["geometry_top_share_document"] > 0.99 and got["geometry_top_share_document_centred"] < 0.2
    assert got["geometry_accuracy_at_1"] < 0.5 and got["geometry_accuracy_at_1_centred"] == 1.0
    assert got["geometry_infonce_centred"] < got["geometry_infonce"]


def test_a_stage_I_evaluation_gives_the_geometry_of_the_anchors_it_reads(tiny_models):
    """anchor_gain's geometry is that of each text's anchor embedded alone, queries against the pairs' positives,
    over two batches."""
    lm, tokenizer = tiny_models["llama3"]
    model = LLM2Vec_q2d_d2q(lm, tokenizer)
    pairs = PAIRS + [("", "sort a list", "sorted(iterable) returns a new list")]
    collate = TrainCollator.for_encoder(model, reconstruction="text")
    got = anchor_gain(model, [collate(examples(pairs[:2])), collate(examples(pairs[2:]))])
    with torch.no_grad():
        alone = [collate(examples([p])) for p in pairs]
        q = torch.cat([model.embed(b["query"]) for b in alone])
        d = torch.cat([model.embed(b["positive"]) for b in alone])
    expected = reference(q.numpy(), d.numpy(), [[i] for i in range(len(pairs))], 20.0)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_a_stage_II_validation_gives_the_geometry_of_its_queries_and_distinct_positives(llama_checkpoint):
    """7 validation triples share 5 positives: the geometry is of the 7 queries against the 5 distinct positives,
    at the run's loss scale."""
    from _stage_II_dist_worker import build_encoder
    from _validation_worker import measure, validation_triples

    encoder = build_encoder(str(llama_checkpoint))
    got = measure(encoder)
    triples = validation_triples()
    collate = TrainCollator.for_encoder(encoder, with_negative=True)
    texts = list(dict.fromkeys(t.positive for t in triples))
    with torch.no_grad():
        q = torch.cat([encoder.embed(collate([t])["query"]) for t in triples])
        firsts = [next(t for t in triples if t.positive == x) for x in texts]
        d = torch.cat([encoder.embed(collate([t])["positive"]) for t in firsts])
    relevant = [[texts.index(t.positive)] for t in triples]
    expected = reference(q.numpy(), d.numpy(), relevant, encoder.loss_fn.scale)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_the_command_measures_saved_models_on_a_beir_folder_with_errors_by_module(tmp_path, capsys):
    """experiments/research/anchor_geometry.py on a tiny model and a folder whose documents lie in 3 modules: the
    measures of its texts each embedded alone, and standard errors over the modules of the queries' documents."""
    import json
    import sys

    from llm2vec import LLM2Vec
    from llm2vec.testing import save_tiny_model

    sys.path.insert(0, str(ROOT / "experiments"))
    from research import anchor_geometry

    model = save_tiny_model("smollm2", tmp_path / "model")
    folder = tmp_path / "corpus" / "eval"
    folder.mkdir(parents=True)
    docs = {f"m{k % 3}.f{k}": f"the fox number {k} jumps over {k % 4} dogs" for k in range(9)}
    queries = {f"q{k}": f"which fox jumps {k}" for k in range(7)}
    lines = {
        "corpus.jsonl": [{"_id": d, "title": "", "text": t} for d, t in docs.items()],
        "queries.jsonl": [{"_id": q, "text": t} for q, t in queries.items()],
        "qrels.jsonl": [{"query-id": f"q{k}", "corpus-id": f"m{k % 3}.f{k}", "score": 1} for k in range(7)],
    }
    for name, rows in lines.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder.parent / "manifest.json").write_text(json.dumps({"eval_modules": ["m0", "m1", "m2"]}))
    out = tmp_path / "geometry.json"
    argv = ["--model", str(model), "--folder", str(folder), "--instruction", "find", "--out", str(out)]
    assert anchor_geometry.main(argv) == 0
    assert "errors clustered by module (3 clusters)" in capsys.readouterr().out
    got = json.loads(out.read_text())[0]

    encoder = LLM2Vec.from_pretrained(str(model), device="cpu")
    with torch.no_grad():
        alone = lambda item: encoder.embed(encoder.tokenize([item]))[0]  # noqa: E731
        q = torch.stack([alone(["find", t]) for t in queries.values()])
        d = torch.stack([alone(["", t]) for t in docs.values()])
    terms = {}
    expected = reference(q.numpy(), d.numpy(), [[k] for k in range(7)], 20.0, terms)
    for key, value in expected.items():
        assert got["values"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    modules = [f"m{k % 3}" for k in range(7)]
    for suffix, measures in terms.items():
        for name, values in measures.items():
            mean = sum(values) / len(values)
            sums = {m: sum(v - mean for v, g in zip(values, modules) if g == m) for m in set(modules)}
            se = math.sqrt(3 / 2 * sum(s * s for s in sums.values())) / len(values)
            assert got["errors"][f"geometry_{name}{suffix}"] == pytest.approx(se, rel=1e-4, abs=1e-6), name


def test_the_command_refuses_a_missing_model_or_folder_in_one_line(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    from research import anchor_geometry

    with pytest.raises(SystemExit, match=r"^error: --folder .*nowhere: .*lacks"):
        anchor_geometry.main(["--model", str(tmp_path), "--folder", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match=r"^error: --model .*absent: no folder .*absent; give a saved model"):
        anchor_geometry.measure(str(tmp_path / "absent"), None, [], "", 64, 8, 20.0)
