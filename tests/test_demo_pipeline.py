"""The one-command demo (``experiments/run_demo.py``, ``experiments/demo/``): the step runner, the commands it
builds, the report, and the whole pipeline at its smoke size (tiny random model, real scripts, real mteb
evaluation)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import run_demo as cli
from demo import pipeline, report, smollm2
from demo.scripts import Hardware, training_command
from demo.settings import ANCHOR_CONFIG, BASELINE_CONFIG, SIZES, STAGE_I_CONFIG, STAGE_I_SCRIPT, TASK_NAME
from demo.steps import MARKER, Step, StepRunner, read_marker

from llm2vec.arguments import parse_config

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- configs and commands


def _config(path):
    return json.loads(Path(path).read_text())


def test_demo_configs_are_valid_and_the_two_stage_II_runs_differ_only_in_their_start():
    for stage, path in (("I", STAGE_I_CONFIG), ("II", ANCHOR_CONFIG), ("II", BASELINE_CONFIG)):
        parse_config(stage, [str(path)])  # raises on an unknown field, a field of the other stage or a bad value
        config = _config(path)
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
    overrides = {
        "model_name_or_path": config["model_name_or_path"],
        "dataset_file_path": config["dataset_file_path"],
        **SIZES["default"].training_overrides("I"),
        "output_dir": "cache/demo-runs/.stage_I.x.tmp",
    }
    cmd = training_command(STAGE_I_SCRIPT, STAGE_I_CONFIG, overrides, Hardware(gpus=0, bf16=False))
    assert cmd == [
        sys.executable,
        "experiments/run_stage_I.py",
        "train_configs/demo/SmolLM2_135m_q2d_d2q.json",
        "--output_dir",
        "cache/demo-runs/.stage_I.x.tmp",
    ]


def test_smoke_size_and_gpus_change_only_what_they_need():
    smoke = SIZES["smoke"].training_overrides("II")
    assert smoke["max_steps"] == 2 and smoke["warmup_steps"] == 0
    cmd = training_command(STAGE_I_SCRIPT, STAGE_I_CONFIG, {"output_dir": "o"}, Hardware(gpus=1, bf16=True))
    assert cmd[0] == sys.executable and cmd[-2:] == ["--bf16", "true"]
    cmd = training_command(STAGE_I_SCRIPT, STAGE_I_CONFIG, {"output_dir": "o"}, Hardware(gpus=2, bf16=False))
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    flags = dict(zip(cmd[7::2], cmd[8::2]))
    total = _config(STAGE_I_CONFIG)["total_batch_size"]
    assert flags["--per_device_train_batch_size"] == str(total // 2)


# ------------------------------------------------------------------------------ the step runner


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
    calls = []
    steps = StepRunner(fresh=False)
    first = steps.run(_step(tmp_path, calls))
    assert calls == ["s"] and read_marker(tmp_path / "s")["run_id"] == first.run_id
    assert first.marker["n"] == 1 and first.folder == tmp_path / "s"  # what the build returned is in the marker
    again = steps.run(_step(tmp_path, calls))
    assert calls == ["s"] and again.run_id == first.run_id
    assert "[s] reusing" in capsys.readouterr().out
    fresh = StepRunner(fresh=True).run(_step(tmp_path, calls))
    assert calls == ["s", "s"] and fresh.run_id != first.run_id
    assert "redoing" in capsys.readouterr().out and (tmp_path / "s" / "out.txt").read_text() == "built 2"
    # other settings (or a redone upstream step, whose run id is in the key) are not served by the old output
    steps.run(_step(tmp_path, calls, key={"v": 2}))
    assert calls == ["s", "s", "s"]
    assert [e["reused"] for e in steps.log] == [False, True, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no temporary folder left
    table = steps.table(12.0)
    assert "| s | reused | - |" in table and table.splitlines()[-1] == "| total (this run) | 12 s | |"


def test_folder_without_marker_is_redone_and_failed_build_leaves_nothing(tmp_path, capsys):
    calls = []
    half = tmp_path / "s"
    half.mkdir()
    (half / "model.safetensors").write_text("half written")
    stale = tmp_path / ".s.abc123.tmp"  # left by a hard kill
    stale.mkdir()
    steps = StepRunner()
    with pytest.raises(_Boom):
        steps.run(_step(tmp_path, calls, fail=True))
    out = capsys.readouterr().out
    assert "no completion marker" in out
    assert not stale.exists() and (half / "model.safetensors").read_text() == "half written"  # untouched on failure
    assert read_marker(half) is None
    steps.run(_step(tmp_path, calls))
    assert read_marker(half) is not None and not (half / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_cli_passes_size_and_fresh(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "run_demo", lambda size, fresh, out_dir: seen.update(size=size, fresh=fresh, out=out_dir))
    assert cli.main(["--smoke", "--fresh", "--out_dir", "x", "--stage_II_steps", "3"]) == 0
    assert seen["fresh"] is True and seen["out"] == "x"
    assert seen["size"].name == "smoke" and seen["size"].stage_II_steps == 3 and seen["size"].tiny_model
    assert cli.main([]) == 0 and seen["size"] == SIZES["default"] and seen["fresh"] is False
    with pytest.raises(SystemExit):
        cli.main(["--stage_I_steps", "0"])


def test_smollm2_step_runs_the_converter_script_or_reuses_its_checkpoint(tmp_path, monkeypatch, capsys):
    """The default size's model step: ``experiments/demo/smollm2.py --target DIR`` unless DIR is complete."""
    target = tmp_path / "SmolLM2"
    commands = []

    def convert(cmd):
        commands.append(cmd)
        target.mkdir(exist_ok=True)
        for name in ("config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json"):
            (target / name).write_text("{}")
        (target / smollm2.MARKER).write_text(json.dumps({"converted": len(commands)}))

    monkeypatch.setattr(pipeline, "SMOLLM2_DIR", target)
    monkeypatch.setattr(pipeline, "run_command", convert)
    first = pipeline.convert_smollm2(StepRunner())
    assert commands == [[sys.executable, "experiments/demo/smollm2.py", "--target", str(target)]]
    assert (REPO / commands[0][1]).is_file() and first.folder == target
    again = pipeline.convert_smollm2(StepRunner())
    assert len(commands) == 1 and again.run_id == first.run_id and "[model] reusing" in capsys.readouterr().out
    fresh = pipeline.convert_smollm2(StepRunner(fresh=True))
    assert commands[-1][-1] == "--fresh" and fresh.run_id != first.run_id  # what reads the model is redone


