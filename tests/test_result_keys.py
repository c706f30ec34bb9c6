"""Stored evaluation results are reused only for what they were computed from.

A result file in the output folder is served again only when the key it records matches the task's content (a
local folder's files and the instruction), the model's files and the settings that change the scores; otherwise
the task is computed again. A local task may not take the name of a task mteb knows.

References are independent of the code under test: scores of a fresh run into an empty output folder, SHA-256
of the files computed here, the embeddings counted by a spy on ``LLM2Vec.encode``.
"""

import json
import shutil
from pathlib import Path

import mteb_eval_custom
import pytest
from _drivers import DOCUMENTS  # the local task tests' corpus
from test_mteb_eval import QRELS, cli_argv  # their queries and command line

main = mteb_eval_custom.main


def write_beir(folder: Path, texts=DOCUMENTS, qrels=QRELS) -> Path:
    """Documents d0..dn with ``texts``; each query's text is the text of its relevant document."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": f"d{i}", "title": "", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": DOCUMENTS[int(d[1:])]}) + "\n" for q, d in qrels.items())
    )
    (folder / "qrels.jsonl").write_text(
        "".join(json.dumps({"query-id": q, "corpus-id": d, "score": 1}) + "\n" for q, d in qrels.items())
    )
    return folder


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return str(tiny_checkpoints["llama3"])


def printed_scores(out: str) -> dict[str, float]:
    return {line.split("\t")[0]: float(line.split("\t")[1]) for line in out.splitlines() if "\t" in line}


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize("name", ["SciFact", "scifact", "STSBenchmark"])
def test_a_local_task_never_takes_the_name_of_an_mteb_task(model, tmp_path, capsys, name):
    data = write_beir(tmp_path / "data")
    out = tmp_path / "out"
    assert main(cli_argv(model, out, "--local_task_name", name, data=data)) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--local_task_name {name!r}" in line and "mteb task" in line and "choose another name" in line, line
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- reuse


def test_a_stored_result_of_a_local_folder_is_never_served_for_the_mteb_task_of_its_name(model, tmp_path, capsys):
    """A ``SciFact.json`` that holds a local folder's score (a folder evaluated under that name before names were
    checked, or such a file copied in) is not printed for ``--task_name SciFact``: the mteb task is computed, which
    offline and without its dataset fails, naming the stored file that was not reused."""
    data = write_beir(tmp_path / "data")
    out = tmp_path / "out"
    assert main(cli_argv(model, out, "--local_task_name", "LocalCopy", data=data)) == 0
    assert printed_scores(capsys.readouterr().out) == {"LocalCopy": 1.0}
    (folder,) = (out / "results" / "tiny__llama3").iterdir()
    stored = json.loads((folder / "LocalCopy.json").read_text())
    stored["task_name"] = "SciFact"
    (folder / "SciFact.json").write_text(json.dumps(stored))

    rc = main(cli_argv(model, out, "--task_name", "SciFact"))
    captured = capsys.readouterr()
    assert "SciFact" not in printed_scores(captured.out), captured.out
    assert rc == 1
    failed = [line for line in captured.out.splitlines() if line.startswith("FAILED SciFact")]
    assert len(failed) == 1 and "not reused" in failed[0] and str(folder / "SciFact.json") in failed[0], captured.out


def test_an_edited_local_folder_is_scored_again(model, tmp_path, capsys):
    """After ``corpus.jsonl`` changes, the same command prints the score of the new files (that of a fresh run
    into an empty folder), not the stored one."""
    data = write_beir(tmp_path / "data")
    out = tmp_path / "out"
    assert main(cli_argv(model, out, data=data)) == 0
    assert printed_scores(capsys.readouterr().out) == {"StdlibDocRetrieval": 1.0}

    edited = list(DOCUMENTS)
    edited[3], edited[0] = "A completely different sentence about rivers.", "Nothing about containers here."
    write_beir(data, texts=edited)
    assert main(cli_argv(model, out, data=data)) == 0
    again = printed_scores(capsys.readouterr().out)
    assert main(cli_argv(model, tmp_path / "fresh", data=data)) == 0
    fresh = printed_scores(capsys.readouterr().out)
    assert fresh["StdlibDocRetrieval"] < 1.0
    assert again == fresh


@pytest.fixture
def encode_calls(monkeypatch):
    """Counts the calls of ``LLM2Vec.encode`` (every instance): zero while a stored result is served."""
    from llm2vec import LLM2Vec

    calls = []
    original = LLM2Vec.encode

    def encode(self, sentences, *args, **kwargs):
        calls.append(len(sentences))
        return original(self, sentences, *args, **kwargs)

    monkeypatch.setattr(LLM2Vec, "encode", encode)
    return calls


def stored_file(out: Path, name: str = "StdlibDocRetrieval") -> Path:
    (path,) = (out / "results" / "tiny__llama3").glob(f"*/{name}.json")
    return path


def test_an_unchanged_evaluation_is_served_and_its_file_records_what_it_was_computed_from(
    model, tmp_path, capsys, encode_calls
):
    """The result file records the SHA-256 of the folder's three files, the instruction, the model folder's files,
    the settings, and (not compared) the paths and the batch size; mteb reads it back. The same command, with
    another batch size, serves it without encoding anything and leaves the file as it was."""
    import hashlib

    from mteb.results import TaskResult

    from llm2vec.evaluation.result_keys import FIELD

    data = write_beir(tmp_path / "data")
    out = tmp_path / "out"
    instruction = "Given a sentence, retrieve the same sentence"
    assert main(cli_argv(model, out, data=data, instruction=instruction)) == 0
    score = printed_scores(capsys.readouterr().out)
    assert encode_calls
    path = stored_file(out)
    record = json.loads(path.read_text())[FIELD]
    compared = record["compared"]
    assert compared["task"] == {
        "name": "StdlibDocRetrieval",
        "source": "local folder",
        "files": {f: hashlib.sha256((data / f).read_bytes()).hexdigest() for f in FILES},
    }
    assert compared["instruction"] == instruction
    files = compared["model"]["base"]["files"]
    assert set(files) == {p.name for p in Path(model).iterdir() if p.is_file() and p.name != "README.md"}
    weights = Path(model) / "model.safetensors"
    assert files["model.safetensors"] == {
        "size": weights.stat().st_size,
        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
    }
    assert compared["model"]["adapter"] is None
    assert compared["settings"] == {
        "pooling_mode": "eos_token",
        "max_length": 512,
        "template": "llama3",
        "dtype": "float32",
    }
    assert record["recorded"]["folder"] == str(data.resolve()) and record["recorded"]["batch_size"] == 2
    assert (
        record["key"] == hashlib.sha256(json.dumps(compared, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    )
    assert TaskResult.from_disk(path).get_score() == pytest.approx(score["StdlibDocRetrieval"], abs=1e-4)

    before, calls = path.read_bytes(), len(encode_calls)
    again = cli_argv(model, out, data=data, instruction=instruction)
    again[again.index("--batch_size") + 1] = "3"
    assert main(again) == 0
    assert printed_scores(capsys.readouterr().out) == score
    assert len(encode_calls) == calls and path.read_bytes() == before


FILES = ("corpus.jsonl", "queries.jsonl", "qrels.jsonl")


def _other_weights(model_dir: Path) -> None:
    from llm2vec.testing import save_tiny_model

    save_tiny_model("llama3", model_dir, seed=1)  # same shape and files, other weights, written in place


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("instruction", "instruction was 'Given a sentence, retrieve the same sentence', now 'Find it'"),
        ("model", "model.base.files.model.safetensors.sha256 was '"),
        ("max_length", "settings.max_length was 512, now 64"),
        ("qrels", "task.files.qrels.jsonl was '"),
    ],
)
def test_a_changed_instruction_model_setting_or_file_is_computed_again(
    tiny_checkpoints, tmp_path, capsys, caplog, encode_calls, change, message
):
    """Each part of the key, changed alone with the results folder kept (``--revision``), has the task computed
    again: the encoder runs, the printed score is a fresh run's, and the warning names what changed."""
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoints["llama3"], model)
    data = write_beir(tmp_path / "data")
    out = tmp_path / "out"
    flags = ["--revision", "v1"]
    instruction = "Given a sentence, retrieve the same sentence"
    assert main(cli_argv(model, out, *flags, data=data, instruction=instruction)) == 0
    capsys.readouterr()

    if change == "instruction":
        instruction = "Find it"
    elif change == "model":
        _other_weights(model)
    elif change == "max_length":
        flags += ["--max_length", "64"]
    else:  # qb and qd find each other's document now
        qrels = {**QRELS, "qb": "d1", "qd": "d0"}
        (data / "qrels.jsonl").write_text(
            "".join(json.dumps({"query-id": q, "corpus-id": d, "score": 1}) + "\n" for q, d in qrels.items())
        )
    calls = len(encode_calls)
    assert main(cli_argv(model, out, *flags, data=data, instruction=instruction)) == 0
    again = printed_scores(capsys.readouterr().out)
    assert len(encode_calls) > calls
    assert message in caplog.text and "is not reused" in caplog.text, caplog.text
    assert main(cli_argv(model, tmp_path / "fresh", *flags, data=data, instruction=instruction)) == 0
    assert again == printed_scores(capsys.readouterr().out)


