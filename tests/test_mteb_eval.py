"""The mteb 2.x evaluation path: wrapper, instruction routing, result cache, replicas, benchmark tasks,
local retrieval task, and the command line (``experiments/mteb_eval_custom.py``).

Everything runs offline on CPU with a tiny random Llama-3-family checkpoint and mteb's own in-memory
mock tasks (``mteb.mocks``), or a local BEIR-style folder written to ``tmp_path``.
"""

import json
import shutil
from pathlib import Path

import mteb_eval_custom
import numpy as np
import pytest
import torch
from _drivers import DOCUMENTS, eval_argv, one_line, write_beir
from mteb.mocks import MockClassificationTask, MockRetrievalTask, MockSTSTask

from llm2vec import LLM2Vec
from llm2vec.evaluation.benchmark import BenchmarkError, UnknownTaskError, load_benchmark, mteb_tasks
from llm2vec.evaluation.local_task import local_retrieval_task
from llm2vec.evaluation.mteb_wrapper import (
    InstructionsFileError,
    LLM2VecMTEBEncoder,
    MissingInstructionError,
    evaluate,
    load_instructions,
)
from llm2vec.evaluation.replicas import encode_on_replicas, resolve_devices

main = mteb_eval_custom.main
INSTRUCTIONS = {
    "MockRetrievalTask": "Given a test query, retrieve the matching sentence",
    "MockSTSTask": "Retrieve semantically similar text",
    "MockClassificationTask": "Classify the sentence",
}


class Spy:
    """Wraps ``LLM2Vec.encode`` of one model instance and records the items of every call."""

    def __init__(self, model: LLM2Vec, monkeypatch):
        self.calls: list[list[list[str]]] = []
        original = model.encode

        def encode(sentences, *args, **kwargs):
            self.calls.append([list(x) for x in sentences])
            return original(sentences, *args, **kwargs)

        monkeypatch.setattr(model, "encode", encode)

    def items(self) -> list[tuple[str, str]]:
        return [tuple(x) for call in self.calls for x in call]


@pytest.fixture
def encoder(llama_checkpoint):
    return LLM2VecMTEBEncoder.from_pretrained(
        llama_checkpoint, instructions=dict(INSTRUCTIONS), devices="cpu", batch_size=4
    )


# ---------------------------------------------------------------------------------------- mock tasks


def test_mock_tasks_write_results_and_cache_is_reused(encoder, tmp_path, monkeypatch):
    spy = Spy(encoder.model, monkeypatch)
    tasks = [MockRetrievalTask(), MockSTSTask(), MockClassificationTask()]
    res = evaluate(encoder, tasks, tmp_path, show_progress_bar=False, raise_error=True)
    assert sorted(r.task_name for r in res.task_results) == sorted(t.metadata.name for t in tasks)
    folder = encoder.results_folder(tmp_path)
    meta = encoder.mteb_model_meta
    assert folder == tmp_path / "results" / meta.model_name_as_path() / meta.revision
    for t in tasks:
        saved = json.loads((folder / f"{t.metadata.name}.json").read_text())
        assert saved["task_name"] == t.metadata.name
    meta = json.loads((folder / "model_meta.json").read_text())
    assert meta["loader_kwargs"]["pooling_mode"] == "eos_token" and meta["embed_dim"] == 32
    first_calls = len(spy.calls)
    assert first_calls > 0

    # same model, same folder: everything is loaded from the cache, nothing is encoded
    again = evaluate(
        encoder,
        [MockRetrievalTask(), MockSTSTask(), MockClassificationTask()],
        tmp_path,
        show_progress_bar=False,
        raise_error=True,
    )
    assert len(spy.calls) == first_calls
    score = {r.task_name: r.get_score() for r in res.task_results}
    assert {r.task_name: r.get_score() for r in again.task_results} == pytest.approx(score, abs=1e-6)

    # overwrite recomputes (and gives the same scores: the encoder is deterministic)
    evaluate(encoder, [MockSTSTask()], tmp_path, overwrite=True, show_progress_bar=False, raise_error=True)
    assert len(spy.calls) == first_calls + 2  # both sides of the STS pairs


