"""An adapter loads only onto the base it was trained on, and only whole: its tensors are exactly those peft creates
for its ``adapter_config.json`` on the base, and the base is identified by the SHA-256 of its weights files, not
by their first MiB. ``accept_other_base=True`` (a strict boolean) is the one override, for the base only. A folder
that a live run holds is not read as a model or an adapter.

References are independent of the code under test: tensors removed and bytes changed by hand, files listed with
safetensors, a separate process that holds the run lock.
"""

import json
import logging
import os
import shutil
import struct
from pathlib import Path

import export_sentence_transformers
import mteb_eval_custom
import pytest
from _drivers import lock_held_elsewhere, tiny_run_flags
from safetensors.torch import load_file, save_file

from llm2vec import LLM2Vec
from llm2vec.io import file_digest, sha256_file
from llm2vec.model_files import ModelFilesError
from llm2vec.run.folder import CHECKPOINT_MANIFEST
from llm2vec.testing import save_tiny_model, write_tiny_e5
from llm2vec.training import main, run

export_main = export_sentence_transformers.main
eval_main = mteb_eval_custom.main
MIB = 1 << 20


def pad_header_past_one_mib(path: Path) -> None:
    """Rewrite a safetensors file with its JSON header padded by spaces (the format allows it) to more than a MiB,
    so that every tensor's bytes lie after the first MiB."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n] + b" " * (MIB + 64 - n)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])


def flip_last_bytes(path: Path) -> None:
    """Change the last 16 bytes of a file (the last tensor's data), keeping its size and modification time."""
    stat = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-16:] = bytes(255 - b for b in raw[-16:])
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A base whose weights file holds all its tensors after its first MiB, a 2-step Stage II run on it (checkpoints
    1 and 2), and the data."""
    root = tmp_path_factory.mktemp("strict")
    base = save_tiny_model("llama3", root / "base")
    pad_header_past_one_mib(base / "model.safetensors")
    data = write_tiny_e5(root / "data", n=16)
    out = root / "stage_II"
    fields = dict(stage="II", lora_r=4, lora_alpha=8, max_steps=2, save_steps=1, learning_rate=1e-3)
    run("II", tiny_run_flags(base, data, out, num_threads=1, disable_tqdm="true", max_seq_length=64, **fields))
    return {"base": base, "data": data, "adapter": out, "root": root, "fields": fields}


def copy_adapter(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def one_line_refusal(call) -> str:
    with pytest.raises(ModelFilesError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def load(base, adapter, **kwargs):
    return LLM2Vec.from_pretrained(str(base), str(adapter), device="cpu", **kwargs)


def export_argv(base, adapter, out, *extra) -> list[str]:
    return [
        *("--base_model_name_or_path", str(base), "--peft_model_name_or_path", str(adapter), "--output_dir", str(out)),
        *("--max_length", "64", "--query_instruction", "", "--no_verify_embeddings", *extra),
    ]


def error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


# ---------------------------------------------------------------------------------------------- a tensor missing


def drop_one_lora_b(checkpoint: Path) -> str:
    """Remove one lora_B tensor from the checkpoint's adapter and rewrite its manifest to match; returns its name."""
    weights = checkpoint / "adapter_model.safetensors"
    tensors = load_file(weights)
    dropped = sorted(k for k in tensors if ".lora_B." in k)[0]
    del tensors[dropped]
    save_file(tensors, weights)
    manifest = json.loads((checkpoint / CHECKPOINT_MANIFEST).read_text())
    manifest["sha256"]["adapter_model.safetensors"] = file_digest([weights])
    manifest["files"]["adapter_model.safetensors"] = weights.stat().st_size
    (checkpoint / CHECKPOINT_MANIFEST).write_text(json.dumps(manifest))
    return dropped