# ---------------------------------------------------------------------------------------------- Python


MOCK_INSTRUCTIONS = {
    "MockRetrievalTask": "Given a test query, retrieve the matching sentence",
    "MockRerankingTask": "Rank the sentences",
    "MockSTSTask": "Retrieve semantically similar text",
}


def encoder_of(model, **kwargs):
    from llm2vec.evaluation.mteb_wrapper import LLM2VecMTEBEncoder

    return LLM2VecMTEBEncoder.from_pretrained(model, devices="cpu", batch_size=4, **kwargs)


def test_a_result_file_that_records_nothing_is_computed_again_and_then_records_its_key(
    model, tmp_path, caplog, encode_calls
):
    """A stored result without a record (as mteb itself, or an earlier version, writes it) is computed again."""
    from mteb.mocks import MockSTSTask

    from llm2vec.evaluation.mteb_wrapper import evaluate
    from llm2vec.evaluation.result_keys import FIELD

    encoder = encoder_of(model, instructions=MOCK_INSTRUCTIONS)
    evaluate(encoder, [MockSTSTask()], tmp_path, show_progress_bar=False, raise_error=True)
    path = encoder.results_folder(tmp_path) / "MockSTSTask.json"
    stored = json.loads(path.read_text())
    assert stored[FIELD]["compared"]["task"]["source"].startswith("class mteb.")
    del stored[FIELD]
    path.write_text(json.dumps(stored))
    calls = len(encode_calls)
    evaluate(encoder, [MockSTSTask()], tmp_path, show_progress_bar=False, raise_error=True)
    assert len(encode_calls) == calls + 2  # both sides of the pairs
    assert "records nothing of what it was computed from" in caplog.text
    assert FIELD in json.loads(path.read_text())


