"""The long CPU run's driver (``experiments/demo/long_run.py``): the command it starts, its resume, its table.

Nothing is trained here: the model, the corpus and the training subprocess are replaced, and the command the
driver would run is checked: this checkout's ``llm2vec`` first on the child's import path (the run must not
pick up whichever checkout pip installed), the long run's schedule (640 steps, 15 % warm-up, measures and
checkpoints every 40), and ``--resume_from_checkpoint`` exactly when a checkpoint is there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo import long_run  # noqa: E402
from demo.settings import INSTRUCTION  # noqa: E402


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """long_run with its outputs under tmp_path; returns the list of (command, env, cwd) it would have run."""
    calls = []
    monkeypatch.setattr(long_run, "OUT", tmp_path / "long-run")
    monkeypatch.setattr(long_run, "materialise_smollm2", lambda folder: tmp_path / "model")
    monkeypatch.setattr(long_run, "build_package_dataset", lambda folder: calls.append(("build", folder)))

    def write_inputs(data, folder):
        calls.append(("write", folder))
        return long_run.input_files(folder)

    monkeypatch.setattr(long_run, "write_inputs", write_inputs)

    def call(command, env, cwd):
        calls.append((command, env, cwd))
        return 0

    monkeypatch.setattr(long_run.subprocess, "call", call)
    return calls


def _checkpoint(run: Path, step: int) -> Path:
    """A checkpoint folder as the Trainer leaves one, as far as the driver looks: its trainer_state.json."""
    (run / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
    (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return run / f"checkpoint-{step}"


def _flags(command):
    """``--key value`` pairs of a command after the script and its config."""
    rest = command[3:]
    return dict(zip(rest[::2], rest[1::2], strict=True))


def test_the_run_uses_this_checkout_and_resumes_only_from_a_checkpoint(driver, tmp_path):
    assert long_run.main(["--threads", "1"]) == 0
    assert [c[0] for c in driver[:2]] == ["build", "write"]
    command, env, cwd = driver[2]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO) and cwd == REPO
    assert env["OMP_NUM_THREADS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    flags = _flags(command)
    assert command[1:3] == [str(long_run.STAGE_I_SCRIPT), str(long_run.STAGE_I_CONFIG)]
    assert (flags["--max_steps"], flags["--warmup_steps"]) == ("640", "96")
    assert flags["--eval_steps"] == flags["--save_steps"] == "40" and flags["--eval_on_start"] == "true"
    assert flags["--output_dir"] == str(tmp_path / "long-run" / "stage_I")
    assert "--resume_from_checkpoint" not in flags
    (tmp_path / "long-run" / "stage_I" / "checkpoint-40").mkdir(parents=True)  # empty: not a checkpoint of a run
    assert long_run.main(["--steps", "200"]) == 0
    assert "--resume_from_checkpoint" not in _flags(driver[-1][0])
    for step in (40, 80):
        _checkpoint(tmp_path / "long-run" / "stage_I", step)
    assert long_run.main(["--steps", "200"]) == 0
    flags = _flags(driver[-1][0])
    assert flags["--resume_from_checkpoint"] == "true" and (flags["--max_steps"], flags["--warmup_steps"]) == (
        "200",
        "30",
    )
    assert [c[0] for c in driver[6:8]] == ["build", "write"]  # the inputs were never written: built for the resume


def test_a_start_again_before_the_first_checkpoint_keeps_the_inputs_written(driver, tmp_path):
    """A run cut before its first checkpoint starts again on the inputs it wrote: a corpus built again in a
    changed environment would be another corpus."""
    train, validation = long_run.input_files(tmp_path / "long-run" / "data")
    train.parent.mkdir(parents=True)
    train.write_text("{}\n")
    validation.write_text("{}\n")
    assert long_run.main([]) == 0
    assert len(driver) == 1 and "--resume_from_checkpoint" not in _flags(driver[0][0])
    assert _flags(driver[0][0])["--dataset_file_path"] == str(train)


def test_a_second_run_has_its_own_seed_and_folder(driver, tmp_path):
    """--seed and --out: another run beside the first, its inputs and checkpoints in its own folder."""
    assert long_run.main(["--seed", "43", "--out", str(tmp_path / "second")]) == 0
    flags = _flags(driver[-1][0])
    assert flags["--seed"] == "43" and flags["--output_dir"] == str(tmp_path / "second" / "stage_I")
    assert flags["--dataset_file_path"].startswith(str(tmp_path / "second" / "data"))
    assert long_run.main([]) == 0  # the first run: the config's seed, the default folder
    flags = _flags(driver[-1][0])
    assert "--seed" not in flags and flags["--output_dir"] == str(tmp_path / "long-run" / "stage_I")
    assert flags["--save_total_limit"] == "1"  # the newest checkpoint only, unless --keep_checkpoints
    assert long_run.main(["--keep_checkpoints"]) == 0
    assert "--save_total_limit" not in _flags(driver[-1][0]) and _flags(driver[-1][0])["--save_steps"] == "40"
    for step in (40, 80):  # a run that kept several checkpoints keeps them on a resume without the flag
        _checkpoint(tmp_path / "long-run" / "stage_I", step)
    assert long_run.main([]) == 0
    assert "--save_total_limit" not in _flags(driver[-1][0]) and "--resume_from_checkpoint" in driver[-1][0]


def test_a_resume_trains_on_the_inputs_the_run_started_with(driver, tmp_path):
    """The corpus is not built again for a resume: the environment may have changed since it was built (a package
    installed), which would change the inputs a resume refuses to change."""
    _checkpoint(tmp_path / "long-run" / "stage_I", 40)
    train, validation = long_run.input_files(tmp_path / "long-run" / "data")
    train.parent.mkdir(parents=True)
    train.write_text("{}\n")
    validation.write_text("{}\n")
    assert long_run.main([]) == 0
    assert len(driver) == 1
    flags = _flags(driver[0][0])
    assert flags["--resume_from_checkpoint"] == "true"
    assert (flags["--dataset_file_path"], flags["--validation_file"]) == (str(train), str(validation))


def _evaluation(step, gain):
    names = ("loss_q2d", "loss_d2q", "anchor_gain_q2d", "anchor_gain_d2q", "anchor_gain_first4_q2d")
    row = {f"eval_{n}": gain for n in names}
    row.update(
        eval_anchor_gain_first4_d2q=gain,
        eval_rank_accuracy_q2d=0.5,
        eval_rank_accuracy_d2q=0.25,
        eval_rank_chance=0.125,
    )
    return {"step": step, **row}


def test_the_table_reads_the_final_state_else_the_newest_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(long_run, "OUT", tmp_path)
    run = tmp_path / "stage_I"
    checkpoint = run / "checkpoint-40"
    checkpoint.mkdir(parents=True)
    history = [{"step": 0, "loss": 9.0}, _evaluation(0, -0.2), {"step": 40, "loss": 5.0}, _evaluation(40, 0.1)]
    (checkpoint / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert long_run.main(["--table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("| 0 | 0 | -0.200 | -0.200 | -0.200 |")
    assert lines[3].startswith("| 40 | 320 | 0.100 | 0.100 | +0.100 |") and lines[3].endswith("| 0.500 | 0.250 |")
    assert "rank accuracy at chance: 0.125 (1 / 8)" in lines[-1]
    (run / "trainer_state.json").write_text(json.dumps({"log_history": history[:2]}))  # the final state wins
    assert long_run.main(["--table"]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 0 |" in out and "| 40 |" not in out


def test_the_table_shows_the_anchor_geometry_of_the_evaluations_that_logged_it(tmp_path, capsys, monkeypatch):
    """A run that logs llm2vec.geometry at its evaluations gets a second table, one row per evaluation that has it."""
    from demo.stages import GEOMETRY

    monkeypatch.setattr(long_run, "OUT", tmp_path)
    (tmp_path / "stage_I").mkdir()
    geometry = {f"eval_geometry_{k}": 0.5 + i / 100 for i, k in enumerate(GEOMETRY)}
    chance = {"eval_geometry_infonce_chance": 4.1589, "eval_geometry_accuracy_at_1_chance": 0.0156}
    history = [_evaluation(0, -0.2), {**_evaluation(40, 0.1), **geometry, **chance}]
    (tmp_path / "stage_I" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert long_run.main(["--table"]) == 0
    out = capsys.readouterr().out
    assert "| step | pairs seen | cos docs | cos queries | top share docs |" in out
    assert "| 40 | 320 | 0.500 | 0.510 | 0.520 | 0.530 | 0.540 | 0.550 | 0.560 | 0.570 | 0.580 | 0.590 |" in out
    assert "| 0 | 0 | 0.500" not in out and "chance: InfoNCE 4.159 (ln N), accuracy@1 0.016" in out


def test_a_step_evaluated_again_after_a_resume_is_one_row_and_compared(tmp_path, monkeypatch, capsys):
    """A resumed run evaluates its first step again (eval_on_start): one row, and a line that says whether the
    repeat gave the same numbers (a resume that restored the model) or not."""
    monkeypatch.setattr(long_run, "OUT", tmp_path)
    run = tmp_path / "stage_I"
    run.mkdir()
    again = dict(_evaluation(40, 0.1), eval_runtime=12.0)
    history = [_evaluation(0, -0.2), _evaluation(40, 0.1), again, _evaluation(80, 0.05)]
    (run / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert long_run.main(["--table"]) == 0
    out = capsys.readouterr().out
    assert out.count("| 40 | 320 |") == 1 and "step 40 evaluated again when the run resumed from it: the same" in out
    history[2] = dict(again, eval_loss_q2d=0.3)
    (run / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert long_run.main(["--table"]) == 0
    assert "DIFFERENT numbers (loss_q2d 0.1 -> 0.3)" in capsys.readouterr().out


def _corpus(folder: Path, texts: list[str]) -> Path:
    """A corpus folder of demo.package_data's layout: train pairs and a validation split of one query each."""
    from demo.stdlib_data import TRAIN_FILE

    (folder / "val").mkdir(parents=True)
    rows = [{"query": f"q{i}", "positive": t, "negative": texts[i - 1]} for i, t in enumerate(texts)]
    (folder / TRAIN_FILE).parent.mkdir(parents=True, exist_ok=True)
    (folder / TRAIN_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = {
        "corpus": [{"_id": f"d{i}", "text": t} for i, t in enumerate(texts)],
        "queries": [{"_id": f"q{i}", "text": f"q{i}"} for i in range(len(texts))],
        "qrels": [{"query-id": f"q{i}", "corpus-id": f"d{i}", "score": 1} for i in range(len(texts))],
    }
    for name, rows in lines.items():
        (folder / "val" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_inputs_keep_their_modification_time_unless_the_corpus_changed(tmp_path):
    """A resume compares the data file's fingerprint, modification time included: the driver rewrites its inputs
    at every start, and must leave a file with the same bytes untouched, or no resume would be allowed."""
    out = tmp_path / "inputs"
    train, validation = long_run.write_inputs(_corpus(tmp_path / "a", ["alpha", "beta", "gamma"]), out)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert [r["positive"] for r in rows] == ["alpha", "beta", "gamma"]
    assert {r["instruction"] for r in rows} == {INSTRUCTION}
    assert len(validation.read_text().splitlines()) == 3
    for path in (train, validation):
        os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    long_run.write_inputs(tmp_path / "a", out)
    assert train.stat().st_mtime_ns == validation.stat().st_mtime_ns == 1_000_000_000
    assert sorted(p.name for p in out.iterdir()) == sorted([train.name, validation.name])  # no temporary left
    long_run.write_inputs(_corpus(tmp_path / "b", ["alpha", "beta", "delta"]), out)
    assert train.stat().st_mtime_ns != 1_000_000_000 and "delta" in train.read_text()
    assert validation.stat().st_mtime_ns != 1_000_000_000


def test_the_scale_presets_validate_on_the_long_runs_pairs_first(tmp_path):
    """demo.scale and the long run pick validation pairs one way: a preset's pairs begin with the long run's, so
    that a preset run from scratch and the long run are measured on the same pairs."""
    from demo import scale

    texts = [f"document {i} about topic {i}" for i in range(12)]
    corpus = _corpus(tmp_path / "corpus", texts)
    _, long_run_file = long_run.write_inputs(corpus, tmp_path / "long")
    ours = [json.loads(line) for line in long_run_file.read_text().splitlines()]
    assert sorted(r["positive"] for r in ours) == sorted(texts)  # every pair, once (12 < the long run's 64)
    assert all(r["positive"] == f"document {r['query'][1:]} about topic {r['query'][1:]}" for r in ours)
    for count in (5, 12):
        preset = scale.write_validation_file(corpus, tmp_path / f"preset-{count}", count)
        assert [json.loads(line) for line in preset.read_text().splitlines()] == ours[:count]
    with pytest.raises(scale.ScaleError, match="12 validation pairs, the preset needs 13"):
        scale.write_validation_file(corpus, tmp_path / "too-many", 13)
