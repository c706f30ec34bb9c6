"""An adapter loads only onto the base it was trained on, and only whole, wherever adapters load (Stage II
training and its resume, ``LLM2Vec.from_pretrained``, evaluation, the export): a folder that is not an adapter, one
that does not fit the base, one trained on another base, one missing a tensor its ``adapter_config.json`` implies or
whose config and weights disagree is refused in one line. Its tensors are exactly those peft creates for its
``adapter_config.json`` on the base, and the base is identified by the SHA-256 of its weights files, not by their
first MiB. ``accept_other_base=True`` (a strict boolean) is the one override, for the base only. A folder that a
live run holds is not read as a model or an adapter.

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
from _drivers import GOOD, export_argv, lock_held_elsewhere, one_line, one_line_error, tiny_run_flags, write_beir
from _drivers import run_flags as flags
from _tiny_data import write_tiny_e5
from safetensors.torch import load_file, save_file

from llm2vec import LLM2Vec
from llm2vec.io import file_digest
from llm2vec.model_files import ModelFilesError
from llm2vec.run.folder import CHECKPOINT_MANIFEST
from llm2vec.testing import save_tiny_model
from llm2vec.training import main, run

export_main = export_sentence_transformers.main
eval_main = mteb_eval_custom.main
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _threads(keep_thread_count):
    """Every test here leaves torch's thread count as it found it."""


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


def adapter_export_argv(base, adapter, out, *extra) -> list[str]:
    return [
        *("--base_model_name_or_path", str(base), "--peft_model_name_or_path", str(adapter), "--output_dir", str(out)),
        *("--max_length", "64", "--query_instruction", "", "--no_verify_embeddings", *extra),
    ]


def error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


def trained_flags(trained, out, **fields) -> list[str]:
    """The flags of the ``trained`` fixture's Stage II run into ``out``, with ``fields`` changed."""
    settings = dict(num_threads=1, disable_tqdm="true", max_seq_length=64)
    return tiny_run_flags(trained["base"], trained["data"], out, **settings, **{**trained["fields"], **fields})


# ------------------------------------------------------------------- a folder that is no adapter of this base


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
    beir = write_beir(tmp_path / "beir", **GOOD)
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


def test_an_adapter_of_another_shape_is_one_line(assets, tmp_path, capsys):
    wider = save_tiny_model("llama3", tmp_path / "wider", hidden_size=48)
    run("II", flags((wider, assets[1]), tmp_path / "adapter", "II", max_steps=1, save_strategy="no"))
    capsys.readouterr()
    argv = flags(assets, tmp_path / "run", "II", peft_model_name_or_path=tmp_path / "adapter")
    assert main("II", argv) == 2
    err = one_line_error(capsys)
    # read from the safetensors headers before anything loads (llm2vec.model_files.check_adapter)
    assert f"adapter {tmp_path / 'adapter'} does not fit the base model {assets[0]}: its layer " in err, err
    assert "has 96 inputs, the base model's 64" in err and "traceback" not in err, err


# ------------------------------------------------------------------------------------------- a tensor missing


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
    assert export_main(adapter_export_argv(trained["base"], checkpoint, tmp_path / "st")) == 2
    assert f"has no tensor {dropped}" in error_line(capsys)
    assert not (tmp_path / "st").exists()