def test_an_aggregate_task_is_served_only_when_its_sub_tasks_results_are(model, tmp_path, encode_calls):
    """mteb scores an aggregate task from its sub-tasks' result files: a sub-task computed from another instruction
    has the aggregate computed again."""
    from mteb.mocks.mock_tasks.reranking import MockAggregatedTask

    from llm2vec.evaluation.mteb_wrapper import evaluate
    from llm2vec.evaluation.result_keys import FIELD

    encoder = encoder_of(model, instructions=dict(MOCK_INSTRUCTIONS))
    evaluate(encoder, [MockAggregatedTask()], tmp_path, show_progress_bar=False, raise_error=True)
    folder = encoder.results_folder(tmp_path)
    names = ["MockMultilingualInstructionReranking", "MockRetrievalTask", "MockRerankingTask"]
    assert all(FIELD in json.loads((folder / f"{name}.json").read_text()) for name in names)
    calls = len(encode_calls)
    evaluate(encoder, [MockAggregatedTask()], tmp_path, show_progress_bar=False, raise_error=True)
    assert len(encode_calls) == calls  # served
    encoder.add_instruction("MockRetrievalTask", "Another instruction")
    evaluate(encoder, [MockAggregatedTask()], tmp_path, show_progress_bar=False, raise_error=True)
    assert len(encode_calls) > calls
    record = json.loads((folder / "MockRetrievalTask.json").read_text())[FIELD]
    assert record["compared"]["instruction"] == "Another instruction"