def test_an_adapter_missing_a_tensor_its_config_implies_is_refused_naming_it(trained, tmp_path, capsys):
    checkpoint = copy_adapter(trained["adapter"] / "checkpoint-2", tmp_path / "checkpoint-2")
    dropped = drop_one_lora_b(checkpoint)
    message = one_line_refusal(lambda: load(trained["base"], checkpoint))
    assert f"adapter {checkpoint}: adapter_model.safetensors has no tensor {dropped}" in message, message
    assert "which its adapter_config.json implies" in message, message
    # the override is for the base only: an incomplete adapter never loads
    one_line_refusal(lambda: load(trained["base"], checkpoint, accept_other_base=True))
    assert export_main(export_argv(trained["base"], checkpoint, tmp_path / "st")) == 2
    assert f"has no tensor {dropped}" in error_line(capsys)
    assert not (tmp_path / "st").exists()


def test_a_stage_II_resume_from_a_checkpoint_missing_a_tensor_is_refused(trained, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("checkpoint-1", "checkpoint-2"):
        copy_adapter(trained["adapter"] / name, out / name)
    dropped = drop_one_lora_b(out / "checkpoint-2")
    argv = tiny_run_flags(
        trained["base"], trained["data"], out, num_threads=1, disable_tqdm="true", max_seq_length=64,
        **{**trained["fields"], "max_steps": 3},
    )
    assert main("II", [*argv, "--resume_from_checkpoint", "true"]) == 2
    assert f"has no tensor {dropped}" in error_line(capsys)


# ---------------------------------------------------------------------------------------------- config and weights


def test_an_adapter_config_that_does_not_match_its_weights_is_refused(trained, tmp_path):
    adapter = copy_adapter(trained["adapter"], tmp_path / "adapter")
    (adapter / "training_complete.json").unlink()  # edited by hand below: not a finished run's folder any more
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert len(config["target_modules"]) == 7
    config["target_modules"] = ["q_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    message = one_line_refusal(lambda: load(trained["base"], adapter))
    assert f"adapter {adapter}: adapter_model.safetensors holds " in message, message
    assert 'that no module of its adapter_config.json uses (first: base_model.model.layers.0' in message, message
    assert 'target_modules ["q_proj"]' in message, message
    one_line_refusal(lambda: load(trained["base"], adapter, accept_other_base=True))

    config["target_modules"] = sorted(json.loads((trained["adapter"] / "adapter_config.json").read_text())[
        "target_modules"
    ])
    config["r"] = 8  # the weights have rank 4
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    message = one_line_refusal(lambda: load(trained["base"], adapter))
    assert "down_proj.lora_A.weight has shape [4, 64], its adapter_config.json implies [8, 64] (r=8)" in message


# ---------------------------------------------------------------------------------------------- the base


def test_an_adapter_without_a_run_record_loads_only_on_the_base_its_config_names(trained, tmp_path, caplog):
    adapter = copy_adapter(trained["adapter"], tmp_path / "adapter")
    (adapter / "run_config.json").unlink()
    (adapter / "training_complete.json").unlink()  # edited by hand: not a finished run's folder any more
    other = save_tiny_model("llama3", tmp_path / "other", seed=1)
    message = one_line_refusal(lambda: load(other, adapter))
    assert f"adapter {adapter} was trained on the base model {trained['base']} (its adapter_config.json names" in message
    assert f"but the base model {other} is another one: its model.safetensors differs" in message, message
    assert "--accept_other_base" in message
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        load(other, adapter, accept_other_base=True)
    assert any(r.getMessage().startswith(f"accept_other_base: adapter {adapter}") for r in caplog.records)
    load(trained["base"], adapter)  # the base it names loads without a word

    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")  # a base that is not here cannot be compared
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    message = one_line_refusal(lambda: load(trained["base"], adapter))
    assert f"adapter {adapter}: the base model it was trained on cannot be identified (its adapter_config.json " in message
    assert f"names the base model {tmp_path / 'gone'}, which is not here to compare)" in message, message
    load(trained["base"], adapter, accept_other_base=True)


def test_a_base_that_differs_only_after_its_first_mib_is_another_base(trained, tmp_path, capsys):
    other = Path(shutil.copytree(trained["base"], tmp_path / "other"))
    weights = other / "model.safetensors"
    head = weights.read_bytes()[:MIB]
    flip_last_bytes(weights)
    assert weights.read_bytes()[:MIB] == head and weights.stat().st_size > MIB
    adapter = trained["adapter"]
    message = one_line_refusal(lambda: load(other, adapter))
    assert f"adapter {adapter} was trained on the base model {trained['base']} (its run_config.json records" in message
    assert "its model.safetensors differs from the recorded base's (other contents: its SHA-256 differs)" in message
    load(other, adapter, accept_other_base=True)
    assert export_main(export_argv(other, adapter, tmp_path / "st")) == 2
    assert "other contents: its SHA-256 differs" in error_line(capsys)
    assert export_main(export_argv(other, adapter, tmp_path / "st", "--accept_other_base")) == 0


def test_a_stage_II_resume_on_a_base_changed_after_its_first_mib_is_refused(trained, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    copy_adapter(trained["adapter"] / "checkpoint-1", out / "checkpoint-1")
    argv = tiny_run_flags(
        trained["base"], trained["data"], out, num_threads=1, disable_tqdm="true", max_seq_length=64, **trained["fields"]
    )
    weights = trained["base"] / "model.safetensors"
    flip_last_bytes(weights)  # the recorded base itself, same size and modification time; put back afterwards
    try:
        assert main("II", [*argv, "--resume_from_checkpoint", "true"]) == 2
    finally:
        flip_last_bytes(weights)
    line = error_line(capsys)
    assert f"resume_from_checkpoint {out / 'checkpoint-1'}: what it was trained with changed" in line, line
    assert "base_model file model.safetensors" in line, line


def test_accept_other_base_is_a_strict_boolean(trained):
    with pytest.raises(TypeError, match="accept_other_base"):
        load(trained["base"], trained["adapter"], accept_other_base="false")


def test_the_base_is_hashed_once_per_process(trained, monkeypatch):
    import llm2vec.fingerprints as fingerprints

    calls = []
    monkeypatch.setattr(fingerprints, "_DIGESTS", {})
    def whole_file_hash(path, limit=None, digest=None):  # the first-MiB hashes are not the ones cached
        calls.extend([path] if limit is None else [])
        return sha256_file(path, limit, digest)

    monkeypatch.setattr(fingerprints, "sha256_file", whole_file_hash)
    load(trained["base"], trained["adapter"])
    hashed = len(calls)
    load(trained["base"], trained["adapter"])
    assert hashed and len(calls) == hashed


# ---------------------------------------------------------------------------------------------- a live run's folder


def beir_folder(folder: Path) -> Path:
    folder.mkdir()
    texts = ["Return the length of a list.", "Open a file for reading."]
    rows = {
        "corpus.jsonl": [{"_id": f"d{i}", "title": "", "text": t} for i, t in enumerate(texts)],
        "queries.jsonl": [{"_id": f"q{i}", "text": t} for i, t in enumerate(texts)],
        "qrels.jsonl": [{"query-id": f"q{i}", "corpus-id": f"d{i}", "score": 1} for i in range(len(texts))],
    }
    for name, records in rows.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_a_folder_a_live_run_holds_is_not_read(trained, tmp_path, capsys):
    adapter = copy_adapter(trained["adapter"], tmp_path / "run")
    with lock_held_elsewhere(adapter) as pid:
        message = one_line_refusal(lambda: load(trained["base"], adapter / "checkpoint-1"))
        assert f"adapter {adapter / 'checkpoint-1'}: {adapter} is in use by a live run: process {pid} on " in message
        message = one_line_refusal(lambda: LLM2Vec.from_pretrained(str(adapter), device="cpu"))
        assert f"model {adapter}: {adapter} is in use by a live run: process {pid}" in message, message
        assert export_main(export_argv(trained["base"], adapter, tmp_path / "st")) == 2
        assert f"is in use by a live run: process {pid}" in error_line(capsys)
        argv = ["--base_model_name_or_path", str(trained["base"]), "--peft_model_name_or_path", str(adapter)]
        argv += ["--local_retrieval_dir", str(beir_folder(tmp_path / "beir")), "--local_instruction", ""]
        argv += ["--output_dir", str(tmp_path / "e")]
        assert eval_main([*argv, "--device", "cpu"]) == 2
        assert f"is in use by a live run: process {pid}" in error_line(capsys)
    load(trained["base"], adapter)  # the holder is gone: its stale lock file stops nothing
