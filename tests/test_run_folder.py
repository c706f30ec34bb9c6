"""What a run (or the export) writes to its output folder and what it refuses: a finished run is not overwritten
without ``--overwrite_output_dir``, an overwrite deletes only the files the run recorded, files the run did not write
are never deleted or written over, an output folder never is, lies inside or contains an input or another run's
folder, and one run holds a folder at a time (its lock), also against the export.

References are independent of the code under test: file trees and bytes listed before and after, values written
literally here, the weights of an uninterrupted run, a separate process that holds the lock.
"""

import json
import logging
import shutil
from pathlib import Path

import export_sentence_transformers
import pytest
import torch
from _drivers import (
    OVERWRITE,
    RESUME,
    assert_same_weights,
    export_argv,
    files,
    lock_held_elsewhere,
    marker,
    one_line,
    one_line_error,
    quick,
    six_step_flags,
    snapshot,
    tiny_run_flags,
    tree,
    unfinished_copy,
)
from _drivers import run_flags as flags

from llm2vec.run.folder import COMPLETE_MARKER
from llm2vec.run.lock import LOCK_NAME
from llm2vec.training import main, run

export_main = export_sentence_transformers.main
EXPORT_MARKER = "export_complete.json"  # what the export writes last (llm2vec.io.EXPORT_MARKER)


@pytest.fixture(autouse=True)
def _threads(keep_thread_count):
    """Every test here leaves torch's thread count as it found it."""


# ------------------------------------------------------------------------------------- a finished run is kept


