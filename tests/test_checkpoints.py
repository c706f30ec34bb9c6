"""What a run's saves hold and when they count: a checkpoint is staged and renamed into place with a manifest of
its files (size and SHA-256), a final save with a completion marker of the same; a damaged, cut or altered
checkpoint is skipped for the newest intact one or refused in one line, a final model that does not match its
marker is not called finished and is read by nothing; no file is read or copied through a link out of its folder;
the disk a run's checkpoints and final model take is checked before it trains.

References are independent of the code under test: bytes flipped, files removed and links made here, hashlib over
the files, the weights of an uninterrupted run, sizes read from the safetensors headers.
"""

import hashlib
import json
import logging
import os
import shutil
from collections import namedtuple
from pathlib import Path

import export_sentence_transformers
import pytest
from _drivers import (
    OVERWRITE,
    RESUME,
    assert_same_weights,
    export_argv,
    files,
    one_line,
    one_line_error,
    quick,
    six_step_flags,
    unfinished_copy,
)
from _drivers import run_flags as flags

from llm2vec import LLM2Vec
from llm2vec.arguments import ConfigError
from llm2vec.io import saved_folder_problem
from llm2vec.model_files import ModelFilesError
from llm2vec.run import plan as startup_checks
from llm2vec.run.folder import CHECKPOINT_MANIFEST, COMPLETE_MARKER, FINAL_SAVE_RECORD
from llm2vec.trainer import LLM2VecTrainer
from llm2vec.training import main, run

PRIVATE = "the user's private text, never to be read\n"
STEPS_PER_EPOCH = 12  # 2 sources x 24 examples, global batch 4


@pytest.fixture(autouse=True)
def _threads(keep_thread_count):
    """Every test here leaves torch's thread count as it found it."""