def test_settings_change_the_revision_folder(llama_checkpoint):
    a = LLM2VecMTEBEncoder.from_pretrained(llama_checkpoint, instructions=INSTRUCTIONS, devices="cpu")
    b = LLM2VecMTEBEncoder.from_pretrained(llama_checkpoint, instructions=INSTRUCTIONS, devices="cpu", max_length=64)
    c = LLM2VecMTEBEncoder.from_pretrained(llama_checkpoint, instructions=INSTRUCTIONS, devices="cpu")
    assert a.mteb_model_meta.revision == c.mteb_model_meta.revision != b.mteb_model_meta.revision
    d = LLM2VecMTEBEncoder.from_pretrained(
        llama_checkpoint, instructions=INSTRUCTIONS, devices="cpu", doc_max_length=400
    )
    assert d.model.doc_max_length == 400 and d.mteb_model_meta.loader_kwargs["doc_max_length"] == 400
    assert d.mteb_model_meta.revision not in (a.mteb_model_meta.revision, b.mteb_model_meta.revision)
    assert a.mteb_model_meta.name.endswith("/llama3")


# ---------------------------------------------------------------------------------------- routing


def test_query_gets_instruction_document_gets_none(encoder, tmp_path, monkeypatch):
    spy = Spy(encoder.model, monkeypatch)
    task = MockRetrievalTask()
    task.load_data()
    data = task.dataset["default"]["test"]
    evaluate(encoder, [task], tmp_path, show_progress_bar=False, raise_error=True)
    instruction = INSTRUCTIONS["MockRetrievalTask"]
    expected_queries = {(instruction, q["text"]) for q in data["queries"]}
    # mteb 2.x joins a corpus entry's title and text with one space
    expected_docs = {("", f"{d['title']} {d['text']}") for d in data["corpus"]}
    seen = set(spy.items())
    assert seen == expected_queries | expected_docs
    assert all(len(call) > 0 and len({item[0] for item in call}) == 1 for call in spy.calls)


def test_both_sides_of_sts_get_the_instruction(encoder, tmp_path, monkeypatch):
    spy = Spy(encoder.model, monkeypatch)
    task = MockSTSTask()
    task.load_data()
    evaluate(encoder, [task], tmp_path, show_progress_bar=False, raise_error=True)
    instruction = INSTRUCTIONS["MockSTSTask"]
    test = task.dataset["test"]
    assert len(spy.calls) == 2
    assert spy.calls[0] == [[instruction, s] for s in test["sentence1"]]
    assert spy.calls[1] == [[instruction, s] for s in test["sentence2"]]


def test_wrapper_output_is_llm2vec_encode_of_the_pairs(encoder):
    from mteb.types import PromptType

    texts = ["Paris is the capital of France.", "The quick brown fox.", "Numbers 0123"]
    loader = [{"text": texts[:2]}, {"text": texts[2:]}]  # mteb passes batches with a "text" field
    meta = MockSTSTask().metadata
    got = encoder.encode(loader, task_metadata=meta, hf_split="test", hf_subset="default", prompt_type=None)
    want = encoder.model.encode([[INSTRUCTIONS["MockSTSTask"], t] for t in texts], show_progress_bar=False)
    assert got.dtype == np.float32 and got.shape == (3, 32)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)
    # the instruction changes the embedding; a document (no instruction) equals the bare text
    doc = encoder.encode(
        loader, task_metadata=meta, hf_split="test", hf_subset="default", prompt_type=PromptType.document
    )
    np.testing.assert_allclose(doc, encoder.model.encode(texts, show_progress_bar=False), rtol=0, atol=0)
    assert not np.allclose(doc, got)


def test_missing_instruction_is_a_clear_error_or_an_explicit_fallback(llama_checkpoint, tmp_path, caplog):
    fp = tmp_path / "instr.json"
    fp.write_text(json.dumps({"SomethingElse": "x"}))
    strict = LLM2VecMTEBEncoder.from_pretrained(llama_checkpoint, instructions=str(fp), devices="cpu")
    meta = MockSTSTask().metadata
    with pytest.raises(MissingInstructionError) as err:
        strict.encode([{"text": ["a"]}], task_metadata=meta, hf_split="test", hf_subset="default")
    assert "MockSTSTask" in str(err.value) and str(fp) in str(err.value) and "instructions={" in str(err.value)

    lenient = LLM2VecMTEBEncoder.from_pretrained(
        llama_checkpoint, instructions=str(fp), devices="cpu", allow_missing_instructions=True
    )
    with caplog.at_level("WARNING"):
        out = lenient.encode([{"text": ["a"]}], task_metadata=meta, hf_split="test", hf_subset="default")
    np.testing.assert_allclose(out, lenient.model.encode(["a"], show_progress_bar=False), rtol=0, atol=0)
    assert any("MockSTSTask" in r.getMessage() for r in caplog.records)


