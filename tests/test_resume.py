"""How a run stops and how it continues: a diverged run stops at the step and saves nothing broken, Ctrl-C is one
line and exit 130, a killed or interrupted run resumes from its newest complete checkpoint to the weights of an
uninterrupted run (in one and two processes; the same command twice gives the same weights), a finished run is
resumed only to train further, and a resume after its inputs, batch or settings changed, or from the other stage's
checkpoint, is refused in one line or recorded.

The reference of every resumed run is an uninterrupted run of the same config; weights must be bit-identical.
Other references are independent of the code under test: values written literally here, ``torch.isfinite`` on the
saved tensors, a separate process that receives the signal or the kill.
"""

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _drivers import (
    RESUME,
    ROOT,
    assert_same_weights,
    launcher,
    marker,
    one_line,
    one_line_error,
    saved_weights,
    six_step_flags,
    snapshot,
    subprocess_env,
    tree,
    unfinished_copy,
)
from _drivers import run_flags as flags

from llm2vec.arguments import ConfigError, argument_classes
from llm2vec.run import plan as config_fields
from llm2vec.run.folder import COMPLETE_MARKER
from llm2vec.run.lock import LOCK_NAME
from llm2vec.trainer import LLM2VecTrainer, TrainingDiverged
from llm2vec.training import main, run


@pytest.fixture(autouse=True)
def _threads(keep_thread_count):
    """Every test here leaves torch's thread count as it found it."""


# --------------------------------------------------------------------------------------- a diverged run stops


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


# ----------------------------------------------------------------------------------------------------- Ctrl-C


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


# ---------------------------------------------------------------------------------------- an interrupted save


def test_a_checkpoint_interrupted_while_saving_is_never_resumed_from(assets, references, tmp_path, monkeypatch, caplog):
    out = tmp_path / "run"
    save = LLM2VecTrainer._save_optimizer_and_scheduler

    def fail_at_step_4(self, output_dir):  # the weights of checkpoint-4 are written, then the save fails
        if self.state.global_step == 4:
            raise OSError("No space left on device (injected)")
        save(self, output_dir)

    monkeypatch.setattr(LLM2VecTrainer, "_save_optimizer_and_scheduler", fail_at_step_4)
    with pytest.raises(OSError, match="injected"):
        run("I", six_step_flags(assets, out))
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == ["checkpoint-2"]  # no checkpoint-4, no staging folder, no final model

    with pytest.raises(
        ConfigError,
        match=r"an unfinished Stage I run: checkpoints checkpoint-2 \(newest complete: "
        r"step 2\).*--resume_from_checkpoint true",
    ):
        run("I", six_step_flags(assets, out))  # a fresh run into it is refused too

    # a checkpoint folder without its weights (another tool's): skipped with a warning
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-3")
    (out / "checkpoint-3" / "model.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        run("I", six_step_flags(assets, out) + RESUME)
    assert any("checkpoint-3 is incomplete (model.safetensors is missing" in r.getMessage() for r in caplog.records)
    assert_same_weights(out, references[0]["I"])
    with pytest.raises(ConfigError, match="checkpoint-3: model.safetensors is missing.*incomplete.*checkpoint-6"):
        run("I", six_step_flags(assets, tmp_path / "elsewhere", resume_from_checkpoint=out / "checkpoint-3"))


def test_an_interrupted_final_save_is_completed_from_the_last_checkpoint(assets, references, tmp_path, monkeypatch):
    out = tmp_path / "run"
    save_model = LLM2VecTrainer.save_model

    def fail_after_final_weights(self, output_dir=None, _internal_call=False):
        save_model(self, output_dir, _internal_call)
        if not _internal_call:  # the final save (checkpoints are internal calls)
            raise OSError("killed (injected)")

    monkeypatch.setattr(LLM2VecTrainer, "save_model", fail_after_final_weights)
    with pytest.raises(OSError, match="injected"):
        run("I", six_step_flags(assets, out))
    monkeypatch.undo()
    # the final model is written into a staging folder, which the failure removed: only the checkpoints are left
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

    # a kill while the staged files are renamed into place: two of them there, no marker
    real_replace, moved = os.replace, []

    def killed_after_two(src, dst):
        if Path(src).parent.parent.name == ".final-model.staging.tmp" and Path(dst).parent == out:
            if len(moved) == 2:
                raise OSError("killed (injected)")
            moved.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_after_two)
    with pytest.raises(OSError, match="injected"):
        run("I", six_step_flags(assets, out) + RESUME)  # checkpoint-6 is at the end: the final model is written from it
    monkeypatch.undo()
    assert len(moved) == 2 and all((out / name).exists() for name in moved) and not (out / COMPLETE_MARKER).exists()
    with pytest.raises(ConfigError, match="unfinished Stage I run"):
        run("I", six_step_flags(assets, out))

    trainer = run("I", six_step_flags(assets, out) + RESUME)
    assert trainer.state.global_step == 6 and marker(out)["global_step"] == 6
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert_same_weights(out, references[0]["I"])
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6