def flip_middle_bytes(path: Path) -> None:
    """Change 16 bytes in the middle of a file (inside a safetensors file's data, inside a torch archive's
    members): the same size, a header and an archive directory that still read, other contents."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 16] = bytes(255 - b for b in raw[middle : middle + 16])
    path.write_bytes(bytes(raw))


# --------------------------------------------------------------------------------------- checkpoint manifests


def test_checkpoints_record_the_sha256_of_each_file(reference):
    checkpoint = reference / "checkpoint-2"
    manifest = json.loads((checkpoint / CHECKPOINT_MANIFEST).read_text())
    files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    assert sorted(manifest["sha256"]) == sorted(set(files) - {CHECKPOINT_MANIFEST})
    for name, recorded in manifest["sha256"].items():
        assert recorded == hashlib.sha256((checkpoint / name).read_bytes()).hexdigest(), name


def test_a_whole_file_is_read_once_per_process_until_it_changes(tmp_path, monkeypatch):
    """``sha256_file`` (what a save's record and its check hash with) reads an unchanged file once; a file rewritten
    to the same size is read again, whether its modification time is new or set back."""
    import time

    import llm2vec.io

    path, reads, real_open = tmp_path / "model.safetensors", [], open

    def write(data: bytes, mtime_ns: int | None = None) -> None:
        path.write_bytes(data)
        if mtime_ns is not None:
            os.utime(path, ns=(mtime_ns, mtime_ns))
        time.sleep(0.05)  # past the file system's clock tick: a later write gets a later change time

    write(b"a" * 4096)
    monkeypatch.setattr(llm2vec.io, "open", lambda p, *a, **k: reads.append(p) or real_open(p, *a, **k), raising=False)
    record, first = llm2vec.io.file_record(tmp_path, [path.name]), path.stat().st_mtime_ns
    assert record["sha256"][path.name] == hashlib.sha256(b"a" * 4096).hexdigest() and len(reads) == 1
    assert llm2vec.io.record_problem(tmp_path, record, "record") is None and len(reads) == 1
    write(b"b" * 4096, first + 1)  # same size, a new modification time
    assert "other contents" in llm2vec.io.record_problem(tmp_path, record, "record") and len(reads) == 2
    assert llm2vec.io.sha256_file(path) == hashlib.sha256(b"b" * 4096).hexdigest() and len(reads) == 2
    write(b"a" * 4096, first)  # the first version's bytes and modification time, written again
    assert llm2vec.io.record_problem(tmp_path, record, "record") is None and len(reads) == 3


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt is missing"),
        (lambda c: (c / "scheduler.pt").unlink(), "scheduler.pt is missing"),
        (lambda c: (c / "rng_state.pth").unlink(), "rng_state.pth is missing"),
        (lambda c: os.truncate(c / "model.safetensors", 1000), "model.safetensors is 1000 bytes"),
        (lambda c: os.truncate(c / "trainer_state.json", 40), "trainer_state.json is 40 bytes"),
        # a checkpoint without its manifest, or whose manifest lacks a file's hash, is damaged (never an older format)
        (lambda c: (c / CHECKPOINT_MANIFEST).unlink(), f"no readable {CHECKPOINT_MANIFEST}"),
        (
            lambda c: (c / CHECKPOINT_MANIFEST).write_text(
                json.dumps(
                    {
                        **(m := json.loads((c / CHECKPOINT_MANIFEST).read_text())),
                        "sha256": {k: v for k, v in m["sha256"].items() if k != "optimizer.pt"},
                    }
                )
            ),
            f"{CHECKPOINT_MANIFEST} gives no size or no SHA-256 for optimizer.pt",
        ),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_complete_one(
    assets, reference, tmp_path, caplog, damage, reason
):
    out = unfinished_copy(reference, tmp_path / "run")
    damage(out / "checkpoint-4")
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        trainer = run("I", flags(assets, out) + RESUME)
    assert any(f"checkpoint-4 is incomplete ({reason}" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    assert trainer.state.global_step == 4
    assert_same_weights(out, reference)  # resumed from checkpoint-2: the uninterrupted run's weights


def test_with_no_complete_checkpoint_a_resume_is_refused_in_one_line(assets, reference, tmp_path, capsys):
    out = unfinished_copy(reference, tmp_path / "run")
    (out / "checkpoint-2" / "scheduler.pt").unlink()
    os.truncate(out / "checkpoint-4" / "optimizer.pt", 10)
    before = files(out)
    assert main("I", flags(assets, out) + RESUME) == 2
    err = one_line_error(capsys)
    assert "holds no complete checkpoint" in err and "checkpoint-4 (incomplete: optimizer.pt is 10 bytes" in err, err
    assert files(out) == before


def test_a_checkpoint_whose_manifest_has_no_hashes_is_refused_in_one_line(assets, reference, tmp_path, capsys):
    """A manifest without its SHA-256 table is damage: a named checkpoint is refused in one line, nothing written."""
    source = unfinished_copy(reference, tmp_path / "source")
    manifest = json.loads((source / "checkpoint-2" / CHECKPOINT_MANIFEST).read_text())
    del manifest["sha256"]
    (source / "checkpoint-2" / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))
    out = tmp_path / "run"
    assert main("I", flags(assets, out, resume_from_checkpoint=source / "checkpoint-2")) == 2
    err = one_line_error(capsys)
    assert f"resume_from_checkpoint {source / 'checkpoint-2'}: {CHECKPOINT_MANIFEST} lists no files with their" in err
    assert not (out / "model.safetensors").exists()


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


# ----------------------------------------------------------------------------------------- completion markers


def test_the_marker_records_the_sha256_of_every_file_the_final_save_wrote(reference):
    marker = json.loads((reference / COMPLETE_MARKER).read_text())
    assert set(marker["sha256"]) == set(marker["files"]) >= {"model.safetensors", "run_config.json", "README.md"}
    for name, recorded in marker["sha256"].items():
        assert recorded == hashlib.sha256((reference / name).read_bytes()).hexdigest(), name


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


def test_a_finished_model_that_does_not_match_its_marker_is_not_called_finished(assets, reference, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    os.truncate(out / "model.safetensors", 2000)
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        trainer = run("I", flags(assets, out) + RESUME)
    messages = [r.getMessage() for r in caplog.records]
    assert not any("nothing to do" in m for m in messages)
    assert any("does not match its completion marker (model.safetensors is 2000 bytes" in m for m in messages)
    assert trainer is not None and json.loads((out / COMPLETE_MARKER).read_text())["global_step"] == 4
    assert_same_weights(out, reference)  # rewritten from checkpoint-4


def test_a_flipped_bit_in_a_finished_model_is_refused_by_resume_from_pretrained_and_export(
    assets, reference, tmp_path, capsys, caplog
):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    weights = out / "model.safetensors"
    size = weights.stat().st_size
    flip_middle_bytes(weights)
    assert weights.stat().st_size == size
    expected = (
        f"model.safetensors has other contents than when it was saved (its SHA-256 differs from {COMPLETE_MARKER})"
    )

    with pytest.raises(ModelFilesError, match="model.safetensors has other contents") as refused:
        LLM2Vec.from_pretrained(str(out))
    assert str(refused.value).startswith(f"model {out}: {expected}") and "\n" not in str(refused.value)

    argv = ["--base_model_name_or_path", str(out), "--output_dir", str(tmp_path / "st"), "--no_verify_embeddings"]
    assert export_sentence_transformers.main([*argv, "--max_length", "64", "--query_instruction", ""]) == 2
    assert expected in one_line(capsys.readouterr().err)
    assert not (tmp_path / "st").exists()

    # a resume does not call it finished: the final model is written again from checkpoint-4
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        assert main("I", flags(assets, out) + RESUME) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert not any("nothing to do" in m for m in messages)
    assert any(f"does not match its completion marker ({expected}" in m for m in messages), messages
    assert_same_weights(out, reference)
    LLM2Vec.from_pretrained(str(out))  # intact again


def test_a_marker_with_an_entry_removed_is_refused(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    marker = json.loads((out / COMPLETE_MARKER).read_text())
    del marker["sha256"]["model.safetensors"]
    (out / COMPLETE_MARKER).write_text(json.dumps(marker))
    with pytest.raises(ModelFilesError, match=f"{COMPLETE_MARKER} gives no size or no SHA-256 for model.safetensors"):
        LLM2Vec.from_pretrained(str(out))


def test_a_run_cut_before_or_during_its_final_save_is_not_exported_until_resumed(assets, reference, tmp_path, capsys):
    cut = tmp_path / "cut"
    shutil.copytree(reference, cut)
    marker = json.loads((cut / COMPLETE_MARKER).read_text())
    (cut / COMPLETE_MARKER).unlink()  # the final save was moving its files into place when it stopped
    (cut / FINAL_SAVE_RECORD).write_text(json.dumps({"files": sorted(marker["files"])}))
    only_checkpoints = tmp_path / "early"
    only_checkpoints.mkdir()
    shutil.copytree(reference / "checkpoint-4", only_checkpoints / "checkpoint-4")
    for run_folder in (cut, only_checkpoints):
        assert export_sentence_transformers.main(export_argv(run_folder, tmp_path / "st")) == 2
        line = one_line(capsys.readouterr().err)
        assert f"base model {run_folder}: its run did not finish" in line and "resume it with the same command" in line
        assert not (tmp_path / "st").exists()
    assert main("I", flags(assets, cut) + RESUME) == 0  # the resume finishes the final save
    assert export_sentence_transformers.main(export_argv(cut, tmp_path / "st")) == 0


# -------------------------------------------------------------------------------------- links out of a folder


def test_a_chat_template_linked_outside_the_model_folder_is_never_read(assets, tmp_path, capsys):
    private = tmp_path / "private.txt"
    private.write_text(PRIVATE)
    model = tmp_path / "model"
    shutil.copytree(assets[0], model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    (model / "chat_template.jinja").symlink_to(private)
    with pytest.raises(ModelFilesError, match="its file chat_template.jinja links outside the folder") as refused:
        LLM2Vec.from_pretrained(str(model))
    assert PRIVATE.strip() not in str(refused.value) and str(private) not in str(refused.value)
    argv = ["--base_model_name_or_path", str(model), "--output_dir", str(tmp_path / "st"), "--no_verify_embeddings"]
    assert export_sentence_transformers.main([*argv, "--max_length", "64"]) == 2
    err = capsys.readouterr().err
    assert "chat_template.jinja links outside the folder" in one_line(err) and PRIVATE.strip() not in err
    assert not (tmp_path / "st").exists()


def test_a_hub_cache_snapshot_may_link_to_its_blobs(assets, tmp_path):
    """``models--org--name/snapshots/<rev>/<file> -> ../../blobs/<sha>``: the hub cache's own layout is read."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for path in Path(assets[0]).iterdir():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blobs / digest)
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    assert saved_folder_problem(snapshot) is None
    LLM2Vec.from_pretrained(str(snapshot))
    (snapshot / "extra.txt").symlink_to(tmp_path / "hub")  # anywhere else: refused
    assert "its file extra.txt links outside the folder" in saved_folder_problem(snapshot)


def test_no_save_copies_a_link(assets, reference, tmp_path):
    """A run cut during its final save is finished from its last checkpoint with the files its manifest lists: a link
    placed in the checkpoint is not copied, and a listed file replaced by a link makes the checkpoint damaged."""
    private = tmp_path / "private.txt"
    private.write_text(PRIVATE)
    out = unfinished_copy(reference, tmp_path / "run")
    (out / "checkpoint-4" / "notes.txt").symlink_to(private)
    assert main("I", flags(assets, out) + RESUME) == 0
    assert not (out / "notes.txt").exists() and "notes.txt" not in json.loads((out / COMPLETE_MARKER).read_text())
    assert not any(p.is_symlink() for p in out.iterdir())

    out = unfinished_copy(reference, tmp_path / "linked")
    listed = out / "checkpoint-4" / "llm2vec_config.json"
    shutil.copyfile(listed, private)
    listed.unlink()
    listed.symlink_to(private)
    manifest = json.loads((out / "checkpoint-4" / CHECKPOINT_MANIFEST).read_text())
    assert "llm2vec_config.json" in manifest["files"]
    assert main("I", flags(assets, out) + RESUME) == 0  # checkpoint-4 skipped: resumed from checkpoint-2
    assert not any(p.is_symlink() for p in out.iterdir())
    assert_same_weights(out, reference)
    assert not listed.is_symlink()  # checkpoint-4 written again, as a save writes it


# ------------------------------------------------------------------------------------------------- disk space


def test_not_enough_disk_space_is_refused_before_training(assets, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 200_000, 200_000))
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"200.0 KB free, but this run writes about .*3 checkpoint\(s\)"):
        run("I", six_step_flags(assets, out))
    assert os.listdir(out) == []
    run("I", six_step_flags(assets, out, save_strategy="no"))  # the final model alone fits