def test_data_step_logs_whether_the_build_was_reused(tmp_path):
    steps = StepRunner()
    first = pipeline.build_data(steps, tmp_path / "data", SIZES["smoke"])
    second = pipeline.build_data(steps, tmp_path / "data", SIZES["smoke"])
    assert [e["reused"] for e in steps.log] == [False, True] and first.run_id == second.run_id
    assert (first.folder / "train" / "stdlib.jsonl").is_file()


# ------------------------------------------------------------------------------------ the report


def test_markdown_table():
    rows = [{"label": "A", "scores": {"ndcg_at_10": 0.5, "map_at_10": 0.25}}]
    table = report.markdown_table(rows)
    assert "| A | 50.00 | 25.00 | n/a |" in table and table.splitlines()[0].count("|") == len(report.METRICS) + 2


def _png_size(path):
    from matplotlib.image import imread

    height, width, _ = imread(path).shape
    return width, height


def test_loss_plot_draws_the_histories(tmp_path):
    """The lines drawn are the histories given and their moving average; other histories, another image."""
    anchor = [(s, 3.0 - 0.1 * s + 0.05 * (s % 3)) for s in range(1, 17)]
    baseline = [(s, 3.1 - 0.05 * s) for s in range(1, 17)]
    drawn = report.plot_losses({"Anchor": anchor, "Baseline": baseline}, tmp_path / "a.png", "t")
    for label, history in (("Anchor", anchor), ("Baseline", baseline)):
        assert drawn[label]["steps"] == [s for s, _ in history]
        assert drawn[label]["loss"] == [v for _, v in history]
        assert drawn[label]["window"] == 2  # 16 points: a mean of 2
        losses = drawn[label]["loss"]
        assert drawn[label]["mean"] == pytest.approx([losses[0]] + [(a + b) / 2 for a, b in zip(losses, losses[1:])])
    assert _png_size(tmp_path / "a.png") == (840, 504)  # 7 x 4.2 inches at 120 dpi
    report.plot_losses({"Anchor": anchor, "Baseline": baseline}, tmp_path / "same.png", "t")
    assert (tmp_path / "same.png").read_bytes() == (tmp_path / "a.png").read_bytes()
    report.plot_losses({"Anchor": baseline, "Baseline": anchor}, tmp_path / "swapped.png", "t")
    assert (tmp_path / "swapped.png").read_bytes() != (tmp_path / "a.png").read_bytes()


# ------------------------------------------------------------------------------ the whole pipeline


