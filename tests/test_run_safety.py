"""Never train on, save or report a broken state, one section per class:

1. a diverged run stops at the step, saving nothing;      5. values that cannot make a run are refused;
2. a resume restores everything or skips what it cannot;  6. a data line tokenization rejects is found at load;
3. one run per output folder;                             7. files the run did not write are not overwritten;
4. booleans and numbers are read strictly;                8. a resume after the inputs changed is noticed.

References are independent of the code under test: the weights of an uninterrupted run, ``torch.isfinite`` on
the saved tensors, values and line numbers written literally here, a separate process holding the lock.
"""

import json
import logging
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from _drivers import assert_same_weights, lock_held_elsewhere, saved_weights, unfinished_copy

from llm2vec import training
from llm2vec.arguments import ConfigError, parse_config
from llm2vec.run.folder import CHECKPOINT_MANIFEST, COMPLETE_MARKER
from llm2vec.run.lock import LOCK_NAME
from llm2vec.testing import save_tiny_model
from llm2vec.trainer import LLM2VecTrainer, TrainingDiverged
from llm2vec.training import main, run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _threads(keep_thread_count):
    """Every test here leaves torch's thread count as it found it."""


def flags(assets, out, stage="I", **overrides) -> list[str]:
    model, data = assets
    args = {
        "model_name_or_path": model,
        "output_dir": out,
        "dataset_file_path": data,
        "e5_sources": '["nq","fever"]',
        "learning_rate": 1e-3,
        "warmup_steps": 0,
        "max_steps": 4,
        "save_steps": 2,
        "per_device_train_batch_size": 4,
        "use_cpu": "true",
        "seed": 7,
        "logging_steps": 1,
        "num_threads": 1,
        "disable_tqdm": "true",
        "max_seq_length": 64,
    }
    if stage == "II":
        args.update(stage="II", lora_r=4, lora_alpha=8)
    args.update(overrides)
    return [x for k, v in args.items() for x in (f"--{k}", str(v))]


RESUME = ["--resume_from_checkpoint", "true"]


def files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def one_line_error(capsys) -> str:
    """The one ``error:`` line on stderr (progress bars of weight loading aside), with no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """An uninterrupted 4-step Stage I run (checkpoints 2 and 4): the reference of every resumed run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    n = torch.get_num_threads()
    try:
        run("I", flags(assets, out))
    finally:
        torch.set_num_threads(n)
    return out


# ---------------------------------------------------------------------------------------------- 1. divergence


@pytest.mark.parametrize("stage, diverges_at", [("I", 2), ("II", 3)])
def test_a_diverging_run_stops_at_that_step_and_saves_nothing_broken(assets, tmp_path, capsys, stage, diverges_at):
    """Learning rate 1e3: the gradient norm turns NaN (measured without this check: step 2 in Stage I, step 3 in
    Stage II, and the run then saved NaN weights as finished, logging the loss as 0)."""
    out = tmp_path / "run"
    code = main(stage, flags(assets, out, stage, learning_rate=1e3, save_steps=1, max_steps=6, max_grad_norm=0))
    err = one_line_error(capsys)
    assert code == 3, err
    assert f"training diverged at step {diverges_at}: " in err and "nan" in err, err
    assert f"the last finite checkpoint is {out / f'checkpoint-{diverges_at - 1}'}" in err, err
    assert not (out / COMPLETE_MARKER).exists()
    assert not list(out.glob("*.safetensors")), os.listdir(out)  # no final model
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in range(1, diverges_at)]
    for ckpt in out.glob("checkpoint-*"):
        assert all(torch.isfinite(t).all() for t in saved_weights(ckpt).values())
        history = json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
        assert all(math.isfinite(v) and v != 0 for h in history for k, v in h.items() if k.startswith("loss")), history