# ----------------------------------------------------------------------------------------------- a killed run


@dataclass
class Launch:
    proc: subprocess.Popen
    log: Path
    flag_dir: Path
    nproc: int

    def output(self) -> str:
        return self.log.read_text()[-4000:]


def launch(tmp_path: Path, name: str, runs: list[dict], nproc: int = 1, hash_seed: int = 1) -> Launch:
    """``tests/_drivers.py`` running ``runs`` in a fresh process (or ``nproc`` gloo processes)."""
    flag_dir = tmp_path / f"{name}-flags"
    flag_dir.mkdir()
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"flag_dir": str(flag_dir), "runs": runs}))
    log = tmp_path / f"{name}.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(
            launcher(nproc) + [str(ROOT / "tests" / "_drivers.py"), str(spec)],
            env=subprocess_env(PYTHONHASHSEED=str(hash_seed)),
            cwd=ROOT,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    return Launch(proc, log, flag_dir, nproc)


def finish(job: Launch) -> None:
    try:
        rc = job.proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        job.proc.terminate()
        job.proc.wait(timeout=30)
        rc = "timeout"
    assert rc == 0, f"exit {rc}:\n{job.output()}"


def kill_when_paused(job: Launch) -> None:
    """Wait until every process has paused at its chosen point, then SIGKILL them all (and the launcher)."""
    deadline = time.monotonic() + 240
    paused = False
    try:
        while len(list(job.flag_dir.glob("rank*.pid"))) < job.nproc:
            if job.proc.poll() is not None:
                pytest.fail(f"the run ended (exit {job.proc.returncode}) before its pause:\n{job.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no pause within 240 s:\n{job.output()}")
            time.sleep(0.05)
        paused = True
    finally:
        for pid_file in job.flag_dir.glob("rank*.pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        if not paused:  # let torchrun stop the workers that had not paused
            job.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.proc.wait(timeout=30)
        job.proc.kill()
        job.proc.wait(timeout=60)


def after_kill(out: Path, pause: dict) -> None:
    """What a kill leaves: the last complete checkpoint; a half-written one only under its staging name."""
    step = pause["step"]
    done = step if pause["at"] == "after_checkpoint" else step - 2
    names = set(os.listdir(out))
    assert f"checkpoint-{done}" in names and COMPLETE_MARKER not in names, names
    assert not {f"checkpoint-{s}" for s in range(done + 1, 7)} & names, names
    if pause["at"] == "during_save":
        staged = out / f".checkpoint-{step}.staging.tmp" / f"checkpoint-{step}"
        assert list(staged.glob("*.safetensors")), names  # killed half-way: weights written, optimizer not
        assert not (staged / "optimizer.pt").exists()


@pytest.mark.parametrize(
    "stage, pause", [("I", {"at": "during_save", "step": 4}), ("II", {"at": "after_checkpoint", "step": 2})]
)
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_run(assets, references, tmp_path, stage, pause):
    out = tmp_path / "run"
    job = launch(tmp_path, "killed", [{"stage": stage, "argv": six_step_flags(assets, out, stage), "pause": pause}])
    kill_when_paused(job)
    after_kill(out, pause)
    run(stage, six_step_flags(assets, out, stage) + RESUME)
    assert_same_weights(out, references[0][stage])
    assert marker(out)["global_step"] == 6 and not list(out.glob(".*.tmp"))


def test_killed_two_process_runs_resume_to_the_weights_of_uninterrupted_ones(assets, tmp_path):
    """Stage I killed after checkpoint-2, Stage II killed while writing checkpoint-4; 2 gloo processes each."""

    def argv(stage, out, *extra):
        return six_step_flags(assets, out, stage, per_device_train_batch_size=2, ddp_backend="gloo") + list(extra)

    ref, out = tmp_path / "reference", tmp_path / "run"
    stop_I, stop_II = {"at": "after_checkpoint", "step": 2}, {"at": "during_save", "step": 4}
    finish(launch(tmp_path, "reference", [{"stage": s, "argv": argv(s, ref / s)} for s in ("I", "II")], nproc=2))
    kill_when_paused(launch(tmp_path, "kill_I", [{"stage": "I", "argv": argv("I", out / "I"), "pause": stop_I}], 2))
    after_kill(out / "I", stop_I)
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(out / "I" / "checkpoint-2"))
    kill_when_paused(
        launch(
            tmp_path,
            "resume_I_kill_II",
            [
                {"stage": "I", "argv": argv("I", out / "I", *RESUME)},
                {"stage": "II", "argv": argv("II", out / "II"), "pause": stop_II},
            ],
            nproc=2,
        )
    )
    assert_same_weights(out / "I", ref / "I")
    after_kill(out / "II", stop_II)
    finish(launch(tmp_path, "resume_II", [{"stage": "II", "argv": argv("II", out / "II", *RESUME)}], nproc=2))
    assert_same_weights(out / "II", ref / "II")
    assert marker(out / "II")["global_step"] == 6