def test_a_stage_II_resume_from_a_checkpoint_missing_a_tensor_is_refused(trained, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("checkpoint-1", "checkpoint-2"):
        copy_adapter(trained["adapter"] / name, out / name)
    dropped = drop_one_lora_b(out / "checkpoint-2")
    argv = trained_flags(trained, out, max_steps=3)
    assert main("II", [*argv, "--resume_from_checkpoint", "true"]) == 2
    assert f"has no tensor {dropped}" in error_line(capsys)


# ----------------------------------------------------------------------------------------- config and weights


def test_an_adapter_config_that_does_not_match_its_weights_is_refused(trained, tmp_path):
    adapter = copy_adapter(trained["adapter"], tmp_path / "adapter")
    (adapter / "training_complete.json").unlink()  # edited by hand below: not a finished run's folder any more
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert len(config["target_modules"]) == 7
    config["target_modules"] = ["q_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    message = one_line_refusal(lambda: load(trained["base"], adapter))
    assert f"adapter {adapter}: adapter_model.safetensors holds " in message, message
    assert "that no module of its adapter_config.json uses (first: base_model.model.layers.0" in message, message
    assert 'target_modules ["q_proj"]' in message, message
    one_line_refusal(lambda: load(trained["base"], adapter, accept_other_base=True))

    config["target_modules"] = sorted(
        json.loads((trained["adapter"] / "adapter_config.json").read_text())["target_modules"]
    )
    config["r"] = 8  # the weights have rank 4
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    message = one_line_refusal(lambda: load(trained["base"], adapter))
    assert "down_proj.lora_A.weight has shape [4, 64], its adapter_config.json implies [8, 64] (r=8)" in message


# --------------------------------------------------------------------------------------------------- the base


def test_an_adapter_without_a_run_record_loads_only_on_the_base_its_config_names(trained, tmp_path, caplog):
    adapter = copy_adapter(trained["adapter"], tmp_path / "adapter")
    (adapter / "run_config.json").unlink()
    (adapter / "training_complete.json").unlink()  # edited by hand: not a finished run's folder any more
    other = save_tiny_model("llama3", tmp_path / "other", seed=1)
    message = one_line_refusal(lambda: load(other, adapter))
    assert (
        f"adapter {adapter} was trained on the base model {trained['base']} (its adapter_config.json names" in message
    )
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
    assert (
        f"adapter {adapter}: the base model it was trained on cannot be identified (its adapter_config.json " in message
    )
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
    assert export_main(adapter_export_argv(other, adapter, tmp_path / "st")) == 2
    assert "other contents: its SHA-256 differs" in error_line(capsys)
    assert export_main(adapter_export_argv(other, adapter, tmp_path / "st", "--accept_other_base")) == 0


def test_a_stage_II_resume_on_a_base_changed_after_its_first_mib_is_refused(trained, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    copy_adapter(trained["adapter"] / "checkpoint-1", out / "checkpoint-1")
    argv = trained_flags(trained, out)
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
    import llm2vec.io

    calls, read = [], llm2vec.io._read_sha256
    monkeypatch.setattr(llm2vec.io, "_WHOLE_FILE_SHA256", {})

    def whole_file_hash(path, limit, digest):  # the first-MiB hashes are not the ones cached
        calls.extend([path] if limit is None else [])
        return read(path, limit, digest)

    monkeypatch.setattr(llm2vec.io, "_read_sha256", whole_file_hash)
    load(trained["base"], trained["adapter"])
    hashed = len(calls)
    load(trained["base"], trained["adapter"])
    assert hashed and len(calls) == hashed


# ---------------------------------------------------------------------------------------- a live run's folder


def test_a_folder_a_live_run_holds_is_not_read(trained, tmp_path, capsys):
    adapter = copy_adapter(trained["adapter"], tmp_path / "run")
    with lock_held_elsewhere(adapter) as pid:
        message = one_line_refusal(lambda: load(trained["base"], adapter / "checkpoint-1"))
        assert f"adapter {adapter / 'checkpoint-1'}: {adapter} is in use by a live run: process {pid} on " in message
        message = one_line_refusal(lambda: LLM2Vec.from_pretrained(str(adapter), device="cpu"))
        assert f"model {adapter}: {adapter} is in use by a live run: process {pid}" in message, message
        assert export_main(adapter_export_argv(trained["base"], adapter, tmp_path / "st")) == 2
        assert f"is in use by a live run: process {pid}" in error_line(capsys)
        argv = ["--base_model_name_or_path", str(trained["base"]), "--peft_model_name_or_path", str(adapter)]
        argv += ["--local_retrieval_dir", str(write_beir(tmp_path / "beir", **GOOD)), "--local_instruction", ""]
        argv += ["--output_dir", str(tmp_path / "e")]
        assert eval_main([*argv, "--device", "cpu"]) == 2
        assert f"is in use by a live run: process {pid}" in error_line(capsys)
    load(trained["base"], adapter)  # the holder is gone: its stale lock file stops nothing