def test_the_message_names_the_loss_part_that_is_not_finite(assets, reference, tmp_path, monkeypatch):
    """A NaN in one loss part (here injected into the model's q2d loss at step 2) is named; the step is not applied."""
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    forward = LLM2Vec_q2d_d2q.forward
    calls = {"n": 0}

    def nan_q2d_at_step_2(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2 and self.training:
            output.loss_q2d = output.loss_q2d * float("nan")
        return output

    monkeypatch.setattr(LLM2Vec_q2d_d2q, "forward", nan_q2d_at_step_2)
    with pytest.raises(TrainingDiverged, match=r"step 2: loss_q2d nan; the step was not applied") as caught:
        run("I", flags(assets, tmp_path / "run", save_steps=1))
    assert "loss_d2q" not in str(caught.value) and "grad_norm" not in str(caught.value)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-1"]


def test_weights_that_are_not_finite_are_never_saved(assets, tmp_path):
    trainer = run("I", flags(assets, tmp_path / "run", max_steps=1, save_strategy="no"))
    with torch.no_grad():
        next(trainer.model.parameters())[0, 0] = float("inf")
    with pytest.raises(TrainingDiverged, match="NaN or infinite values at step 1; checkpoint-1 was not written"):
        trainer._save_checkpoint(trainer.model, None)
    assert not list((tmp_path / "run").glob("checkpoint-*"))


# ---------------------------------------------------------------------------------------------- 2. resume


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


# ---------------------------------------------------------------------------------------------- 3. one run per folder


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


# ---------------------------------------------------------------------------------------------- 4. strict values


BASE = ["--model_name_or_path", "m", "--output_dir", "o"]


def test_booleans_take_true_or_false_only(tmp_path):
    read = {
        "False": False,
        "false": False,
        "FALSE": False,
        "0": False,
        "True": True,
        "true": True,
        "1": True,
    }
    for text, value in read.items():
        config = parse_config("I", BASE + ["--overwrite_output_dir", text, "--query_instructions", text])
        assert config.stage.overwrite_output_dir is value and config.data.query_instructions is value, text
    assert parse_config("I", BASE + ["--disable_tqdm"]).training.disable_tqdm is True  # a flag alone means true
    path = tmp_path / "c.json"
    for raw, value in (("false", False), (False, False), (0, False), ("true", True)):
        path.write_text(json.dumps({"model_name_or_path": "m", "output_dir": "o", "query_instructions": raw}))
        assert parse_config("I", [str(path)]).data.query_instructions is value, raw
    for raw in ("no", "yes", "", 2, None, [True]):
        path.write_text(json.dumps({"model_name_or_path": "m", "output_dir": "o", "query_instructions": raw}))
        with pytest.raises(ConfigError, match=f"{path}: query_instructions"):
            parse_config("I", [str(path)])
    with pytest.raises(ConfigError, match="overwrite_output_dir='nope': a true/false field takes true or false"):
        parse_config("I", BASE + ["--overwrite_output_dir", "nope"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "6.7"], "max_steps=6.7: expected a whole number"),
        (["--max_steps", "ten"], "max_steps='ten': expected a whole number"),
        (["--max_steps", "true"], "max_steps='true': expected a whole number"),
        (["--learning_rate", "fast"], "learning_rate='fast': expected a number"),
        (["--learning_rate", "nan"], "learning_rate=nan: expected a finite number"),
        (["--max_seq_length", "null"], "max_seq_length='null': expected a whole number"),
        (["--max_steps"], "--max_steps is given without a value"),
        (["--seed", "1", "2"], "--seed is given 2 values"),
        (["--template", "5", "--alpha", "0.5"], None),  # a string field keeps "5" as text
    ],
)
def test_every_type_is_read_strictly(argv, message):
    if message is None:
        config = parse_config("I", BASE + argv)
        assert config.model.template == "5" and config.stage.alpha == 0.5
        return
    with pytest.raises(ConfigError) as caught:
        parse_config("I", BASE + argv)
    assert str(caught.value).startswith(f"command line: {message}"), caught.value


@pytest.mark.parametrize(
    "field, value", [("max_steps", 6.7), ("learning_rate", "fast"), ("max_seq_length", None), ("template", 5)]
)
def test_a_json_value_of_the_wrong_type_is_refused(tmp_path, field, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_name_or_path": "m", "output_dir": "o", field: value}))
    with pytest.raises(ConfigError, match=f"^{path}: {field}"):
        parse_config("I", [str(path)])


def test_overwrite_output_dir_false_keeps_a_finished_run(assets, reference, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    before = files(out)
    assert main("I", flags(assets, out, learning_rate=2e-3, overwrite_output_dir="False")) == 2
    assert "already holds a finished Stage I run" in one_line_error(capsys)
    assert files(out) == before


# ---------------------------------------------------------------------------------------------- 5. ranges


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_train_epochs", -1, "num_train_epochs=-1: must be > 0"),
        ("num_train_epochs", 0, "num_train_epochs=0: must be > 0"),
        ("max_steps", 0, "max_steps=0: must be >= 1, or -1"),
        ("max_steps", -5, "max_steps=-5: must be >= 1, or -1"),
        ("per_device_train_batch_size", 0, "per_device_train_batch_size=0: must be >= 1"),
        ("per_device_train_batch_size", -4, "per_device_train_batch_size=-4: must be >= 1"),
        ("gradient_accumulation_steps", 0, "gradient_accumulation_steps=0: must be >= 1"),
        ("learning_rate", -0.001, "learning_rate=-0.001: must be > 0"),
        ("save_steps", 0, "save_steps=0: must be > 0"),
        ("adam_beta2", 1, "adam_beta2=1: must be >= 0 and < 1"),
        ("warmup_steps", -3, "warmup_steps=-3: must be >= 0"),
    ],
)
def test_a_value_out_of_range_is_one_line_before_anything_is_written(assets, tmp_path, capsys, field, value, message):
    out = tmp_path / "run"
    assert main("I", flags(assets, out, **{"num_train_epochs": 1, field: value})) == 2
    assert one_line_error(capsys) == f"error: command line: {message}"
    assert not out.exists()


