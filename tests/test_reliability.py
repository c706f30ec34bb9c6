"""Never lose a finished run: no silent overwrite, finished runs recognised, complete-or-absent saves,
SIGKILL-and-resume in one and two processes, the same command twice, start-up checks.

The reference for every resumed run is an uninterrupted run of the same config; weights must be bit-identical.
"""

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from _drivers import assert_same_weights, launcher, subprocess_env, tiny_run_flags

from llm2vec.arguments import ConfigError, argument_classes
from llm2vec.run import checks as startup_checks
from llm2vec.run import inputs as config_fields
from llm2vec.run import plan as resume
from llm2vec.run.folder import COMPLETE_MARKER
from llm2vec.testing import build_tokenizer
from llm2vec.trainer import LLM2VecTrainer
from llm2vec.training import main, run

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH = 12  # 2 sources x 24 examples, global batch 4


def flags(assets, out, stage="I", **overrides) -> list[str]:
    """A 6-step run saving every 2 steps; Stage II has LoRA dropout (0.05), so its RNG state matters."""
    model, data = assets
    fields = {"learning_rate": 1e-3, "max_steps": 6, "save_steps": 2, "num_threads": 1, "disable_tqdm": "true"}
    if stage == "II":
        fields.update(stage="II", learning_rate=1e-2, lora_r=4, lora_alpha=8)
    return tiny_run_flags(model, data, out, **{"max_seq_length": 96, **fields, **overrides})


RESUME = ["--resume_from_checkpoint", "true"]


def snapshot(folder) -> dict[str, tuple]:
    """Every file under ``folder`` (hidden ones too) with its size, modification time and SHA-256."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).digest())
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }


def marker(folder) -> dict:
    return json.loads((Path(folder) / COMPLETE_MARKER).read_text())


@pytest.fixture(autouse=True)
def _threads(keep_thread_count):
    """Every test here leaves torch's thread count as it found it."""


@pytest.fixture(scope="module")
def references(assets, tmp_path_factory):
    """Uninterrupted in-process runs of both stages (the reference of every resumed run), and their trainers."""
    root, n = tmp_path_factory.mktemp("references"), torch.get_num_threads()
    try:
        trainers = {stage: run(stage, flags(assets, root / stage, stage)) for stage in ("I", "II")}
    finally:
        torch.set_num_threads(n)
    return {stage: root / stage for stage in trainers}, trainers


# ---------------------------------------------------------------------------------------------- 1. no silent overwrite


def test_a_finished_run_is_not_overwritten(assets, tmp_path, capsys):
    out = tmp_path / "run"
    run("I", flags(assets, out, max_steps=3, save_steps=1))
    assert torch.get_num_threads() == 1  # num_threads is applied
    before = snapshot(out)
    capsys.readouterr()
    assert main("I", flags(assets, out, max_steps=3, save_steps=1, learning_rate=2e-3)) == 2
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
        flags(
            assets, out, max_steps=2, save_steps=1, learning_rate=2e-3, overwrite_output_dir="true", save_total_limit=1
        ),
    )
    (tmp_path / "clean").mkdir()  # an existing empty folder (the demo's fresh step folder) is used
    run("I", flags(assets, tmp_path / "clean", max_steps=2, save_steps=1, learning_rate=2e-3))
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-2"]
    assert marker(out)["global_step"] == 2
    assert_same_weights(out, tmp_path / "clean")
    assert_same_weights(out / "checkpoint-2", tmp_path / "clean")


def test_a_finished_stage_II_run_is_not_overwritten(assets, references, capsys):
    folders, _ = references
    before = snapshot(folders["II"])
    assert main("II", flags(assets, folders["II"], "II", loss_scale=50.0)) == 2
    err = capsys.readouterr().err
    assert "finished Stage II run (step 6" in err and "loss_scale 20.0 -> 50.0" in err, err
    assert snapshot(folders["II"]) == before
    before = snapshot(folders["I"])  # a Stage II config never "continues" a Stage I run
    assert main("II", flags(assets, folders["I"], "II") + RESUME) == 2
    err = capsys.readouterr().err
    assert "holds a finished Stage I run" in err and "this is a Stage II config" in err, err
    assert snapshot(folders["I"]) == before


# ---------------------------------------------------------------------------------------------- 2. finished runs