def _run_demo(out_dir, cwd, *flags):
    """``python experiments/run_demo.py --smoke`` run from ``cwd``: every default path comes from the script."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "run_demo.py"), "--smoke", "--out_dir", str(out_dir), *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


FOLDERS = {"train_file": "data"}
STEPS = [
    "model",
    "train_file",
    "stage_I",
    "stage_II_anchor",
    "stage_II_baseline",
    "eval_untrained",
    "eval_stage_I",
    "eval_baseline",
    "eval_anchor",
    "report",
]
ROWS = {
    "untrained": "Untrained (no training)",
    "stage_I": "Stage I only",
    "baseline": "Stage II only (Baseline)",
    "anchor": "Stage I + II (Anchor)",
}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    out = root / "smoke"
    return out, _run_demo(out, cwd=root)


def _mteb_scores(folder):
    """The test-split scores of the local task in the mteb result files of an evaluation step."""
    (path,) = sorted(Path(folder, "mteb").rglob(f"{TASK_NAME}.json"))
    (scores,) = json.loads(path.read_text())["scores"]["test"]
    return scores


def _loss_history(folder):
    history = json.loads(Path(folder, "trainer_state.json").read_text())["log_history"]
    return [[entry["step"], entry["loss"]] for entry in history if "loss" in entry]


def test_smoke_run_reports_the_evaluations_scores(smoke_run):
    out, stdout = smoke_run
    results = (out / "report" / "results.md").read_text()
    assert results.strip() in stdout  # the table is printed too
    summary = json.loads((out / "report" / "results.json").read_text())
    assert [(r["row"], r["label"]) for r in summary["rows"]] == list(ROWS.items())
    lines = results.splitlines()
    header = next(x for x in lines if x.startswith("| Model"))
    assert [cell.strip() for cell in header.strip("|").split("|")][1:] == [title for _, title in report.METRICS]
    for row in summary["rows"]:
        mteb = _mteb_scores(out / "eval" / row["row"])
        for key, _ in report.METRICS:
            assert row["scores"][key] == mteb[key]  # results.json: mteb's numbers
        line = next(x for x in lines if x.startswith(f"| {row['label']} |"))
        cells = [cell.strip() for cell in line.strip("|").split("|")][1:]
        assert cells == [f"{100 * mteb[key]:.2f}" for key, _ in report.METRICS]  # the table: the same, x 100
        assert read_marker(out / "eval" / row["row"])["run_id"] == row["run_id"]
    anchor, baseline = (_mteb_scores(out / "eval" / r)["ndcg_at_10"] for r in ("anchor", "baseline"))
    assert summary["anchor_beats_baseline"] == (anchor > baseline)
    assert f"({100 * anchor:.2f} vs {100 * baseline:.2f})" in results


def test_smoke_run_plots_the_stage_II_loss_of_both_runs(smoke_run, tmp_path):
    out, stdout = smoke_run
    summary = json.loads((out / "report" / "results.json").read_text())
    histories = {
        report.ANCHOR_RUN: _loss_history(out / "stage_II_anchor"),
        report.BASELINE_RUN: _loss_history(out / "stage_II_baseline"),
    }
    assert summary["stage_II_loss"] == histories
    assert all([s for s, _ in h] == [1, 2] for h in histories.values())  # one logged loss per step
    plot = out / "report" / "stage_II_loss.png"
    assert _png_size(plot) == (840, 504)
    # the image is the plot of those histories (the plot is byte-for-byte reproducible, see above)
    report.plot_losses(
        {k: [tuple(p) for p in v] for k, v in histories.items()},
        tmp_path / "again.png",
        report.loss_plot_title("smoke"),
    )
    assert (tmp_path / "again.png").read_bytes() == plot.read_bytes()
    assert f"loss plot: {plot}" in stdout


def test_smoke_run_layout(smoke_run):
    out, stdout = smoke_run
    for name in ("stage_I", "stage_II_anchor", "stage_II_baseline"):
        assert (out / name / "trainer_state.json").is_file() and not list((out / name).glob("checkpoint-*"))
    assert (out / "stage_I" / "model.safetensors").is_file()
    assert (out / "stage_II_anchor" / "adapter_model.safetensors").is_file()
    assert (out / "demo-data" / "manifest.json").is_file()  # the smoke size keeps its own data
    for name in STEPS:
        folder = out / "eval" / name[len("eval_") :] if name.startswith("eval_") else out / FOLDERS.get(name, name)
        assert read_marker(folder) is not None, name
    assert not list(out.rglob("*.tmp")) and "table: " in stdout and "numbers (json): " in stdout


def test_second_run_reuses_every_step_and_an_interrupted_one_is_redone(smoke_run):
    out, _ = smoke_run
    stdout = _run_demo(out, cwd=REPO)
    for name in STEPS:
        assert f"[{name}] reusing" in stdout, name
    assert "$ " not in stdout  # no command was run
    # an interrupted training: the folder exists but its completion marker was never written
    (out / "stage_II_baseline" / MARKER).unlink()
    anchor_eval = read_marker(out / "eval" / "anchor")["run_id"]
    stdout = _run_demo(out, cwd=REPO)
    assert "[stage_II_baseline] redoing" in stdout and "no completion marker" in stdout
    assert "[eval_baseline] redoing" in stdout and "[report] redoing" in stdout  # what reads it is redone too
    for name in ("model", "train_file", "stage_I", "stage_II_anchor", "eval_untrained", "eval_stage_I", "eval_anchor"):
        assert f"[{name}] reusing" in stdout, name
    assert read_marker(out / "stage_II_baseline") is not None
    assert read_marker(out / "eval" / "anchor")["run_id"] == anchor_eval