def test_the_same_command_twice_gives_bit_identical_weights(assets, references, tmp_path):
    """A fresh process (another hash seed, the stages in the other order) against the in-process reference runs."""
    folders, _ = references
    runs = [{"stage": s, "argv": six_step_flags(assets, tmp_path / s, s)} for s in ("II", "I")]
    finish(launch(tmp_path, "again", runs, hash_seed=12345))
    for stage in ("I", "II"):
        assert_same_weights(tmp_path / stage, folders[stage])


# --------------------------------------------------------------------------------------------- a finished run


def test_resuming_a_finished_run_does_nothing_unless_it_trains_further(assets, tmp_path, caplog):
    out, constant = tmp_path / "run", {"lr_scheduler_type": "constant"}
    run("I", six_step_flags(assets, out, max_steps=4, **constant))
    before = snapshot(out)
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        assert main("I", six_step_flags(assets, out, max_steps=4, **constant) + RESUME) == 0
        # a field that does not move the end (logging_steps) is named, and the run is still finished
        assert main("I", six_step_flags(assets, out, max_steps=4, logging_steps=2, **constant) + RESUME) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("finished Stage I run (step 4" in m and "nothing to do" in m for m in messages) == 2, messages
    assert any("logging_steps 1 -> 2" in m for m in messages)
    assert snapshot(out) == before  # not a file touched

    with pytest.raises(ConfigError, match="ended at step 4; this config ends at step 3"):  # a shorter run
        run("I", six_step_flags(assets, out, max_steps=3, **constant) + RESUME)
    assert snapshot(out) == before

    # a longer one continues from checkpoint-4: the weights of an uninterrupted 6-step run (constant rate)
    trainer = run("I", six_step_flags(assets, out, max_steps=6, **constant) + RESUME)
    run("I", six_step_flags(assets, tmp_path / "straight", max_steps=6, **constant))
    assert trainer.state.global_step == 6 and marker(out)["global_step"] == 6
    assert_same_weights(out, tmp_path / "straight")