BIG = 10**30


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("per_device_train_batch_size", BIG, f"per_device_train_batch_size={BIG}: must be >= 1 and <= 2147483647"),
        ("max_steps", BIG, f"max_steps={BIG}: must be >= 1 and <= 2147483647, or -1"),
        (
            "gradient_accumulation_steps",
            2**31,
            "gradient_accumulation_steps=2147483648: must be >= 1 and <= 2147483647",
        ),
        ("save_steps", BIG, f"save_steps={BIG}: must be > 0 and <= 2147483647"),
        ("num_train_epochs", 1e30, "num_train_epochs=1e+30: must be > 0 and <= 2147483647"),
        ("max_seq_length", BIG, f"max_seq_length={BIG}: must be <= 2147483647"),
        ("max_seq_length", -BIG, f"max_seq_length={-BIG}: must be >= -2147483647"),
        ("num_threads", BIG, f"num_threads={BIG}: must be <= 2147483647"),
    ],
)
def test_an_absurd_number_is_refused_by_field_with_its_range(assets, tmp_path, capsys, field, value, message):
    """Measured before this check: num_threads 10**30 ended in a traceback, max_steps 10**30 was refused by the
    disk check for 10**21 TB of checkpoints, and max_seq_length 10**30 trained."""
    out = tmp_path / "run"
    assert main("I", flags(assets, out, **{field: value})) == 2
    assert one_line_error(capsys) == f"error: command line: {message}"
    assert not out.exists()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_threads", 5000, "num_threads=5000: must be from 1 to 1024 (or leave it unset)"),
        ("dataloader_num_workers", 5000, "dataloader_num_workers=5000: must be >= 0 and <= 1024"),
    ],
)
def test_more_threads_or_workers_than_any_machine_has_are_refused(field, value, message):
    """Read, not run: without the check, 2**31 - 1 threads abort in the OpenMP runtime (it allocates their stacks)
    and 5000 workers are 5000 processes."""
    with pytest.raises(ConfigError) as caught:
        parse_config("I", BASE + [f"--{field}", str(value)])
    assert str(caught.value) == f"command line: {message}"


@pytest.mark.parametrize(
    "text, where",
    [
        ('"lr_scheduler_kwargs": {"min_lr": NaN}', "lr_scheduler_kwargs.min_lr=nan"),
        ('"lr_scheduler_kwargs": {"min_lr": -Infinity}', "lr_scheduler_kwargs.min_lr=-inf"),
        ('"lr_scheduler_kwargs": {"min_lr": 1e999}', "lr_scheduler_kwargs.min_lr=inf"),
        ('"fsdp_config": {"limits": [1, {"x": NaN}]}', "fsdp_config.limits[1].x=nan"),
        ('"learning_rate": Infinity', "learning_rate=inf"),
    ],
)
def test_nan_or_infinity_anywhere_in_a_config_is_refused(tmp_path, text, where):
    path = tmp_path / "config.json"
    path.write_text('{"model_name_or_path": "m", "output_dir": "o", ' + text + "}")
    with pytest.raises(ConfigError) as caught:
        parse_config("I", [str(path)])
    assert str(caught.value) == f"{path}: {where}: expected a finite number", caught.value
    key, value = text.split(": ", 1)
    with pytest.raises(ConfigError) as caught:
        parse_config("I", BASE + [f"--{json.loads(key)}", value])
    assert str(caught.value) == f"command line: {where}: expected a finite number", caught.value


