"""A saved folder is trusted by its content: a run's final model and an export are read (resume, ``from_pretrained``,
the export) only while every file matches the size and SHA-256 its save recorded last; a record without an entry's
hash is damage. A model folder's file that links outside the folder is refused before anything reads it (a Hugging
Face cache snapshot's links to its blobs aside), and no save copies a link.

References are independent of the code under test: bytes flipped and links made here, hashlib over the files.
"""

import hashlib
import json
import logging
import shutil
from pathlib import Path

import export_sentence_transformers
import pytest
from _drivers import assert_same_weights, one_line, tiny_run_flags, unfinished_copy

from llm2vec import LLM2Vec
from llm2vec.io import COMPLETE_MARKER, saved_folder_problem
from llm2vec.model_files import ModelFilesError
from llm2vec.run.folder import CHECKPOINT_MANIFEST
from llm2vec.training import main, run

RESUME = ["--resume_from_checkpoint", "true"]
PRIVATE = "the user's private text, never to be read\n"


@pytest.fixture(autouse=True)
def _threads(keep_thread_count):
    """Every test here leaves torch's thread count as it found it."""


def flags(assets, out, **fields) -> list[str]:
    model, data = assets
    settings = dict(learning_rate=1e-3, max_steps=4, save_steps=2, num_threads=1, disable_tqdm="true")
    return tiny_run_flags(model, data, out, **{"max_seq_length": 64, **settings, **fields})


@pytest.fixture(scope="module")
def finished(assets, tmp_path_factory):
    """A finished 4-step Stage I run (checkpoints 2 and 4, the final model, its marker)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run("I", flags(assets, out))
    return out


def flip_middle_bytes(path: Path) -> None:
    """16 bytes in the middle of ``path`` inverted: the same size, a header that still reads, other contents."""
    raw = bytearray(path.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 16] = bytes(255 - b for b in raw[middle : middle + 16])
    path.write_bytes(bytes(raw))


def test_the_marker_records_the_sha256_of_every_file_the_final_save_wrote(finished):
    marker = json.loads((finished / COMPLETE_MARKER).read_text())
    assert set(marker["sha256"]) == set(marker["files"]) >= {"model.safetensors", "run_config.json", "README.md"}
    for name, recorded in marker["sha256"].items():
        assert recorded == hashlib.sha256((finished / name).read_bytes()).hexdigest(), name


def test_a_flipped_bit_in_a_finished_model_is_refused_by_resume_from_pretrained_and_export(
    assets, finished, tmp_path, capsys, caplog
):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
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
    assert_same_weights(out, finished)
    LLM2Vec.from_pretrained(str(out))  # intact again


def test_a_marker_with_an_entry_removed_is_refused(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    marker = json.loads((out / COMPLETE_MARKER).read_text())
    del marker["sha256"]["model.safetensors"]
    (out / COMPLETE_MARKER).write_text(json.dumps(marker))
    with pytest.raises(ModelFilesError, match=f"{COMPLETE_MARKER} gives no size or no SHA-256 for model.safetensors"):
        LLM2Vec.from_pretrained(str(out))


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


def test_no_save_copies_a_link(assets, finished, tmp_path):
    """A run cut during its final save is finished from its last checkpoint with the files its manifest lists: a link
    placed in the checkpoint is not copied, and a listed file replaced by a link makes the checkpoint damaged."""
    private = tmp_path / "private.txt"
    private.write_text(PRIVATE)
    out = unfinished_copy(finished, tmp_path / "run")
    (out / "checkpoint-4" / "notes.txt").symlink_to(private)
    assert main("I", flags(assets, out) + RESUME) == 0
    assert not (out / "notes.txt").exists() and "notes.txt" not in json.loads((out / COMPLETE_MARKER).read_text())
    assert not any(p.is_symlink() for p in out.iterdir())

    out = unfinished_copy(finished, tmp_path / "linked")
    listed = out / "checkpoint-4" / "llm2vec_config.json"
    shutil.copyfile(listed, private)
    listed.unlink()
    listed.symlink_to(private)
    manifest = json.loads((out / "checkpoint-4" / CHECKPOINT_MANIFEST).read_text())
    assert "llm2vec_config.json" in manifest["files"]
    assert main("I", flags(assets, out) + RESUME) == 0  # checkpoint-4 skipped: resumed from checkpoint-2
    assert not any(p.is_symlink() for p in out.iterdir())
    assert_same_weights(out, finished)
    assert not listed.is_symlink()  # checkpoint-4 written again, as a save writes it
