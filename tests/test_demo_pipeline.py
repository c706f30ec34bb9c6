"""The one-command demo (``experiments/run_demo.py``): the step machinery, the commands it builds, and the
whole pipeline at its smoke size (tiny random model, real scripts, real mteb evaluation)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llm2vec.arguments import parse_args
from llm2vec.demo import pipeline
from llm2vec.demo.pipeline import (
    ANCHOR_CONFIG,
    BASELINE_CONFIG,
    MARKER,
    SIZES,
    STAGE_I_CONFIG,
    STAGE_I_SCRIPT,
    Hardware,
    Step,
    read_marker,
    run_step,
    training_command,
)

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- configs and commands


def _config(path):
    return json.loads(Path(path).read_text())


def test_demo_configs_are_valid_and_the_two_stage_II_runs_differ_only_in_their_start():
    for path in (STAGE_I_CONFIG, ANCHOR_CONFIG, BASELINE_CONFIG):
        *_, config, _ = parse_args([str(path)])  # raises on an unknown field or a bad value
        assert config["logging_steps"] == 1, path  # one loss point per step for the plot
        assert config["save_strategy"] == "no", path  # the driver saves the final model and trainer_state.json
    anchor, baseline = _config(ANCHOR_CONFIG), _config(BASELINE_CONFIG)
    differ = {k for k in anchor if anchor[k] != baseline.get(k)}
    assert differ == {"model_name_or_path", "output_dir"}
    assert anchor["model_name_or_path"] == _config(STAGE_I_CONFIG)["output_dir"]
    assert baseline["model_name_or_path"] == _config(STAGE_I_CONFIG)["model_name_or_path"]


def test_default_size_runs_the_configs_as_they_are():
    """The default run passes no flag but the output folder: the demo configs are the run."""
    config = _config(STAGE_I_CONFIG)
    overrides = {"model_name_or_path": config["model_name_or_path"], "dataset_file_path": config["dataset_file_path"],
                 **pipeline._size_overrides(SIZES["default"], "I"), "output_dir": "cache/demo-runs/.stage_I.x.tmp"}
    cmd = training_command(STAGE_I_SCRIPT, STAGE_I_CONFIG, overrides, Hardware(gpus=0, bf16=False))
    assert cmd == [sys.executable, "experiments/run_stage_I.py", "train_configs/demo/SmolLM2_135m_q2d_d2q.json",
                   "--output_dir", "cache/demo-runs/.stage_I.x.tmp"]


def test_smoke_size_and_gpus_change_only_what_they_need():
    smoke = pipeline._size_overrides(SIZES["smoke"], "II")
    assert smoke["max_steps"] == 2 and smoke["warmup_steps"] == 0
    cmd = training_command(STAGE_I_SCRIPT, STAGE_I_CONFIG, {"output_dir": "o"}, Hardware(gpus=1, bf16=True))
    assert cmd[0] == sys.executable and cmd[-2:] == ["--bf16", "true"]
    cmd = training_command(STAGE_I_SCRIPT, STAGE_I_CONFIG, {"output_dir": "o"}, Hardware(gpus=2, bf16=False))
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    flags = dict(zip(cmd[7::2], cmd[8::2]))
    total = _config(STAGE_I_CONFIG)["total_batch_size"]
    assert flags["--per_device_train_batch_size"] == str(total // 2)


# ------------------------------------------------------------------------------ the step machinery


class _Boom(Exception):
    pass


def _step(tmp_path, calls, name="s", key=None, fail=False):
    def build(folder):
        calls.append(name)
        (folder / "out.txt").write_text(f"built {len(calls)}")
        if fail:
            raise _Boom
        return {"n": len(calls)}

    return Step(name, f"make {name}", tmp_path / name, key or {"v": 1}, build)


def test_step_is_reused_redone_when_fresh_or_changed(tmp_path, capsys):
    calls, log = [], []
    first = run_step(_step(tmp_path, calls), fresh=False, log=log)
    assert calls == ["s"] and read_marker(tmp_path / "s")["run_id"] == first["run_id"]
    again = run_step(_step(tmp_path, calls), fresh=False, log=log)
    assert calls == ["s"] and again["run_id"] == first["run_id"]
    assert "[s] reusing" in capsys.readouterr().out
    fresh = run_step(_step(tmp_path, calls), fresh=True, log=log)
    assert calls == ["s", "s"] and fresh["run_id"] != first["run_id"]
    assert "redoing" in capsys.readouterr().out and (tmp_path / "s" / "out.txt").read_text() == "built 2"
    # other settings (or a redone upstream step, whose run id is in the key) are not served by the old output
    run_step(_step(tmp_path, calls, key={"v": 2}), fresh=False, log=log)
    assert calls == ["s", "s", "s"]
    assert [e["reused"] for e in log] == [False, True, False, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no temporary folder left


def test_folder_without_marker_is_redone_and_failed_build_leaves_nothing(tmp_path, capsys):
    calls = []
    half = tmp_path / "s"
    half.mkdir()
    (half / "model.safetensors").write_text("half written")
    stale = tmp_path / ".s.abc123.tmp"  # left by a hard kill
    stale.mkdir()
    with pytest.raises(_Boom):
        run_step(_step(tmp_path, calls, fail=True), fresh=False, log=[])
    out = capsys.readouterr().out
    assert "no completion marker" in out
    assert not stale.exists() and (half / "model.safetensors").read_text() == "half written"  # untouched on failure
    assert read_marker(half) is None
    run_step(_step(tmp_path, calls), fresh=False, log=[])
    assert read_marker(half) is not None and not (half / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_cli_passes_size_and_fresh(monkeypatch):
    seen = {}
    monkeypatch.setattr(pipeline, "run_demo", lambda size, fresh, out_dir: seen.update(size=size, fresh=fresh, out=out_dir))
    assert pipeline.main(["--smoke", "--fresh", "--out_dir", "x", "--stage_II_steps", "3"]) == 0
    assert seen["fresh"] is True and seen["out"] == "x"
    assert seen["size"].name == "smoke" and seen["size"].stage_II_steps == 3 and seen["size"].tiny_model
    assert pipeline.main([]) == 0 and seen["size"] == SIZES["default"] and seen["fresh"] is False


def test_markdown_table_and_loss_plot(tmp_path):
    rows = [{"label": "A", "scores": {"ndcg_at_10": 0.5, "map_at_10": 0.25}}]
    table = pipeline.markdown_table(rows)
    assert "| A | 50.00 | 25.00 | n/a |" in table and table.splitlines()[0].count("|") == len(pipeline.METRICS) + 2
    path = tmp_path / "loss.png"
    pipeline.plot_losses({"Anchor": [(1, 3.0), (2, 2.0), (3, 1.5)], "Baseline": [(1, 3.1), (2, 2.5), (3, 2.0)]},
                         path, "t")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


# ------------------------------------------------------------------------------ the whole pipeline


def _run_demo(out_dir, *flags):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "run_demo.py"), "--smoke", "--out_dir",
                           str(out_dir), *flags], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


FOLDERS = {"train_file": "data"}
STEPS = ["model", "train_file", "stage_I", "stage_II_anchor", "stage_II_baseline",
         "eval_untrained", "eval_stage_I", "eval_baseline", "eval_anchor", "report"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "smoke"
    return out, _run_demo(out)


def test_smoke_run_writes_the_table_and_the_plot(smoke_run):
    out, stdout = smoke_run
    results = (out / "report" / "results.md").read_text()
    for label in ("Untrained (no training)", "Stage I only", "Stage II only (Baseline)", "Stage I + II (Anchor)"):
        line = next(line for line in results.splitlines() if line.startswith(f"| {label} |"))
        ndcg = line.split("|")[2].strip()
        assert 0.0 <= float(ndcg) <= 100.0, line
    assert results.strip() in stdout  # the table is printed too
    assert (out / "report" / "stage_II_loss.png").read_bytes()[:8] == PNG_SIGNATURE
    summary = json.loads((out / "report" / "results.json").read_text())
    assert [r["row"] for r in summary["rows"]] == ["untrained", "stage_I", "baseline", "anchor"]
    for run in ("Anchor (Stage I, then Stage II)", "Baseline (Stage II only)"):
        assert [s for s, _ in summary["stage_II_loss"][run]] == [1, 2]  # one logged loss per step
    for name in ("stage_I", "stage_II_anchor", "stage_II_baseline"):
        assert (out / name / "trainer_state.json").is_file() and not list((out / name).glob("checkpoint-*"))
    assert (out / "stage_I" / "model.safetensors").is_file()
    assert (out / "stage_II_anchor" / "adapter_model.safetensors").is_file()
    for name in STEPS:
        folder = out / "eval" / name[len("eval_"):] if name.startswith("eval_") else out / FOLDERS.get(name, name)
        assert read_marker(folder) is not None, name
    assert not list(out.rglob("*.tmp")) and "table: " in stdout and "loss plot: " in stdout


def test_second_run_reuses_every_step_and_an_interrupted_one_is_redone(smoke_run):
    out, _ = smoke_run
    stdout = _run_demo(out)
    for name in STEPS:
        assert f"[{name}] reusing" in stdout, name
    assert "$ " not in stdout  # no command was run
    # an interrupted training: the folder exists but its completion marker was never written
    (out / "stage_II_baseline" / MARKER).unlink()
    anchor_eval = read_marker(out / "eval" / "anchor")["run_id"]
    stdout = _run_demo(out)
    assert "[stage_II_baseline] redoing" in stdout and "no completion marker" in stdout
    assert "[eval_baseline] redoing" in stdout and "[report] redoing" in stdout  # what reads it is redone too
    for name in ("model", "train_file", "stage_I", "stage_II_anchor", "eval_untrained", "eval_stage_I", "eval_anchor"):
        assert f"[{name}] reusing" in stdout, name
    assert read_marker(out / "stage_II_baseline") is not None
    assert read_marker(out / "eval" / "anchor")["run_id"] == anchor_eval
