"""Retrieval scores on BEIR-layout folders (llm2vec/beir.py, llm2vec/retrieval.py), during training too.

- The scores equal mteb's own scoring (pytrec_eval and mteb's MRR) of the same score matrix, ties included, and a
  hand computation; the embeddings equal ``LLM2Vec.encode``'s.
- A training run of either stage logs each folder's nDCG@10, MRR@10 and Recall@100 and their means at every
  evaluation, equal to ``experiments/mteb_eval_custom.py --local_retrieval_dir`` on the saved model; the numbers reach
  TensorBoard's event files and W&B's offline run; two processes (DDP, FSDP2) log the numbers of one.
- A bad folder or config stops the run at start-up with one line naming the file and line.
"""

import json
import math
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _drivers import launcher, subprocess_env, tiny_run_flags
from _tiny_data import write_tiny_beir, write_tiny_e5

from llm2vec import LLM2Vec
from llm2vec.beir import read_beir_folder
from llm2vec.retrieval import Judgments, RetrievalEvaluation, cosine_metrics, embed_items, ranking_metrics
from llm2vec.testing import save_tiny_model

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


# ---------------------------------------------------------------------------------------------- training runs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrieval")
    model = save_tiny_model("llama3", root / "model")
    data = write_tiny_e5(root / "data")
    folders = [
        write_tiny_beir(root / "NanoA", seed=1),
        write_tiny_beir(root / "NanoB", seed=2, queries=5, documents=130),
    ]
    return model, data, folders


def run_flags(setup, out, stage, **fields):
    model, data, folders = setup
    fields = {
        "max_steps": 2,
        "learning_rate": 1e-2 if stage == "I" else 1e-3,
        "save_strategy": "no",
        "eval_steps": 1,
        "eval_on_start": "true",
        "per_device_eval_batch_size": 5,
        "retrieval_eval_instruction": INSTRUCTION,
        **fields,
    }
    return tiny_run_flags(model, data, out, **fields) + ["--retrieval_eval_dirs", *map(str, folders)]


def retrieval_log(out) -> list[dict]:
    history = json.loads((Path(out) / "trainer_state.json").read_text())["log_history"]
    return [h for h in history if "eval_beir_mean_ndcg_at_10" in h]