def test_a_nan_in_the_scheduler_settings_stops_the_run_before_it_trains(assets, tmp_path, capsys):
    """Measured before this check: the run trained at learning rate 0 (transformers' cosine_with_min_lr rate is
    ``max(0, nan)``, which is 0) and exited 0 with a finished model."""
    out = tmp_path / "run"
    argv = flags(assets, out, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr": NaN}')
    assert main("I", argv) == 2
    assert one_line_error(capsys) == "error: command line: lr_scheduler_kwargs.min_lr=nan: expected a finite number"
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- 6. data


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def good_line(i: int, **extra) -> str:
    return json.dumps({"query": f"the quick fox {i}", "positive": f"jumps over the dog {i}", **extra})


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"query": "a lone \\ud800 half", "positive": "fine text"}', "field \"query\" holds '\\ud800' at character 7"),
        (good_line(3, instruction=" ".join(["retrieve passages"] * 40)), "leaves no room for text"),
    ],
)
def test_a_line_that_tokenization_rejects_is_found_while_loading(
    assets, tmp_path, monkeypatch, capsys, bad_line, message
):
    """Measured before this check: both lines passed loading and crashed the step that drew them (every resume
    again), with an 80-line traceback and no file:line."""
    data = write_jsonl(
        tmp_path / "mine.jsonl", [good_line(1), good_line(2), bad_line] + [good_line(i) for i in range(4, 9)]
    )

    def no_model(stage):
        raise AssertionError("the weights were loaded before the data was checked")

    monkeypatch.setattr(training, "model_class", no_model)
    argv = flags(assets, tmp_path / "run", dataset_name="jsonl", dataset_file_path=data, max_seq_length=32)
    argv = [a for a in argv if a not in ("--e5_sources", '["nq","fever"]')]
    assert main("I", argv) == 2
    err = one_line_error(capsys)
    assert f"{data}:3: " in err and message in err, err


# ---------------------------------------------------------------------------------------------- 7. foreign files


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
    # a file of another name: written beside, kept (tests/test_run_safety_4.py: through any number of overwrites)
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


# ---------------------------------------------------------------------------------------------- 8. changed inputs


@pytest.fixture
def interrupted(assets, tmp_path, monkeypatch):
    """A run of its own data and model copy, stopped by a failed save at step 4: checkpoint-2 only."""
    model, data = tmp_path / "model", tmp_path / "data"
    shutil.copytree(assets[0], model)
    shutil.copytree(assets[1], data)
    save = LLM2VecTrainer._save_optimizer_and_scheduler

    def fail_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise KeyboardInterrupt
        save(self, output_dir)

    monkeypatch.setattr(LLM2VecTrainer, "_save_optimizer_and_scheduler", fail_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        run("I", flags((model, data), tmp_path / "run"))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-2"]
    return (model, data), tmp_path / "run"


def test_a_resume_after_a_data_file_changed_is_refused(interrupted, capsys):
    assets, out = interrupted
    with open(assets[1] / "nq.jsonl", "a") as f:
        f.write(json.dumps({"query": "one more", "positive": "line", "negative": "here"}) + "\n")
    assert main("I", flags(assets, out) + RESUME) == 2
    err = one_line_error(capsys)
    assert f"what it was trained with changed since it was saved (data file {assets[1] / 'nq.jsonl'}: size " in err, err
    assert "--accept_changed_inputs true" in err


def test_a_resume_after_the_base_model_changed_is_refused(interrupted, capsys):
    assets, out = interrupted
    config = assets[0] / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert main("I", flags(assets, out) + RESUME) == 2
    assert "base_model file config.json: " in one_line_error(capsys)


def test_a_changed_batch_is_refused_or_recorded(interrupted, capsys):
    assets, out = interrupted
    smaller = flags(assets, out, per_device_train_batch_size=2, gradient_accumulation_steps=2) + RESUME
    assert main("I", smaller) == 2
    err = one_line_error(capsys)
    assert "per_device_train_batch_size 4 -> 2; gradient_accumulation_steps 1 -> 2" in err, err
    run("I", smaller + ["--accept_changed_inputs", "true"])
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["batch_geometry"]["per_device_train_batch_size"] == 2
    (change,) = saved["resumed_with_changes"]
    assert change["step"] == 2 and change["checkpoint"] == str(out / "checkpoint-2")
    assert change["before"]["batch_geometry"]["per_device_train_batch_size"] == 4
    assert "per_device_train_batch_size 4 -> 2" in change["changes"]


# ---------------------------------------------------------------------------------------------- library errors


def test_a_library_error_caused_by_the_user_is_one_line_and_debug_shows_it(assets, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(assets[0], model)
    os.truncate(model / "model.safetensors", 3000)
    argv = flags((model, assets[1]), tmp_path / "run")
    assert main("I", argv) == 2
    err = one_line_error(capsys)
    assert f"cannot load the model {model}" in err and "traceback: " in err, err
    trace = Path(err.split("traceback: ")[1].split(";")[0])
    assert "Traceback" in trace.read_text()
    with pytest.raises(ConfigError, match="cannot load the model"):
        main("I", argv + ["--debug"])


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


def test_a_full_disk_is_one_line(assets, tmp_path, capsys, monkeypatch):
    import errno

    def full(self, output_dir):
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir) / "optimizer.pt"))

    monkeypatch.setattr(LLM2VecTrainer, "_save_optimizer_and_scheduler", full)
    assert main("I", flags(assets, tmp_path / "run")) == 1
    err = one_line_error(capsys)
    assert "optimizer.pt: no space left on device while writing" in err and "--resume_from_checkpoint true" in err