def test_a_finished_run_is_not_overwritten(assets, tmp_path, capsys):
    out = tmp_path / "run"
    run("I", six_step_flags(assets, out, max_steps=3, save_steps=1))
    assert torch.get_num_threads() == 1  # num_threads is applied
    before = snapshot(out)
    capsys.readouterr()
    assert main("I", six_step_flags(assets, out, max_steps=3, save_steps=1, learning_rate=2e-3)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for part in (
        "already holds a finished Stage I run (step 3",
        "checkpoint-3",
        "learning_rate 0.001 -> 0.002",
        "--resume_from_checkpoint true",
        "--overwrite_output_dir true",
    ):
        assert part in err, err
    assert snapshot(out) == before

    # --overwrite_output_dir true replaces it: the old run's checkpoints are gone, the result is a clean run's
    # (save_total_limit 1: checkpoint-1 is rotated out once checkpoint-2 is complete)
    run(
        "I",
        six_step_flags(
            assets, out, max_steps=2, save_steps=1, learning_rate=2e-3, overwrite_output_dir="true", save_total_limit=1
        ),
    )
    (tmp_path / "clean").mkdir()  # an existing empty folder (the demo's fresh step folder) is used
    run("I", six_step_flags(assets, tmp_path / "clean", max_steps=2, save_steps=1, learning_rate=2e-3))
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-2"]
    assert marker(out)["global_step"] == 2
    assert_same_weights(out, tmp_path / "clean")
    assert_same_weights(out / "checkpoint-2", tmp_path / "clean")


def test_overwrite_output_dir_false_keeps_a_finished_run(assets, reference, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = files(out)
    assert main("I", flags(assets, out, learning_rate=2e-3, overwrite_output_dir="False")) == 2
    assert "already holds a finished Stage I run" in one_line_error(capsys)
    assert files(out) == before


# --------------------------------------------------------------------------------------------- own files only


USER_FILES = {"notes.txt": b"my notes\n", "LICENSE": b"MIT\n", "setup.py": b"print('setup')\n"}


def test_an_overwrite_deletes_only_the_files_the_run_wrote_however_often(assets, tmp_path):
    """A folder holding a user's files, overwritten three times: they survive each, and the marker lists none of
    them."""
    out = tmp_path / "run"
    out.mkdir()
    for name, data in USER_FILES.items():
        (out / name).write_bytes(data)
    for _ in range(3):
        assert main("I", quick(assets, out) + OVERWRITE) == 0
        assert {name: (out / name).read_bytes() for name in USER_FILES} == USER_FILES
        marker = json.loads((out / COMPLETE_MARKER).read_text())
        assert not set(marker["files"]) & set(USER_FILES), marker["files"]
        assert {"model.safetensors", "run_config.json", "README.md", "trainer_state.json"} <= set(marker["files"])


@pytest.mark.parametrize("name", ["README.md", "config.json", "checkpoint-2"])
def test_a_user_file_the_run_would_write_over_is_refused_even_with_overwrite(assets, tmp_path, capsys, name):
    out = tmp_path / "run"
    out.mkdir()
    if name.startswith("checkpoint"):
        (out / name).mkdir()
        (out / name / "my_notes.txt").write_text("not a checkpoint")
    else:
        (out / name).write_text("the user's own")
    before = tree(out)
    assert main("I", quick(assets, out) + OVERWRITE) == 2
    line = one_line(capsys.readouterr().err)
    assert f"holds {name}, which no run wrote there but which this run would write over" in line, line
    assert tree(out) == before


def test_a_folder_holding_files_the_run_did_not_write_is_refused(assets, reference, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    (out / "config.json").write_text('{"mine": true}')
    before = files(out)
    assert main("I", flags(assets, out)) == 2
    err = one_line_error(capsys)
    assert "holds files this run did not write (README.md, config.json)" in err and "--overwrite_output_dir" in err
    assert files(out) == before
    # the run would write over them (a model card, a model config): refused with --overwrite_output_dir too
    assert main("I", flags(assets, out, overwrite_output_dir="true")) == 2
    assert "holds README.md, config.json, which no run wrote there but which this run would write over" in (
        one_line_error(capsys)
    )
    assert files(out) == before
    # a file of another name: written beside, kept (test_an_overwrite_deletes_only_the_files_the_run_wrote_however_often: any number of overwrites)
    (out / "README.md").rename(out / "notes.md")
    (out / "config.json").unlink()
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        run("I", flags(assets, out, overwrite_output_dir="true"))
    assert any("beside files the run did not write (kept): notes.md" in r.getMessage() for r in caplog.records)
    assert (out / "notes.md").read_text() == "my notes"
    assert_same_weights(out, reference)

    # an unfinished run with a stranger beside it: a resume is refused too
    resumed = unfinished_copy(reference, tmp_path / "resumed")
    (resumed / "notes.txt").write_text("mine")
    assert main("I", flags(assets, resumed) + RESUME) == 2
    assert "holds files this run did not write (notes.txt)" in one_line_error(capsys)


# --------------------------------------------------------------------------- apart from inputs and other runs


def copy_model(assets, dest: Path) -> Path:
    shutil.copytree(assets[0], dest)
    return dest


RELATIONS = ["is", "inside", "contains"]


@pytest.mark.parametrize("relation", RELATIONS)
@pytest.mark.parametrize("stage", ["I", "II"])
def test_an_output_folder_at_the_base_model_is_refused_whatever_the_flags(assets, tmp_path, capsys, stage, relation):
    root = tmp_path / "root"
    root.mkdir()
    model = copy_model(assets, root / "model" if relation == "contains" else tmp_path / "model")
    out = {"is": model, "inside": model / "run", "contains": root}[relation]
    before = tree(model)
    argv = tiny_run_flags(model, assets[1], out, stage=stage, max_steps=2, save_strategy="no", num_threads=1)
    for extra in ([], OVERWRITE):
        assert main(stage, argv + extra) == 2
        line = one_line(capsys.readouterr().err)
        word = {"is": "is", "inside": "lies inside", "contains": "contains"}[relation]
        assert f"output_dir {out} {word} the base model {model}: a command never writes where it reads" in line, line
        assert tree(model) == before
    assert not (model / "run").exists()


def test_an_output_folder_at_any_other_input_is_refused(assets, adapters, tmp_path, capsys):
    """The adapter (Stage II), the E5 data folder, a jsonl data file, the validation file."""
    data = tmp_path / "data"
    shutil.copytree(assets[1], data)
    jsonl = data / "nq.jsonl"
    validation = tmp_path / "held" / "validation.jsonl"
    validation.parent.mkdir()
    shutil.copyfile(jsonl, validation)
    adapter = tmp_path / "adapter"
    cases = [
        ("II", dict(peft_model_name_or_path=adapter), adapter, f"is the adapter {adapter}"),
        ("I", {}, data / "run", f"lies inside the data folder {data}"),
        ("I", dict(dataset_name="jsonl", dataset_file_path=jsonl), jsonl, f"is the data file {jsonl}"),
        ("I", dict(validation_file=validation), tmp_path / "held", f"contains the validation file {validation}"),
    ]
    shutil.copytree(adapters["adapter"], adapter)  # a whole adapter: an incomplete one is refused as an input first
    before = tree(tmp_path)
    for stage, extra, out, expected in cases:
        read = extra.pop("dataset_file_path", data)
        argv = tiny_run_flags(assets[0], read, out, stage=stage, max_steps=2, num_threads=1, **extra)
        assert main(stage, argv + OVERWRITE) == 2
        line = one_line(capsys.readouterr().err)
        assert f"output_dir {out} {expected}" in line, line
    assert tree(tmp_path) == before


def test_an_output_folder_inside_or_above_another_run_is_refused(assets, reference, tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copytree(reference, runs / "a")
    before = tree(tmp_path)
    assert main("I", quick(assets, runs / "a" / "nested") + OVERWRITE) == 2
    line = one_line(capsys.readouterr().err)
    assert f"lies inside {runs / 'a'}, which holds a finished run" in line, line
    assert main("I", quick(assets, runs) + OVERWRITE) == 2
    line = one_line(capsys.readouterr().err)
    assert f"contains the folders of other runs or exports ({runs / 'a'} (a finished run))" in line, line
    assert tree(tmp_path) == before


# ----------------------------------------------------------------------------------------- one run per folder


def test_a_second_run_into_a_locked_output_dir_is_refused(assets, tmp_path, capsys):
    out = tmp_path / "run"
    with lock_held_elsewhere(out) as pid:
        assert main("I", flags(assets, out)) == 2
        err = one_line_error(capsys)
        assert f"output_dir {out} is in use by another run: process {pid} on " in err, err
        assert not any(p.name != LOCK_NAME for p in out.iterdir())  # nothing written
    # the holder is gone (killed: its lock file stays behind, stale): the next run goes ahead
    assert (out / LOCK_NAME).exists()
    assert main("I", flags(assets, out, max_steps=1, save_strategy="no")) == 0
    assert not (out / LOCK_NAME).exists()  # released and removed at the end of the run


# ------------------------------------------------------------------------------------------------- the export


def test_the_export_replaces_only_a_previous_export(assets, tmp_path, capsys):
    out = tmp_path / "st"
    assert export_main(export_argv(assets[0], out)) == 0
    marker = json.loads((out / EXPORT_MARKER).read_text())
    assert {"modules.json", "model.safetensors", "README.md"} <= set(marker["files"])
    first = tree(out)
    assert export_main(export_argv(assets[0], out)) == 2  # no --overwrite
    assert "holds a previous export; pass --overwrite" in one_line(capsys.readouterr().err)
    assert export_main(export_argv(assets[0], out, "--overwrite")) == 0  # a previous export: replaced
    capsys.readouterr()
    assert set(tree(out)) == set(first)
    (out / "notes.txt").write_text("mine")  # a file the export did not write: never deleted
    before = tree(out)
    assert export_main(export_argv(assets[0], out, "--overwrite")) == 2
    assert "holds a previous export and files it did not write (notes.txt)" in one_line(capsys.readouterr().err)
    assert tree(out) == before


def test_the_export_refuses_a_run_a_parent_of_runs_other_files_and_its_inputs(assets, reference, tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("a", "b"):
        shutil.copytree(reference, runs / name)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    model = copy_model(assets, tmp_path / "model")
    cases = [
        (runs / "a", f"output_dir {runs / 'a'} holds a finished Stage I run"),
        (runs, f"contains the folders of other runs or exports ({runs / 'a'} (a finished run), {runs / 'b'}"),
        (user, f"output_dir {user} holds files no export wrote (notes.txt); --overwrite replaces only a previous"),
        (model, f"output_dir {model} is the base model {model}"),
        (model / "st", f"output_dir {model / 'st'} lies inside the base model {model}"),
    ]
    before = tree(tmp_path)
    for out, expected in cases:
        assert export_main(export_argv(model, out, "--overwrite")) == 2
        line = one_line(capsys.readouterr().err)
        assert expected in line, line
    assert tree(tmp_path) == before


def test_the_export_refuses_a_folder_a_live_run_holds(assets, tmp_path, capsys):
    out = tmp_path / "run"
    with lock_held_elsewhere(out) as pid:
        assert export_main(export_argv(assets[0], out, "--overwrite")) == 2
        line = one_line(capsys.readouterr().err)
        assert f"output_dir {out} is in use by a run: process {pid} on " in line, line
        assert [p.name for p in out.iterdir()] == [LOCK_NAME]  # nothing written, the lock left alone