def test_a_finished_run_on_a_read_only_folder_is_nothing_to_do_and_anything_else_one_line(
    assets, tmp_path, caplog, capsys, monkeypatch
):
    """A folder that cannot be written (a read-only mount: the write test fails with EROFS) holding this run finished
    is "nothing to do" with the lock never taken; a run that would write there is refused in one line."""
    import errno
    import tempfile

    import llm2vec.run.plan as plan

    out, constant = tmp_path / "run", {"lr_scheduler_type": "constant"}
    run("I", six_step_flags(assets, out, max_steps=4, **constant))
    before, temporary_file = snapshot(out), tempfile.TemporaryFile

    def read_only(*a, dir=None, **kw):
        if Path(dir) in (out, tmp_path / "new"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return temporary_file(*a, dir=dir, **kw)

    def no_lock(*a, **kw):
        raise AssertionError("the lock of a read-only folder was taken")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    monkeypatch.setattr(plan, "hold", no_lock)
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        assert main("I", six_step_flags(assets, out, max_steps=4, **constant) + RESUME) == 0
    assert any(
        "finished Stage I run (step 4" in r.getMessage() and "nothing to do" in r.getMessage() for r in caplog.records
    )
    assert snapshot(out) == before
    for argv in (
        six_step_flags(assets, out, max_steps=6, **constant) + RESUME,
        six_step_flags(assets, tmp_path / "new"),
    ):
        assert main("I", argv) == 2
        err = capsys.readouterr().err
        assert "cannot write there (Read-only file system); choose a folder you can write to" in err, err
        assert "Traceback" not in err
    assert snapshot(out) == before


def test_a_finished_stage_II_run_is_not_overwritten(assets, references, capsys):
    folders, _ = references
    before = snapshot(folders["II"])
    assert main("II", six_step_flags(assets, folders["II"], "II", loss_scale=50.0)) == 2
    err = capsys.readouterr().err
    assert "finished Stage II run (step 6" in err and "loss_scale 20.0 -> 50.0" in err, err
    assert snapshot(folders["II"]) == before
    before = snapshot(folders["I"])  # a Stage II config never "continues" a Stage I run
    assert main("II", six_step_flags(assets, folders["I"], "II") + RESUME) == 2
    err = capsys.readouterr().err
    assert "holds a finished Stage I run" in err and "this is a Stage II config" in err, err
    assert snapshot(folders["I"]) == before


def test_training_end_fields_are_found_by_name_or_metadata(monkeypatch):
    @dataclass
    class Recipe:
        stop_at: int | None = dataclasses.field(default=None, metadata={"help": "", "ends_training": True})

    monkeypatch.setattr(config_fields, "argument_classes", lambda stage: (*argument_classes(stage), Recipe))
    assert {"max_steps", "num_train_epochs", "stop_at"} <= set(config_fields.training_end_fields("I"))
    saved_by_older_version = {"max_steps": 40, "num_train_epochs": 3.0}
    assert config_fields.end_values(saved_by_older_version, "I")["stop_at"] is None
    from transformers import TrainingArguments

    from llm2vec.schedule import plan_schedule

    def end(max_steps, stop):  # where training ends: computed once, by the schedule plan the run manager is handed
        args = TrainingArguments("unused", max_steps=max_steps, num_train_epochs=3.0, report_to=[])
        return plan_schedule(args, 12, stop).stop_step

    assert end(-1, None) == 36  # 3 epochs of 12 steps
    assert end(-1, 20) == 20  # a longer schedule, cut
    with pytest.raises(ConfigError, match="stop_after_n_steps 50 is beyond .* max_steps 40"):
        end(40, 50)


# -------------------------------------------------------------------------------- changed inputs and settings


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


def test_a_model_file_changed_only_after_its_first_mib_is_named_by_its_sha256():
    """A base model file of the same size, modification time and first MiB but other contents is reported as such."""
    old = {"size": 10, "mtime_ns": 1, "head_sha256": "a", "sha256": "b"}
    saved = {"inputs": {"data": {}, "base_model": {"name": "m", "files": {"model.safetensors": old}}}}
    new = {"data": {}, "base_model": {"name": "m", "files": {"model.safetensors": {**old, "sha256": "c"}}}}
    assert config_fields.input_changes(saved, new, {}) == ["base_model file model.safetensors: its SHA-256 differs"]


def test_a_record_without_a_files_sha256_says_so():
    """A base model file recorded without its whole-contents SHA-256 (a record older than those hashes) is reported
    as a record without one, not as other contents."""
    old = {"size": 10, "mtime_ns": 1, "head_sha256": "a"}
    saved = {"inputs": {"data": {}, "base_model": {"name": "m", "files": {"model.safetensors": old}}}}
    new = {"data": {}, "base_model": {"name": "m", "files": {"model.safetensors": {**old, "sha256": "c"}}}}
    (change,) = config_fields.input_changes(saved, new, {})
    assert change == "base_model file model.safetensors: the record has no SHA-256 (an older run's)"


def test_a_data_file_given_by_a_relative_path_is_the_same_input_by_its_absolute_path(assets, tmp_path, monkeypatch):
    """A data file is recorded under its real absolute path: a run started with a relative data path resumes with
    the absolute path of the same files (and a record that keyed them as given compares by real path), no change
    reported."""
    shutil.copytree(assets[1], tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    save = LLM2VecTrainer._save_optimizer_and_scheduler

    def fail_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise KeyboardInterrupt
        save(self, output_dir)

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(LLM2VecTrainer, "_save_optimizer_and_scheduler", fail_at_step_4)
        run("I", flags((assets[0], "data"), "run"))
    recorded = json.loads(Path("run/checkpoint-2/run_config.json").read_text())["inputs"]["data"]
    assert recorded and all(Path(p).parent == (tmp_path / "data").resolve() for p in recorded), recorded
    as_given = {os.path.relpath(p): v for p, v in recorded.items()}  # how a record keyed them before
    assert config_fields.input_changes({"inputs": {"data": as_given}}, {"data": recorded}, {}) == []
    run("I", flags((assets[0], tmp_path / "data"), tmp_path / "run") + RESUME)
    saved = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert saved["resumed_with_changes"] == [] and saved["inputs"]["data"] == recorded


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


# ------------------------------------------------------------------------------- the other stage's checkpoint


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