def test_resuming_a_finished_run_does_nothing_unless_it_trains_further(assets, tmp_path, caplog):
    out, constant = tmp_path / "run", {"lr_scheduler_type": "constant"}
    run("I", flags(assets, out, max_steps=4, **constant))
    before = snapshot(out)
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        assert main("I", flags(assets, out, max_steps=4, **constant) + RESUME) == 0
        # a field that does not move the end (logging_steps) is named, and the run is still finished
        assert main("I", flags(assets, out, max_steps=4, logging_steps=2, **constant) + RESUME) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("finished Stage I run (step 4" in m and "nothing to do" in m for m in messages) == 2, messages
    assert any("logging_steps 1 -> 2" in m for m in messages)
    assert snapshot(out) == before  # not a file touched

    with pytest.raises(ConfigError, match="ended at step 4; this config ends at step 3"):  # a shorter run
        run("I", flags(assets, out, max_steps=3, **constant) + RESUME)
    assert snapshot(out) == before

    # a longer one continues from checkpoint-4: the weights of an uninterrupted 6-step run (constant rate)
    trainer = run("I", flags(assets, out, max_steps=6, **constant) + RESUME)
    run("I", flags(assets, tmp_path / "straight", max_steps=6, **constant))
    assert trainer.state.global_step == 6 and marker(out)["global_step"] == 6
    assert_same_weights(out, tmp_path / "straight")


def test_training_end_fields_are_found_by_name_or_metadata(monkeypatch):
    @dataclass
    class Recipe:
        stop_at: int | None = field(default=None, metadata={"help": "", "ends_training": True})

    monkeypatch.setattr(config_fields, "argument_classes", lambda stage: (*argument_classes(stage), Recipe))
    assert {"max_steps", "num_train_epochs", "stop_at"} <= set(config_fields.training_end_fields("I"))
    saved_by_older_version = {"max_steps": 40, "num_train_epochs": 3.0}
    assert config_fields.end_values(saved_by_older_version, "I")["stop_at"] is None
    end = resume.planned_end_step
    assert end({"max_steps": -1, "num_train_epochs": 3.0, "stop_at": None}, 12) == 36  # 3 epochs of 12 steps
    assert end({"max_steps": -1, "num_train_epochs": 3.0, "stop_at": 20}, 12) == 20  # a longer schedule, cut
    assert end({"max_steps": 40, "num_train_epochs": 3.0, "stop_at": 50}, 12) == 40


# ---------------------------------------------------------------------------------------------- 3. complete or absent


