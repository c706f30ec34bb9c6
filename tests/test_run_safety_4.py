"""Never delete what is not ours, never write outside the folder asked for, never load the wrong thing silently,
one section per concern:

1. an overwrite deletes only the files the run wrote (the completion marker lists only them);
2. an output folder that is, lies inside or contains an input (or another run's folder) is refused, whatever the flags;
3. the export takes the run lock and replaces only a previous export;
5. an adapter that is not one, does not fit the base, or was trained on another base is refused in one line
   wherever adapters load (``accept_other_base`` makes the last a warning);
6. a resume reproduces what it claims or refuses: changed settings, changed checkpoint contents (SHA-256), a
   checkpoint whose recorded step is not its folder's;
8. Ctrl-C is one line and exit 130 (a real SIGINT to a training process), and a checkpoint of the other stage is
   refused in one line.

References are independent of the code under test: file trees and bytes listed before and after, hashlib over
the files, values written literally here, the weights of an uninterrupted run, a separate process that holds the
lock or receives the signal.
"""

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import export_sentence_transformers
import mteb_eval_custom
import pytest
from _drivers import (
    ROOT,
    assert_same_weights,
    lock_held_elsewhere,
    one_line,
    subprocess_env,
    tiny_run_flags,
    unfinished_copy,
)

from llm2vec import LLM2Vec
from llm2vec.model_files import ModelFilesError
from llm2vec.run.folder import CHECKPOINT_MANIFEST, COMPLETE_MARKER
from llm2vec.run.lock import LOCK_NAME
from llm2vec.testing import save_tiny_model
from llm2vec.training import main, run

export_main = export_sentence_transformers.main
eval_main = mteb_eval_custom.main
RESUME = ["--resume_from_checkpoint", "true"]
EXPORT_MARKER = "export_complete.json"  # what the export writes last (llm2vec.run.checks.EXPORT_MARKER)
OVERWRITE = ["--overwrite_output_dir", "true"]


@pytest.fixture(autouse=True)
def _threads(keep_thread_count):
    """Every test here leaves torch's thread count as it found it."""


def flags(assets, out, stage="I", **fields) -> list[str]:
    model, data = assets
    settings = dict(learning_rate=1e-3, max_steps=4, save_steps=2, num_threads=1, disable_tqdm="true")
    settings.update(max_seq_length=64)
    if stage == "II":
        settings.update(stage="II", lora_r=4, lora_alpha=8)
    settings.update(fields)
    return tiny_run_flags(model, data, out, **settings)


