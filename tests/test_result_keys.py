"""Stored evaluation results are reused only for what they were computed from.

A result file in the output folder is served again only when the key it records matches the task's content (a
local folder's files and the instruction), the model's files and the settings that change the scores; otherwise
the task is computed again. A local task may not take the name of a task mteb knows.

References are independent of the code under test: scores of a fresh run into an empty output folder, SHA-256
of the files computed here, the embeddings counted by a spy on ``LLM2Vec.encode``.
"""

import json
from pathlib import Path

import mteb_eval_custom
import pytest

main = mteb_eval_custom.main

TEXTS = [
    "Return the number of items in a container.",
    "Open a file and read its lines.",
    "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings are vectors that capture meaning.",
    "Large language models are trained on text.",
]
QRELS = {"qa": "d3", "qb": "d0", "qc": "d5", "qd": "d1"}


def write_beir(folder: Path, texts=TEXTS, qrels=QRELS) -> Path:
    """Documents d0..dn with ``texts``; each query's text is the text of its relevant document."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": f"d{i}", "title": "", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    (folder / "queries.jsonl").write_text(
        "".join(json.dumps({"_id": q, "text": TEXTS[int(d[1:])]}) + "\n" for q, d in qrels.items())
    )
    (folder / "qrels.jsonl").write_text(
        "".join(json.dumps({"query-id": q, "corpus-id": d, "score": 1}) + "\n" for q, d in qrels.items())
    )
    return folder


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return str(tiny_checkpoints["llama3"])


def argv(model, out, *extra, data=None, instruction=""):
    local = ["--local_retrieval_dir", str(data), "--local_instruction", instruction] if data is not None else []
    return [
        "--base_model_name_or_path",
        str(model),
        *local,
        "--output_dir",
        str(out),
        "--device",
        "cpu",
        "--batch_size",
        "2",
        "--model_name",
        "tiny/llama3",
        *extra,
    ]


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
    assert main(argv(model, out, "--local_task_name", name, data=data)) == 2
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
    assert main(argv(model, out, "--local_task_name", "LocalCopy", data=data)) == 0
    assert printed_scores(capsys.readouterr().out) == {"LocalCopy": 1.0}
    (folder,) = (out / "results" / "tiny__llama3").iterdir()
    stored = json.loads((folder / "LocalCopy.json").read_text())
    stored["task_name"] = "SciFact"
    (folder / "SciFact.json").write_text(json.dumps(stored))

    rc = main(argv(model, out, "--task_name", "SciFact"))
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
    assert main(argv(model, out, data=data)) == 0
    assert printed_scores(capsys.readouterr().out) == {"StdlibDocRetrieval": 1.0}

    edited = list(TEXTS)
    edited[3], edited[0] = "A completely different sentence about rivers.", "Nothing about containers here."
    write_beir(data, texts=edited)
    assert main(argv(model, out, data=data)) == 0
    again = printed_scores(capsys.readouterr().out)
    assert main(argv(model, tmp_path / "fresh", data=data)) == 0
    fresh = printed_scores(capsys.readouterr().out)
    assert fresh["StdlibDocRetrieval"] < 1.0
    assert again == fresh