def test_several_replicas_give_the_same_embeddings_in_input_order(llama_checkpoint):
    single = LLM2VecMTEBEncoder.from_pretrained(llama_checkpoint, instructions=INSTRUCTIONS, devices="cpu")
    multi = LLM2VecMTEBEncoder.from_pretrained(llama_checkpoint, instructions=INSTRUCTIONS, devices=["cpu", "cpu"])
    multi.chunk_size = 3
    assert len(multi.replicas) == 2 and multi.replicas[0] is not multi.replicas[1]
    items = [["Classify the sentence" if i % 3 else "", "word " * (1 + (7 * i) % 11) + str(i)] for i in range(23)]
    a = single.encode_items(items, batch_size=2, show_progress_bar=False)
    b = multi.encode_items(items, batch_size=2, show_progress_bar=False)
    assert b.dtype == np.float32 and b.shape == a.shape
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


class FakeReplica:
    """Stands in for an LLM2Vec replica: the embedding of an item is ``[len(text), replica id]``."""

    def __init__(self, ident: int, fail_on: str | None = None):
        self.ident, self.fail_on, self.device, self.chunks = ident, fail_on, torch.device("cpu"), []

    def encode(self, items, batch_size, show_progress_bar, convert_to_numpy):
        self.chunks.append(len(items))
        if any(text == self.fail_on for _, text in items):
            raise RuntimeError(f"replica {self.ident} failed")
        return np.array([[len(text), self.ident] for _, text in items], dtype=np.float64)


def test_encode_on_replicas_keeps_input_order_and_shares_the_work():
    items = [["", "x" * n] for n in (5, 1, 9, 3, 7, 2, 8, 4, 6, 10, 11)]
    replicas = [FakeReplica(0), FakeReplica(1)]
    out = encode_on_replicas(replicas, items, batch_size=1, chunk_size=2, show_progress_bar=False)
    assert out.dtype == np.float32 and out.shape == (11, 2)
    assert out[:, 0].tolist() == [len(text) for _, text in items]  # rows in input order
    assert sorted(n for r in replicas for n in r.chunks) == [1, 2, 2, 2, 2, 2]  # 11 items in chunks of 2
    assert set(out[:, 1].tolist()) <= {0.0, 1.0}


def test_encode_on_replicas_raises_a_worker_error():
    items = [["", "x" * n] for n in range(1, 9)]
    with pytest.raises(RuntimeError, match="replica 1 failed"):
        encode_on_replicas([FakeReplica(1, fail_on="xxxx")], items, batch_size=2, show_progress_bar=False)


def test_resolve_devices():
    assert resolve_devices("cpu") == [torch.device("cpu")]
    assert resolve_devices(["cpu", "cuda:1"]) == [torch.device("cpu"), torch.device("cuda:1")]
    expected = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    assert resolve_devices("auto") == resolve_devices(None) == expected
    with pytest.raises(ValueError, match="empty"):
        resolve_devices([])


# ---------------------------------------------------------------------------------------- local task


def write_local_task(folder: Path, texts: list[str], qrels: dict[str, str]) -> None:
    """Documents d0..dn with ``texts``; each query text equals the text of the document it is paired with."""
    corpus, queries = [(f"d{i}", t) for i, t in enumerate(texts)], [(q, texts[int(d[1:])]) for q, d in qrels.items()]
    write_beir(folder, corpus, queries, [(q, d, 1) for q, d in qrels.items()])


# queries in an order unrelated to the corpus order
QRELS = {"qa": "d3", "qb": "d0", "qc": "d5", "qd": "d1"}


def cli_argv(model, out, *extra, data=None, instruction=""):
    return eval_argv(model, data, out, "--model_name", "tiny/llama3", *extra, instruction=instruction)