def quick(assets, out, stage="I", **fields) -> list[str]:
    """A 2-step run that saves no checkpoint."""
    return flags(assets, out, stage, max_steps=2, save_strategy="no", **fields)


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a folder): what a test compares before and after."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(Path(root).rglob("*"))}


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """An uninterrupted 4-step Stage I run (checkpoints 2 and 4)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run("I", flags(assets, out))
    return out


# ---------------------------------------------------------------------------------------------- 1. own files only


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


def test_a_marker_entry_without_its_hash_makes_no_file_the_runs(assets, tmp_path):
    """A completion marker listing notes.txt without its SHA-256 is damage: notes.txt stays the user's."""
    out = tmp_path / "run"
    assert main("I", quick(assets, out)) == 0
    (out / "notes.txt").write_bytes(b"mine")
    marker = json.loads((out / COMPLETE_MARKER).read_text())
    marker["files"]["notes.txt"] = 4
    (out / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert main("I", quick(assets, out) + OVERWRITE) == 0
    assert (out / "notes.txt").read_bytes() == b"mine"


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


# ---------------------------------------------------------------------------------------------- 2. apart from inputs


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


# ---------------------------------------------------------------------------------------------- 3. the export


def export_argv(model, out, *extra) -> list[str]:
    return [
        *("--base_model_name_or_path", str(model), "--output_dir", str(out)),
        *("--max_length", "64", "--query_instruction", "", "--no_verify_embeddings", *extra),
    ]


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


# ---------------------------------------------------------------------------------------------- 5. adapters


@pytest.fixture(scope="module")
def adapters(assets, tmp_path_factory):
    """A Stage II adapter of the tiny model, a base of the same shape with other weights, a wider base, a folder
    with no adapter_config.json."""
    root = tmp_path_factory.mktemp("adapters")
    adapter = root / "adapter"
    run("II", quick(assets, adapter, "II"))
    other = save_tiny_model("llama3", root / "other_base", seed=1)
    wider = save_tiny_model("llama3", root / "wider", hidden_size=48)
    empty = root / "not_an_adapter"
    empty.mkdir()
    (empty / "notes.txt").write_text("nothing here")
    return {"adapter": adapter, "other": other, "wider": wider, "empty": empty}


def adapter_cases(assets, adapters):
    """(base, adapter, the words of the one-line refusal)."""
    model, a = assets[0], adapters["adapter"]
    return [
        (adapters["other"], a, f"adapter {a} was trained on the base model {model}"),
        (adapters["wider"], a, f"adapter {a} does not fit the base model {adapters['wider']}: its layer"),
        (model, model, f"adapter {model} holds a full model (config.json, model.safetensors), not a LoRA adapter"),
        (model, adapters["empty"], f"adapter {adapters['empty']} has no adapter_config.json"),
    ]


def test_from_pretrained_refuses_a_wrong_adapter_in_one_line(assets, adapters):
    for base, adapter, expected in adapter_cases(assets, adapters):
        with pytest.raises(ModelFilesError) as caught:
            LLM2Vec.from_pretrained(str(base), str(adapter), device="cpu")
        assert expected in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_accept_other_base_loads_the_adapter_with_a_warning(assets, adapters, caplog):
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        encoder = LLM2Vec.from_pretrained(
            str(adapters["other"]), str(adapters["adapter"]), device="cpu", accept_other_base=True
        )
    assert any("accept_other_base: adapter" in r.getMessage() for r in caplog.records)
    assert encoder.encode(["a text"], show_progress_bar=False).shape == (1, 32)
    # the right base passes without a word, also as a copy in another folder (names and times aside)
    copy = shutil.copytree(assets[0], adapters["other"].parent / "copy_of_base")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        LLM2Vec.from_pretrained(str(copy), str(adapters["adapter"]), device="cpu")
    assert not [r for r in caplog.records if r.name == "llm2vec"]


def test_evaluation_refuses_a_wrong_adapter_in_one_line(assets, adapters, tmp_path, capsys):
    beir = tmp_path / "beir"
    beir.mkdir()
    texts = ["Return the length of a list.", "Open a file for reading.", "Sort items in place.", "Join path parts."]
    rows = {
        "corpus.jsonl": [{"_id": f"d{i}", "title": "", "text": t} for i, t in enumerate(texts)],
        "queries.jsonl": [{"_id": f"q{i}", "text": t} for i, t in enumerate(texts)],
        "qrels.jsonl": [{"query-id": f"q{i}", "corpus-id": f"d{i}", "score": 1} for i in range(len(texts))],
    }
    for name, records in rows.items():
        (beir / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    for base, adapter, expected in adapter_cases(assets, adapters):
        argv = ["--base_model_name_or_path", str(base), "--peft_model_name_or_path", str(adapter)]
        argv += ["--local_retrieval_dir", str(beir), "--local_instruction", "", "--output_dir", str(tmp_path / "out")]
        assert eval_main([*argv, "--device", "cpu"]) == 2
        line = one_line(capsys.readouterr().err)
        assert expected in line, line


def test_the_export_refuses_a_wrong_adapter_in_one_line(assets, adapters, tmp_path, capsys):
    for base, adapter, expected in adapter_cases(assets, adapters):
        argv = export_argv(base, tmp_path / "st", "--peft_model_name_or_path", str(adapter))
        assert export_main(argv) == 2
        line = one_line(capsys.readouterr().err)
        assert expected in line, line
    assert not (tmp_path / "st").exists()
    argv = export_argv(adapters["other"], tmp_path / "st", "--peft_model_name_or_path", str(adapters["adapter"]))
    assert export_main([*argv, "--accept_other_base"]) == 0


def test_training_refuses_an_adapter_trained_on_another_base(assets, adapters, tmp_path, capsys):
    argv = tiny_run_flags(
        adapters["other"], assets[1], tmp_path / "run", stage="II", peft_model_name_or_path=adapters["adapter"]
    )
    assert main("II", argv) == 2
    line = one_line(capsys.readouterr().err)
    assert f"adapter {adapters['adapter']} was trained on the base model {assets[0]}" in line, line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------- 6. resumes


def test_a_resume_with_changed_settings_is_refused_or_recorded(assets, reference, tmp_path, capsys):
    out = unfinished_copy(reference, tmp_path / "run")
    shutil.rmtree(out / "checkpoint-4")
    for field, value, shown in (("alpha", 0.5, "alpha 0.2 -> 0.5"), ("max_seq_length", 80, "max_seq_length 64 -> 80")):
        before = tree(out)
        assert main("I", flags(assets, out, **{field: value}) + RESUME) == 2
        line = one_line(capsys.readouterr().err)
        assert f"resume_from_checkpoint {out / 'checkpoint-2'}: what it was trained with changed" in line, line
        assert shown in line and "--accept_changed_inputs true" in line, line
        assert tree(out) == before
    accepted = flags(assets, out, alpha=0.5, accept_changed_inputs="true") + RESUME
    assert main("I", accepted) == 0
    config = json.loads((out / "run_config.json").read_text())
    assert config["alpha"] == 0.5
    (entry,) = config["resumed_with_changes"]
    assert entry["step"] == 2 and entry["from_step"] == 3
    assert entry["settings"] == {"alpha": {"before": 0.2, "after": 0.5}}
    assert "alpha 0.2 -> 0.5" in entry["changes"]
    card = (out / "README.md").read_text()
    assert "with changes that hold from step 3 (the steps before were trained without them): alpha 0.2 -> 0.5" in card


def test_checkpoints_record_the_sha256_of_each_file(reference):
    checkpoint = reference / "checkpoint-2"
    manifest = json.loads((checkpoint / CHECKPOINT_MANIFEST).read_text())
    files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    assert sorted(manifest["sha256"]) == sorted(set(files) - {CHECKPOINT_MANIFEST})
    for name, recorded in manifest["sha256"].items():
        assert recorded == hashlib.sha256((checkpoint / name).read_bytes()).hexdigest(), name


def flip_middle_bytes(path: Path) -> None:
    """Change 16 bytes in the middle of a file (inside a safetensors file's data, inside a torch archive's
    members): the same size, a header and an archive directory that still read, other contents."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 16] = bytes(255 - b for b in raw[middle : middle + 16])
    path.write_bytes(bytes(raw))


def test_a_checkpoint_with_other_contents_is_skipped_or_refused(assets, reference, tmp_path, capsys, caplog):
    out = unfinished_copy(reference, tmp_path / "run")
    tampered = out / "checkpoint-4" / "model.safetensors"
    size = tampered.stat().st_size
    flip_middle_bytes(tampered)
    assert tampered.stat().st_size == size
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        assert main("I", flags(assets, out) + RESUME) == 0
    warned = [r.getMessage() for r in caplog.records if "other contents" in r.getMessage()]
    assert warned == [
        f"{out / 'checkpoint-4'}: model.safetensors has other contents than when it was saved (its SHA-256 differs "
        f"from {CHECKPOINT_MANIFEST}); skipped"
    ]
    assert_same_weights(out, reference)  # resumed from checkpoint-2: the uninterrupted run's weights

    elsewhere = tmp_path / "elsewhere"
    other = unfinished_copy(reference, tmp_path / "copy")
    flip_middle_bytes(other / "checkpoint-4" / "optimizer.pt")
    capsys.readouterr()
    assert main("I", flags(assets, elsewhere, resume_from_checkpoint=other / "checkpoint-4")) == 2
    line = one_line(capsys.readouterr().err)
    assert f"resume_from_checkpoint {other / 'checkpoint-4'}: optimizer.pt has other contents" in line, line


def test_a_checkpoint_whose_recorded_step_is_not_its_folders_is_refused(assets, reference, tmp_path, capsys):
    source = unfinished_copy(reference, tmp_path / "source")
    os.rename(source / "checkpoint-2", source / "checkpoint-3")  # trainer_state.json still says 2
    out = tmp_path / "run"
    assert main("I", flags(assets, out, resume_from_checkpoint=source / "checkpoint-3")) == 2
    line = one_line(capsys.readouterr().err)
    assert "its trainer_state.json says step 2 but the folder is named checkpoint-3" in line, line
    assert not (out / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------- 8. Ctrl-C, other stage


def test_ctrl_c_is_one_line_exit_130_and_the_run_resumes_exactly(assets, reference, tmp_path):
    out, flag_dir = tmp_path / "run", tmp_path / "flags"
    flag_dir.mkdir()
    spec = {
        "flag_dir": str(flag_dir),
        "runs": [{"stage": "I", "argv": flags(assets, out), "pause": {"at": "after_checkpoint", "step": 2}}],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "_drivers.py"), str(tmp_path / "spec.json")],
        env=subprocess_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while not (flag_dir / "rank0.pid").exists():
        assert process.poll() is None and time.time() < deadline, process.stderr.read()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)  # Ctrl-C, in step 3 (checkpoint-2 is complete)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    line = one_line(err, "interrupted")
    assert f"Stage I run in {out} stopped by Ctrl-C at step 3" in line, line
    assert f"newest: {out / 'checkpoint-2'}" in line and "--resume_from_checkpoint true" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]  # no lock, no staging, no final model
    assert main("I", flags(assets, out) + RESUME) == 0
    assert_same_weights(out, reference)


@pytest.fixture(scope="module")
def stage_II_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("stage_II") / "run"
    run("II", flags(assets, out, "II", max_steps=2, save_steps=2))
    return out


@pytest.mark.parametrize("stage", ["I", "II"])
def test_a_checkpoint_of_the_other_stage_is_refused_in_one_line(
    assets, reference, stage_II_run, tmp_path, capsys, stage
):
    checkpoint = (reference if stage == "II" else stage_II_run) / "checkpoint-2"
    other = "I" if stage == "II" else "II"
    out = tmp_path / "run"
    assert main(stage, flags(assets, out, stage, resume_from_checkpoint=checkpoint)) == 2
    line = one_line(capsys.readouterr().err)
    assert f"resume_from_checkpoint {checkpoint}: a Stage {other} checkpoint" in line, line
    assert f"this is a Stage {stage} config" in line and f"run_stage_{other}.py" in line, line
    assert not out.exists() or not any(p.name != LOCK_NAME for p in out.iterdir())