def tensor_bytes(safetensors_file: Path) -> int:
    """The bytes of the tensors in a safetensors file: its size less the 8-byte length and the JSON header."""
    with open(safetensors_file, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return safetensors_file.stat().st_size - 8 - header


@pytest.mark.parametrize("stage", ["I", "II"])
def test_disk_estimate_matches_what_a_run_writes(references, stage):
    folders, trainers = references
    trainer = trainers[stage]
    estimate = startup_checks.estimate_disk(trainer.args, trainer.model, 0, 6, STEPS_PER_EPOCH)
    assert estimate.checkpoints == 3  # checkpoint-2, -4, -6
    ckpt = folders[stage] / "checkpoint-6"
    assert sum(tensor_bytes(p) for p in ckpt.glob("*.safetensors")) == estimate.weights
    # optimizer.pt: the two AdamW moments, plus torch.save's few hundred bytes per tensor
    moments = 2 * sum(p.requires_grad for p in trainer.model.parameters())
    assert estimate.optimizer <= (ckpt / "optimizer.pt").stat().st_size <= estimate.optimizer + 1024 * moments
    trainer.args.save_total_limit = 1
    try:
        assert startup_checks.estimate_disk(trainer.args, trainer.model, 0, 6, STEPS_PER_EPOCH).checkpoints == 2
        assert startup_checks.estimate_disk(trainer.args, trainer.model, 4, 6, STEPS_PER_EPOCH).checkpoints == 1
    finally:
        trainer.args.save_total_limit = None


def test_a_full_disk_is_one_line(assets, tmp_path, capsys, monkeypatch):
    import errno

    def full(self, output_dir):
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir) / "optimizer.pt"))

    monkeypatch.setattr(LLM2VecTrainer, "_save_optimizer_and_scheduler", full)
    assert main("I", flags(assets, tmp_path / "run")) == 1
    err = one_line_error(capsys)
    assert "optimizer.pt: no space left on device while writing" in err and "--resume_from_checkpoint true" in err