def test_local_retrieval_task_scores_ndcg_one_for_identical_texts(encoder, tmp_path):
    data = tmp_path / "eval"
    write_local_task(data, DOCUMENTS, QRELS)
    task = local_retrieval_task(data, name="StdlibDocRetrieval", instruction="")
    encoder.add_instruction(task.metadata.name, task.instruction)
    res = evaluate(encoder, [task], tmp_path / "out", show_progress_bar=False, raise_error=True)
    # each query is the exact text of its relevant document and gets no instruction ("" here), so its
    # nearest document by cosine is that document: nDCG@10 = 1 for any encoder
    assert res.task_results[0].get_score() == pytest.approx(1.0)
    assert (encoder.results_folder(tmp_path / "out") / "StdlibDocRetrieval.json").is_file()

    # control: the same texts with wrong qrels score below 1, so the check above can fail
    wrong = tmp_path / "wrong"
    write_local_task(wrong, DOCUMENTS, QRELS)
    with open(wrong / "qrels.jsonl", "w") as f:
        for qid, did in QRELS.items():
            f.write(
                json.dumps({"query-id": qid, "corpus-id": f"d{(int(did[1:]) + 1) % len(DOCUMENTS)}", "score": 1}) + "\n"
            )
    task = local_retrieval_task(wrong, name="WrongQrels", instruction="")
    encoder.add_instruction("WrongQrels", "")
    res = evaluate(encoder, [task], tmp_path / "out", show_progress_bar=False, raise_error=True)
    assert res.task_results[0].get_score() < 0.9


def test_a_local_tasks_own_instruction_reaches_its_queries(encoder, tmp_path, monkeypatch):
    """A local task's instruction is used with no add_instruction and no entry in the mapping: its queries
    get it, its documents none; a task with no instruction anywhere fails with a message that says what to pass."""
    data = tmp_path / "eval"
    write_local_task(data, DOCUMENTS, QRELS)
    instruction = "Given a sentence, retrieve the same sentence"
    task = local_retrieval_task(data, name="OwnInstructionTask", instruction=instruction)
    assert task.metadata.name not in encoder.instructions
    spy = Spy(encoder.model, monkeypatch)
    evaluate(encoder, [task], tmp_path / "out", show_progress_bar=False, raise_error=True)
    by_instruction = {}
    for given, text in spy.items():
        by_instruction.setdefault(given, []).append(text)
    assert sorted(by_instruction) == ["", instruction]
    assert sorted(by_instruction[instruction]) == sorted(DOCUMENTS[int(d[1:])] for d in QRELS.values())  # the queries
    assert sorted(by_instruction[""]) == sorted(DOCUMENTS)  # the corpus

    bare = local_retrieval_task(data, name="NoInstructionTask")
    with pytest.raises(MissingInstructionError) as err:
        evaluate(encoder, [bare], tmp_path / "out", show_progress_bar=False, raise_error=True)
    message = str(err.value)
    assert "NoInstructionTask" in message and "instructions={'NoInstructionTask'" in message
    assert "instruction=..." in message and "allow_missing_instructions" in message


def test_local_retrieval_task_rejects_bad_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="qrels.jsonl"):
        (tmp_path / "corpus.jsonl").write_text('{"_id": "d0", "text": "x"}\n')
        (tmp_path / "queries.jsonl").write_text('{"_id": "q0", "text": "x"}\n')
        local_retrieval_task(tmp_path)
    (tmp_path / "qrels.jsonl").write_text('{"query-id": "q0", "corpus-id": "d9", "score": 1}\n')
    with pytest.raises(ValueError, match="d9"):
        local_retrieval_task(tmp_path)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "corpus.jsonl",
            '{"_id": "d0", "text": "x"}\n\n{"_id": "d1"}\n',
            r"corpus.jsonl:3: missing field\(s\) \['text'\]",
        ),
        ("queries.jsonl", '{"_id": "q0", "text": "x"}\n{not json\n', r"queries.jsonl:2: invalid JSON"),
        ("queries.jsonl", '["q0", "x"]\n', r"queries.jsonl:1: expected a JSON object"),
        (
            "qrels.jsonl",
            '{"query-id": "q0", "corpus-id": "d0", "score": 1}\n{"query-id": "q7", "corpus-id": "d0", "score": 1}\n',
            r"qrels.jsonl:2: query-id 'q7' is not in queries.jsonl",
        ),
        ("qrels.jsonl", '{"query-id": "q0", "corpus-id": "d0", "score": "high"}\n', r"qrels.jsonl:1: score 'high'"),
        ("corpus.jsonl", "\n", r"corpus.jsonl: no records"),
    ],
)
def test_local_retrieval_task_errors_name_file_and_line(tmp_path, name, content, message):
    write_local_task(tmp_path, ["x"], {"q0": "d0"})
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        local_retrieval_task(tmp_path)