def mteb_scores(setup, out, stage, folder, tmp_path) -> dict:
    """``experiments/mteb_eval_custom.py --local_retrieval_dir folder`` on the run's saved model (mteb's scoring)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import mteb_eval_custom

    model = setup[0]
    base, adapter = (str(out), None) if stage == "I" else (str(model), str(out))
    argv = ["--base_model_name_or_path", base, *(["--peft_model_name_or_path", adapter] if adapter else [])]
    argv += ["--local_retrieval_dir", str(folder), "--local_task_name", folder.name, "--local_instruction", INSTRUCTION]
    argv += ["--output_dir", str(tmp_path / "mteb"), "--device", "cpu", "--batch_size", "5"]
    assert mteb_eval_custom.main(argv) == 0
    return json.loads(next((tmp_path / "mteb").rglob(f"{folder.name}.json")).read_text())["scores"]["test"][0]


@pytest.mark.parametrize("stage", ["I", "II"])
def test_a_run_logs_each_folders_scores_equal_to_mteb_eval_custom_on_the_saved_model(setup, tmp_path, stage):
    """At step 0 and every eval_steps each folder's nDCG@10, MRR@10 and Recall@100 and their means are logged; the
    last evaluation's (the final weights) equal mteb_eval_custom.py's on the saved model and a folder; the model card
    shows them apart from the held-out pairs."""
    from llm2vec.training import run

    out = tmp_path / "run"
    run(stage, run_flags(setup, out, stage))
    log = retrieval_log(out)
    assert [h["step"] for h in log] == [0, 1, 2]
    names = [f.name for f in setup[2]]
    for h in log:
        for m in METRICS:
            assert h[f"eval_beir_mean_{m}"] == pytest.approx(sum(h[f"eval_{n}_{m}"] for n in names) / 2, abs=2e-6)
    assert log[0]["eval_NanoA_ndcg_at_10"] != log[-1]["eval_NanoA_ndcg_at_10"]  # the scores follow the training
    folder = setup[2][1]  # NanoB: 130 documents, so Recall@100 leaves some out; graded, up to 3 relevant a query
    theirs = mteb_scores(setup, out, stage, folder, tmp_path)
    for m in METRICS:
        assert log[-1][f"eval_{folder.name}_{m}"] == pytest.approx(theirs[m], abs=2e-5), m
    card = (out / "README.md").read_text()
    assert "Retrieval on the BEIR folders" in card and "| NanoB | " in card
    assert "NanoA_ndcg_at_10" not in card  # not a column of the held-out pairs' table


def test_the_scores_reach_tensorboard(setup, tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from llm2vec.training import run

    out = tmp_path / "run"
    run("I", run_flags(setup, out, "I", report_to="tensorboard"))
    log = retrieval_log(out)
    (event_dir,) = {p.parent for p in out.rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(event_dir))
    events.Reload()
    for name in ("NanoA_ndcg_at_10", "NanoB_mrr_at_10", "NanoB_recall_at_100", "beir_mean_ndcg_at_10"):
        scalars = events.Scalars(f"eval/{name}")
        assert [s.step for s in scalars] == [h["step"] for h in log]
        assert [s.value for s in scalars] == pytest.approx([h[f"eval_{name}"] for h in log], rel=1e-6)


def wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B ``.wandb`` run file: a 7-byte header (``:W&B``, magic, version), then LevelDB's log
    format (32 KiB blocks; each chunk a 7-byte header: CRC-32, length, type FULL/FIRST/MIDDLE/LAST)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left in this block for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: a record is complete
            records.append(pending)
            pending = b""
    return records


def wandb_history(wandb_dir: Path, wait_s: float = 120) -> list[dict]:
    """The history rows of the one offline run under ``wandb_dir``, read back from its ``.wandb`` file once the file
    holds the run's ``exit`` record (W&B's service may still be writing it when ``wandb.finish`` returns)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = wandb_dir.rglob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        records = []
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def test_the_scores_reach_weights_and_biases_offline(setup, tmp_path, monkeypatch):
    """A Stage II run with report_to wandb in offline mode: the run file holds every evaluation's scores."""
    wandb = pytest.importorskip("wandb", reason="wandb is not installed")
    from llm2vec.training import run

    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WANDB_PROJECT", "retrieval-test")
    out = tmp_path / "run"
    run("II", run_flags(setup, out, "II", report_to="wandb"))
    wandb.finish()  # the run file complete, the W&B service done with this run
    log = retrieval_log(out)
    rows = [r for r in wandb_history(tmp_path) if "eval/beir_mean_ndcg_at_10" in r]
    assert [r["train/global_step"] for r in rows] == [h["step"] for h in log]
    for row, h in zip(rows, log):
        for name in ("NanoA_ndcg_at_10", "NanoA_mrr_at_10", "NanoB_recall_at_100", "beir_mean_mrr_at_10"):
            assert row[f"eval/{name}"] == pytest.approx(h[f"eval_{name}"], rel=1e-6), name