def test_a_checkpoint_interrupted_while_saving_is_never_resumed_from(assets, references, tmp_path, monkeypatch, caplog):
    out = tmp_path / "run"
    save = LLM2VecTrainer._save_optimizer_and_scheduler

    def fail_at_step_4(self, output_dir):  # the weights of checkpoint-4 are written, then the save fails
        if self.state.global_step == 4:
            raise OSError("No space left on device (injected)")
        save(self, output_dir)

    monkeypatch.setattr(LLM2VecTrainer, "_save_optimizer_and_scheduler", fail_at_step_4)
    with pytest.raises(OSError, match="injected"):
        run("I", flags(assets, out))
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == ["checkpoint-2"]  # no checkpoint-4, no staging folder, no final model

    with pytest.raises(
        ConfigError,
        match=r"an unfinished Stage I run: checkpoints checkpoint-2 \(newest complete: "
        r"step 2\).*--resume_from_checkpoint true",
    ):
        run("I", flags(assets, out))  # a fresh run into it is refused too

    # a checkpoint folder without its weights (another tool's): skipped with a warning
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-3")
    (out / "checkpoint-3" / "model.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        run("I", flags(assets, out) + RESUME)
    assert any("checkpoint-3 is incomplete (model.safetensors is missing" in r.getMessage() for r in caplog.records)
    assert_same_weights(out, references[0]["I"])
    with pytest.raises(ConfigError, match="checkpoint-3: model.safetensors is missing.*incomplete.*checkpoint-6"):
        run("I", flags(assets, tmp_path / "elsewhere", resume_from_checkpoint=out / "checkpoint-3"))


def test_an_interrupted_final_save_is_completed_from_the_last_checkpoint(assets, references, tmp_path, monkeypatch):
    out = tmp_path / "run"
    save_model = LLM2VecTrainer.save_model

    def fail_after_final_weights(self, output_dir=None, _internal_call=False):
        save_model(self, output_dir, _internal_call)
        if not _internal_call:  # the final save (checkpoints are internal calls)
            raise OSError("killed (injected)")

    monkeypatch.setattr(LLM2VecTrainer, "save_model", fail_after_final_weights)
    with pytest.raises(OSError, match="injected"):
        run("I", flags(assets, out))
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
        run("I", flags(assets, out) + RESUME)  # checkpoint-6 is at the end: the final model is written from it
    monkeypatch.undo()
    assert len(moved) == 2 and all((out / name).exists() for name in moved) and not (out / COMPLETE_MARKER).exists()
    with pytest.raises(ConfigError, match="unfinished Stage I run"):
        run("I", flags(assets, out))

    trainer = run("I", flags(assets, out) + RESUME)
    assert trainer.state.global_step == 6 and marker(out)["global_step"] == 6
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert_same_weights(out, references[0]["I"])
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6


# ---------------------------------------------------------------------------------------------- 6. start-up checks


def tiny_gpt2(path: Path) -> Path:
    """A GPT-2 model (no registered family) whose tokenizer has no chat template to derive a family from."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_tokenizer("llama3")
    tokenizer.chat_template = None
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64)
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_startup_checks_fail_before_data_and_weights(assets, tmp_path, monkeypatch):
    from llm2vec import training

    def no_build(stage):
        raise AssertionError("the model was loaded before the start-up checks")

    monkeypatch.setattr(training, "model_class", no_build)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="a_file/out: cannot write there"):
        run("I", flags(assets, blocker / "out"))
    with pytest.raises(ConfigError, match="'.*missing_model': cannot read its config and tokenizer"):
        run("I", flags(assets, tmp_path / "o1", model_name_or_path=tmp_path / "missing_model"))
    with pytest.raises(ConfigError, match="no prompt template for this model: model_type='gpt2'"):
        run(
            "I",
            flags(
                assets,
                tmp_path / "o2",
                model_name_or_path=tiny_gpt2(tmp_path / "gpt2"),
                dataset_file_path=tmp_path / "no_data",
            ),
        )  # before the data is read


def test_not_enough_disk_space_is_refused_before_training(assets, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 200_000, 200_000))
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"200.0 KB free, but this run writes about .*3 checkpoint\(s\)"):
        run("I", flags(assets, out))
    assert os.listdir(out) == []
    run("I", flags(assets, out, save_strategy="no"))  # the final model alone fits


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


# ---------------------------------------------------------------------------------------------- 4. and 5. processes


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
    job = launch(tmp_path, "killed", [{"stage": stage, "argv": flags(assets, out, stage), "pause": pause}])
    kill_when_paused(job)
    after_kill(out, pause)
    run(stage, flags(assets, out, stage) + RESUME)
    assert_same_weights(out, references[0][stage])
    assert marker(out)["global_step"] == 6 and not list(out.glob(".*.tmp"))


def test_killed_two_process_runs_resume_to_the_weights_of_uninterrupted_ones(assets, tmp_path):
    """Stage I killed after checkpoint-2, Stage II killed while writing checkpoint-4; 2 gloo processes each."""

    def argv(stage, out, *extra):
        return flags(assets, out, stage, per_device_train_batch_size=2, ddp_backend="gloo") + list(extra)

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
    runs = [{"stage": s, "argv": flags(assets, tmp_path / s, s)} for s in ("II", "I")]
    finish(launch(tmp_path, "again", runs, hash_seed=12345))
    for stage in ("I", "II"):
        assert_same_weights(tmp_path / stage, folders[stage])


# ----------------------------------------------------------------------------- the end of a distributed run


def test_release_frees_the_dropped_ddp_wrapper_then_destroys_the_group(tmp_path):
    """What a driver leaves at exit: a DDP wrapper nobody references (not yet collected: it sits in a reference
    cycle, as a Trainer's does) and the live group. The release collects the wrapper before the group goes."""
    import gc
    import weakref

    import torch.distributed as dist

    from llm2vec.distributed import release_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        wrapper = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        holder = {"model": wrapper}
        holder["self"] = holder  # a cycle: only the garbage collector frees it
        alive = weakref.ref(wrapper)
        del wrapper, holder
        gc.disable()  # no collection may happen by chance before the release
        try:
            assert alive() is not None and dist.is_initialized()
            release_process_group()
            assert alive() is None and not dist.is_initialized()
        finally:
            gc.enable()
        release_process_group()  # nothing left to release: a no-op
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_finished_driver_run_releases_the_group_at_exit(monkeypatch):
    import atexit

    from llm2vec import distributed, training

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(distributed, "_release_registered", False)
    monkeypatch.setattr(training, "run", lambda stage, argv: None)
    assert training.main("II", ["config.json"]) == 0
    assert training.main("II", ["config.json"]) == 0  # a second run in the same process registers nothing more
    assert registered == [distributed.release_process_group]


def test_a_model_file_changed_only_after_its_first_mib_is_named_by_its_sha256():
    """A base model file of the same size, modification time and first MiB but other contents is reported as such."""
    old = {"size": 10, "mtime_ns": 1, "head_sha256": "a", "sha256": "b"}
    saved = {"inputs": {"data": {}, "base_model": {"name": "m", "files": {"model.safetensors": old}}}}
    new = {"data": {}, "base_model": {"name": "m", "files": {"model.safetensors": {**old, "sha256": "c"}}}}
    assert config_fields.input_changes(saved, new, {}) == ["base_model file model.safetensors: its SHA-256 differs"]