def test_local_retrieval_task_reads_the_folder_and_hashes_its_files(tmp_path):
    write_local_task(tmp_path, DOCUMENTS, QRELS)
    with open(tmp_path / "queries.jsonl", "a") as f:
        f.write(json.dumps({"_id": "unjudged", "text": "no qrels line"}) + "\n")
    task = local_retrieval_task(tmp_path, name="Mine", instruction="Find it")
    task.load_data()
    split = task.dataset["default"]["test"]
    assert split["corpus"]["id"] == [f"d{i}" for i in range(len(DOCUMENTS))]
    assert sorted(split["queries"]["id"]) == sorted(QRELS)  # the unjudged query is left out
    assert split["relevant_docs"] == {q: {d: 1} for q, d in QRELS.items()}
    assert task.metadata.name == "Mine" and task.instruction == "Find it"
    revision = task.metadata.dataset["revision"]
    assert len(revision) == 12
    (tmp_path / "qrels.jsonl").write_text(json.dumps({"query-id": "qa", "corpus-id": "d0", "score": 1}) + "\n")
    assert local_retrieval_task(tmp_path).metadata.dataset["revision"] != revision  # the data changed


# ---------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--task_name", "NoSuchTaskXYZ"], "--task_name 'NoSuchTaskXYZ'"),
        (["--task_set", "mteb99"], "--task_set 'mteb99'"),
        (
            ["--task_name", "STSBenchmark", "--task_to_instructions_fp", "/nonexistent/instr.json"],
            "/nonexistent/instr.json",
        ),
        (["--local_retrieval_dir", "/nonexistent/beir"], "--local_retrieval_dir"),
        (["--task_name", "STSBenchmark", "--tasks_fp", "/nonexistent/tasks.json"], "--tasks_fp"),
        (["--task_name", "STSBenchmark", "--device", "gpu:0"], "--device 'gpu:0'"),
        (["--task_name", "STSBenchmark", "--batch_size", "0"], "--batch_size"),
        (["--task_name", "STSBenchmark", "--doc_max_length", "0"], "--doc_max_length"),
        ([], "no task"),
    ],
)
def test_cli_bad_input_is_a_one_line_error(extra, expected, llama_checkpoint, tmp_path, capsys):
    rc = main(["--base_model_name_or_path", llama_checkpoint, "--output_dir", str(tmp_path), *extra])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "error" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "results").exists()