@pytest.mark.parametrize(("stage", "sharding"), [("II", "ddp"), ("I", "fsdp2")])
def test_two_processes_log_the_scores_of_one(setup, tmp_path, stage, sharding):
    """torchrun over two gloo processes (DDP, or FSDP2 full shard): every rank embeds its share of the batches
    (NanoA's 12 queries make 3 batches of 5: one rank embeds a batch again and drops it) and the numbers at step 0
    equal one process's; the run ends (no rank is left waiting)."""
    extra = {}
    if sharding == "fsdp2":
        config = tmp_path / "fsdp.json"
        config.write_text(json.dumps({"version": 2, "reshard_after_forward": True, "cpu_ram_efficient_loading": False,
                                      "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "state_dict_type": "FULL_STATE_DICT"}))  # fmt: skip
        extra = {"fsdp": "true", "fsdp_config": str(config), "optim": "sgd"}
    logs = {}
    for nproc in (1, 2):
        out = tmp_path / f"run{nproc}"
        sharded = extra if nproc == 2 else {}  # one process: the plain model (FSDP needs several)
        argv = run_flags(setup, out, stage, max_steps=1, per_device_train_batch_size=4 // nproc, **sharded)
        script = ROOT / "experiments" / f"run_stage_{stage}.py"
        result = subprocess.run(
            launcher(nproc) + [str(script), *argv], env=subprocess_env(), cwd=ROOT, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        logs[nproc] = retrieval_log(out)[0]
    assert logs[1]["step"] == logs[2]["step"] == 0
    for key, value in logs[1].items():
        if key.startswith("eval_"):
            assert logs[2][key] == pytest.approx(value, abs=1e-5), key


# ---------------------------------------------------------------------------------------------- refused at start-up


def _break(folder: Path, how: str) -> str:
    """Damage ``folder`` as ``how`` says; returns the pattern of the error line."""
    if how == "missing file":
        (folder / "qrels.jsonl").unlink()
        return r"lacks \['qrels.jsonl'\]"
    if how == "unknown document":
        with open(folder / "qrels.jsonl", "a") as f:
            f.write(json.dumps({"query-id": "q0", "corpus-id": "nowhere", "score": 1}) + "\n")
        lines = (folder / "qrels.jsonl").read_text().count("\n")
        return rf"qrels.jsonl:{lines}: corpus-id 'nowhere' is not in corpus.jsonl"
    if how == "huge grade":  # a JSON integer no float holds; the first line's grade becomes 10**400
        first, *rest = (folder / "qrels.jsonl").read_text().splitlines(keepends=True)
        row = json.loads(first)
        huge = json.dumps({**row, "score": 0}).replace('"score": 0', '"score": 1' + "0" * 400)
        (folder / "qrels.jsonl").write_text(huge + "\n" + "".join(rest))
        return r"qrels.jsonl:1: score 10000000000000000000\.\.\. is above 2147483647"
    with open(folder / "queries.jsonl", "a") as f:
        f.write(json.dumps({"_id": "lonely", "text": "a query with no qrels line"}) + "\n")
    lines = (folder / "queries.jsonl").read_text().count("\n")
    return rf"queries.jsonl:{lines}: query 'lonely' has no line in qrels.jsonl"


@pytest.mark.parametrize("how", ["missing file", "unknown document", "huge grade", "query without a relevant document"])
def test_a_bad_folder_is_refused_at_start_up_in_one_line(setup, tmp_path, capsys, how):
    from llm2vec.training import main

    model, data, _ = setup
    bad = write_tiny_beir(tmp_path / "NanoBad")
    pattern = _break(bad, how)
    argv = tiny_run_flags(model, data, tmp_path / "run", max_steps=1, retrieval_eval_instruction="")
    assert main("II", argv + ["--retrieval_eval_dirs", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: retrieval_eval_dirs: ")
    assert re.search(pattern, err), err
    assert not (tmp_path / "run" / "trainer_state.json").exists()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "has no query instruction: set retrieval_eval_instruction"),
        (
            {"retrieval_eval_instruction": "x", "retrieval_eval_instructions": '{"NanoC": "x"}'},
            "names ['NanoC'], which retrieval_eval_dirs does not hold",
        ),
        ({"retrieval_eval_instruction": "x", "eval_strategy": "no"}, "eval_strategy 'no' never evaluates"),
    ],
)
def test_a_config_that_cannot_name_or_evaluate_its_folders_is_refused(setup, tmp_path, capsys, fields, message):
    from llm2vec.training import main

    model, data, folders = setup
    argv = tiny_run_flags(model, data, tmp_path / "run", max_steps=1, **fields)
    assert main("II", argv + ["--retrieval_eval_dirs", *map(str, folders)]) == 2
    assert message in capsys.readouterr().err


def test_two_folders_of_one_name_are_refused(setup, tmp_path, capsys):
    from llm2vec.training import main

    model, data, folders = setup
    twin = write_tiny_beir(tmp_path / "elsewhere" / folders[0].name)
    argv = tiny_run_flags(model, data, tmp_path / "run", max_steps=1, retrieval_eval_instruction="")
    assert main("II", argv + ["--retrieval_eval_dirs", str(folders[0]), str(twin)]) == 2
    assert "share the name 'NanoA', which names their log keys" in capsys.readouterr().err


def test_a_resume_refuses_a_retrieval_folder_changed_since_the_run_started(setup, tmp_path, capsys):
    """A folder's scores are logged under its name; a resume whose folder of that name holds other files than the run
    recorded at its start is refused in one line naming the folder and the way out, accept_changed_inputs or not. The
    same files at another path resume."""
    from llm2vec.training import main

    model, data, _ = setup
    folder = write_tiny_beir(tmp_path / "NanoR", seed=3)
    out = tmp_path / "run"

    def argv(steps, where, *more):
        fields = {"max_steps": steps, "eval_steps": 1, "save_steps": 1, "retrieval_eval_instruction": ""}
        return tiny_run_flags(model, data, out, **fields) + ["--retrieval_eval_dirs", str(where), *more]

    assert main("I", argv(1, folder)) == 0
    capsys.readouterr()
    with open(folder / "corpus.jsonl", "a") as f:
        f.write(json.dumps({"_id": "new", "title": "", "text": "another document"}) + "\n")
    resume = ["--resume_from_checkpoint", "true", "--accept_changed_inputs", "true"]
    assert main("I", argv(2, folder, *resume)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"retrieval folder {folder.resolve()} (NanoR) is not the one this run evaluated" in err, err
    assert "file corpus.jsonl: its SHA-256 differs" in err, err
    assert "Restore the folder, or start anew with --overwrite_output_dir true or another output_dir" in err, err
    assert not (out / "checkpoint-2").exists()
    copy = write_tiny_beir(tmp_path / "elsewhere" / "NanoR", seed=3)  # the files the run started with
    assert main("I", argv(2, copy, "--resume_from_checkpoint", "true")) == 0
    assert (out / "checkpoint-2").is_dir()


def test_the_start_up_says_what_each_evaluation_embeds_and_holds_and_a_long_one_shows_progress(
    setup, tmp_path, caplog, monkeypatch
):
    """A line per folder names its queries and documents, the texts one evaluation embeds and the memory of its
    document embeddings (documents x hidden size x 4 bytes); an embedding of many batches logs its progress."""
    import logging

    import llm2vec.retrieval
    from llm2vec.training import run

    model, data, folders = setup
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    monkeypatch.setattr(llm2vec.retrieval, "PROGRESS_BATCHES", 20)  # NanoB's 130 documents: 26 batches of 5
    with caplog.at_level(logging.INFO):
        run("I", run_flags(setup, tmp_path / "run", "I", max_steps=1, eval_on_start="false"))
    for folder, (queries, documents) in zip(folders, [(12, 40), (5, 130)]):
        held = documents * hidden * 4
        line = (
            f"{folder.name}: {queries} queries, {documents} documents; each evaluation embeds {queries + documents} "
            f"texts, document embeddings {documents} x {hidden} x 4 = {held:,} bytes"
        )
        assert line in caplog.text, caplog.text
    assert "embedding 130 documents of NanoB: batch 3 of 26" in caplog.text, caplog.text
    assert "documents of NanoA: batch" not in caplog.text  # 8 batches: no progress lines