def test_a_model_in_memory_has_its_results_computed_every_time(model, tmp_path, encode_calls):
    """An encoder made from a model object (no folder in its identity) cannot tell its weights from another's: its
    stored results are never served."""
    from mteb.mocks import MockSTSTask

    from llm2vec import LLM2Vec
    from llm2vec.evaluation.mteb_wrapper import LLM2VecMTEBEncoder, evaluate

    encoder = LLM2VecMTEBEncoder(LLM2Vec.from_pretrained(model, device="cpu"), MOCK_INSTRUCTIONS)
    assert encoder.model_files is None
    for expected in (2, 4):
        evaluate(encoder, [MockSTSTask()], tmp_path, show_progress_bar=False, raise_error=True)
        assert len(encode_calls) == expected


def test_a_local_folder_changed_after_its_task_was_made_is_refused_when_loaded(model, tmp_path):
    """The key a result records is that of the files scored: files edited between making the task and scoring it
    stop the task, and no result is written."""
    from llm2vec.evaluation.local_task import local_retrieval_task
    from llm2vec.evaluation.mteb_wrapper import evaluate

    data = write_beir(tmp_path / "data")
    task = local_retrieval_task(data, name="Edited", instruction="")
    with open(data / "corpus.jsonl", "a") as f:
        f.write(json.dumps({"_id": "d9", "title": "", "text": "added later"}) + "\n")
    encoder = encoder_of(model, instructions={})
    with pytest.raises(ValueError, match="corpus.jsonl changed after the task was made from it"):
        evaluate(encoder, [task], tmp_path / "out", show_progress_bar=False, raise_error=True)
    assert not (encoder.results_folder(tmp_path / "out") / "Edited.json").exists()


def test_local_retrieval_task_refuses_an_mteb_name_unless_told_it_stands_in(tmp_path):
    from llm2vec.evaluation.local_task import TaskNameError, local_retrieval_task

    data = write_beir(tmp_path / "data")
    with pytest.raises(TaskNameError, match=r"task name 'NFCorpus' is the name of the mteb task 'NFCorpus'"):
        local_retrieval_task(data, name="NFCorpus")
    with pytest.raises(TaskNameError, match=r"the mteb task 'NFCorpus' \(names differ only in case\)"):
        local_retrieval_task(data, name="nfcorpus")
    assert local_retrieval_task(data, name="NFCorpus", allow_mteb_name=True).metadata.name == "NFCorpus"


def test_a_model_file_changed_after_its_first_mib_is_another_model(tmp_path):
    """The model part of a result's key covers every byte of every file: a weights file changed only past its first
    MiB, at the same size, gives another key (a copy of the folder gives the same one)."""
    from llm2vec.fingerprints import model_content

    model = tmp_path / "model"
    model.mkdir()
    weights = bytearray(range(256)) * (3 << 12)  # 3 MiB
    (model / "model.safetensors").write_bytes(bytes(weights))
    (model / "config.json").write_text("{}")
    before = model_content(str(model))
    shutil.copytree(model, tmp_path / "copy")
    assert model_content(str(tmp_path / "copy")) == before
    weights[(3 << 20) - 10] ^= 1
    (model / "model.safetensors").write_bytes(bytes(weights))
    after = model_content(str(model))
    assert after["files"]["model.safetensors"]["size"] == before["files"]["model.safetensors"]["size"]
    assert after != before