def test_cli_unloadable_model_is_a_one_line_error(llama_checkpoint, tmp_path, capsys):
    data = tmp_path / "eval"
    write_local_task(data, DOCUMENTS, QRELS)
    shutil.copytree(llama_checkpoint, tmp_path / "no-model")
    (tmp_path / "no-model" / "model.safetensors").unlink()  # a model folder without its weights
    rc = main(
        [
            "--base_model_name_or_path",
            str(tmp_path / "no-model"),
            "--local_retrieval_dir",
            str(data),
            "--local_instruction",
            "",
            "--output_dir",
            str(tmp_path / "out"),
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "cannot load the model" in err and "no-model" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("model", ["export/nope", "./export/nope", "{tmp}/export/nope"])
def test_cli_missing_model_folder_is_named_missing_not_a_hub_failure(model, tmp_path, capsys, monkeypatch):
    """A model written as a local path (``./``, absolute, or ``namespace/name`` where ``namespace`` is a folder here
    and no hub model of that id is cached) that is no folder: one line naming it as missing, not the hub."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "export").mkdir()
    model = model.format(tmp=tmp_path)
    rc = main(["--base_model_name_or_path", model, "--task_name", "SciFact", "--output_dir", str(tmp_path / "out")])
    err = one_line(capsys.readouterr().err)
    assert rc == 2 and f"error: model {model}: no such folder" in err, err
    assert "huggingface.co" not in err and "connect" not in err


@pytest.mark.parametrize("holds", [[], ["notes.txt"], ["adapter_config.json"]])
def test_cli_a_folder_that_holds_no_model_is_one_line_naming_its_missing_config(holds, tmp_path, capsys):
    """An empty folder (or one with other files, or an adapter given as the base) as the model: one line naming the
    missing ``config.json``, before any tokenizer or weights load."""
    model = tmp_path / "model"
    model.mkdir()
    for name in holds:
        (model / name).write_text("{}")
    rc = main(["--base_model_name_or_path", str(model), "--task_name", "SciFact", "--output_dir", str(tmp_path / "o")])
    err = one_line(capsys.readouterr().err)
    assert rc == 2 and f"error: model {model}: a folder without config.json" in err, err


def test_cli_task_in_the_tasks_file_that_mteb_lacks_names_the_file(llama_checkpoint, tmp_path, capsys):
    tasks = json.loads(mteb_eval_custom.DEFAULT_TASKS_FILE.read_text())
    tasks["tasks"]["NoSuchTaskXYZ"] = dict(tasks["tasks"]["STSBenchmark"])
    fp = tmp_path / "tasks.json"
    fp.write_text(json.dumps(tasks))
    rc = main(
        [
            "--base_model_name_or_path",
            llama_checkpoint,
            "--tasks_fp",
            str(fp),
            "--task_set",
            "mteb56",
            "--output_dir",
            str(tmp_path),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"--tasks_fp {fp}" in err and "'NoSuchTaskXYZ' is not an mteb" in err


def test_cli_missing_instruction_names_the_task_and_file(llama_checkpoint, tmp_path, capsys):
    fp = tmp_path / "instr.json"
    fp.write_text(json.dumps({"STSBenchmark": "x"}))
    rc = main(
        [
            "--base_model_name_or_path",
            llama_checkpoint,
            "--task_name",
            "STSBenchmark,SICK-R",
            "--task_to_instructions_fp",
            str(fp),
            "--output_dir",
            str(tmp_path),
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "SICK-R" in err and str(fp) in err and "STSBenchmark'" not in err


def test_cli_task_sets_resolve_to_the_paper_tasks():
    benchmark = load_benchmark(mteb_eval_custom.DEFAULT_TASKS_FILE)
    assert benchmark.name == "mteb56" and len(benchmark.tasks) == 56 and len(benchmark.subsets["15"]) == 15
    names = benchmark.expand(t.name for t in benchmark.tasks)
    assert len(names) == 56 - 1 + 12  # CQADupstackRetrieval -> its 12 sub-forums
    assert "CQADupstackRetrieval" not in names and "CQADupstackTexRetrieval" in names
    instructions = load_instructions(mteb_eval_custom.DEFAULT_INSTRUCTIONS_FILE)
    assert not [n for n in names if n not in instructions]
    sts17 = mteb_tasks(["STS17"], benchmark)[0]
    assert list(sts17.hf_subsets) == ["en-en"] and list(sts17.eval_splits) == ["test"]
    assert list(mteb_tasks(["MSMARCO"], benchmark)[0].eval_splits) == ["dev"]
    # a sub-forum takes its parent's split; a task the benchmark does not list keeps mteb's own
    assert list(mteb_tasks(["CQADupstackTexRetrieval"], benchmark)[0].eval_splits) == ["test"]
    unlisted = mteb_tasks(["STS17"])[0]
    assert len(unlisted.hf_subsets) > 1
    with pytest.raises(UnknownTaskError) as err:
        mteb_tasks(["NoSuchTaskXYZ"], benchmark)
    assert err.value.name == "NoSuchTaskXYZ"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"tasks": {}}', "malformed"),
        (
            '{"categories": [{"name": "STS", "label": "STS"}], "tasks": {"A": {"category": "Other", "split": "test", '
            '"hf_subset": "default", "main_score": "x"}}}',
            r"tasks \['A'\] name a category",
        ),
        ('{"categories": [], "tasks": {}, "subsets": {"1": {"tasks": ["B"]}}}', r"subsets name tasks \['B'\]"),
    ],
)
def test_load_benchmark_rejects_malformed_files(tmp_path, content, message):
    fp = tmp_path / "tasks.json"
    fp.write_text(content)
    with pytest.raises(BenchmarkError, match=message):
        load_benchmark(fp)
    with pytest.raises(BenchmarkError, match="not found"):
        load_benchmark(tmp_path / "nope.json")


@pytest.mark.parametrize(("content", "message"), [("{x", "not valid JSON"), ('{"A": 1}', "JSON object mapping")])
def test_load_instructions_rejects_malformed_files(tmp_path, content, message):
    fp = tmp_path / "instr.json"
    fp.write_text(content)
    with pytest.raises(InstructionsFileError, match=message):
        load_instructions(fp)


def test_cli_evaluates_a_local_folder(llama_checkpoint, tmp_path, capsys):
    data = tmp_path / "eval"
    write_local_task(data, DOCUMENTS, QRELS)
    assert main(cli_argv(llama_checkpoint, tmp_path / "out", data=data)) == 0
    out = capsys.readouterr().out
    assert "StdlibDocRetrieval\t1.0000" in out
    saved = list((tmp_path / "out" / "results" / "tiny__llama3").glob("*/StdlibDocRetrieval.json"))
    assert len(saved) == 1


def test_cli_authors_command_with_a_lora_adapter(llama_checkpoint, tmp_path, capsys):
    """The authors' flags (base + adapter + instructions file + output dir), on a local task; the adapter is
    merged, names the results folder, and changes the embeddings."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    body = AutoModel.from_pretrained(llama_checkpoint)
    lora = get_peft_model(
        body, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    adapter = tmp_path / "stage2" / "adapter"
    lora.save_pretrained(adapter)

    data = tmp_path / "eval"
    write_local_task(data, DOCUMENTS, QRELS)
    instructions = tmp_path / "instr.json"
    instructions.write_text(json.dumps({"StdlibDocRetrieval": ""}))
    out = tmp_path / "out"
    argv = [
        "--base_model_name_or_path",
        llama_checkpoint,
        "--peft_model_name_or_path",
        str(adapter),
        "--local_retrieval_dir",
        str(data),
        "--task_to_instructions_fp",
        str(instructions),
        "--output_dir",
        str(out),
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    assert "StdlibDocRetrieval\t1.0000" in capsys.readouterr().out
    (folder,) = (out / "results" / "stage2__adapter").iterdir()
    meta = json.loads((folder / "model_meta.json").read_text())
    assert meta["loader_kwargs"]["peft_model_name_or_path"] == str(adapter.resolve())

    merged = LLM2VecMTEBEncoder.from_pretrained(llama_checkpoint, str(adapter), instructions={}, devices="cpu")
    plain = LLM2VecMTEBEncoder.from_pretrained(llama_checkpoint, instructions={}, devices="cpu")
    with torch.no_grad():
        a = merged.encode_items([["", DOCUMENTS[0]]], show_progress_bar=False)
        b = plain.encode_items([["", DOCUMENTS[0]]], show_progress_bar=False)
    assert not np.allclose(a, b)


def test_results_are_never_written_into_a_run_or_an_export_folder(llama_checkpoint, tmp_path, capsys):
    """``--output_dir`` that is, or lies inside, a live run's folder or an export is refused in one line before the
    model loads, as every other writer is; nothing is written there."""
    from _drivers import GOOD, lock_held_elsewhere

    from llm2vec.io import EXPORT_MARKER

    beir = write_beir(tmp_path / "beir", **GOOD)
    live, export = tmp_path / "live", tmp_path / "export"
    live.mkdir()
    export.mkdir()
    (export / EXPORT_MARKER).write_text("{}")
    for out, held in ((live, "a run in progress"), (export / "inside", "an export")):
        before = sorted(p.name for p in out.parent.iterdir())
        with lock_held_elsewhere(live):
            assert mteb_eval_custom.main(eval_argv(llama_checkpoint, beir, out, "--local_task_name", "Mine")) == 2
        line = one_line(capsys.readouterr().err)
        assert f"{out.parent if held == 'an export' else out} holds {held}" in line, line
        assert sorted(p.name for p in out.parent.iterdir()) == before
