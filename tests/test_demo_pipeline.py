"""The one-command demo (``experiments/run_demo.py``, ``experiments/demo/``): the step runner, the commands it
builds, the report, and the whole pipeline at its smoke size (tiny random model, real scripts, real mteb
evaluation)."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import run_demo as cli
from demo import pipeline, report, smollm2
from demo.pipeline import MARKER, Hardware, Step, StepRunner, read_marker, training_command
from demo.settings import (
    ANCHOR_CONFIG,
    BASELINE_CONFIG,
    DEFAULT_SEED,
    DEFAULT_SEEDS,
    PRESETS,
    SIZES,
    STAGE_I_CONFIG,
    STAGE_I_EVAL,
    STAGE_I_SCRIPT,
    TASK_NAME,
)

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


def test_demo_warm_up_is_the_papers_share_of_each_run():
    """The paper's runs warm up for 300 of 2000 Stage I steps and 300 of 1000 Stage II steps (Appendix A.2, the
    authors' configs): the demo configs, as the drivers parse them, and any step override keep those shares."""
    paper = {"I": (300, 2000), "II": (300, 1000)}  # (warm-up steps, steps of the run)
    for stage, path in (("I", STAGE_I_CONFIG), ("II", ANCHOR_CONFIG), ("II", BASELINE_CONFIG)):
        warmup, steps = paper[stage]
        training = parse_config(stage, [str(path)]).training
        assert training.max_steps > 0 and training.warmup_steps == round(warmup * training.max_steps / steps), path
    for n in (10, 40, 100):
        size = dataclasses.replace(SIZES["default"], stage_I_steps=n, stage_II_steps=n)
        for stage, (warmup, steps) in paper.items():
            assert size.training_overrides(stage)["warmup_steps"] == round(warmup * n / steps), (stage, n)


def test_smoke_size_and_gpus_change_only_what_they_need():
    smoke = SIZES["smoke"].training_overrides("II")
    assert smoke["max_steps"] == 2 and smoke["warmup_steps"] == 1  # 30% of the run, rounded
    assert SIZES["smoke"].training_overrides("I")["warmup_steps"] == 0  # 15%
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


def test_cli_passes_size_fresh_seeds_split_and_threads(monkeypatch):
    seen = {}

    def fake(size, fresh, out_dir, seeds, split, threads):
        seen.update(size=size, fresh=fresh, out=out_dir, seeds=seeds, split=split, threads=threads)

    monkeypatch.setattr(cli, "run_demo", fake)
    flags = ["--smoke", "--fresh", "--out_dir", "x", "--stage_II_steps", "3", "--seeds", "3", "--seed", "7"]
    assert cli.main([*flags, "--validate", "--threads", "2", "--stage_II_learning_rate", "3e-4"]) == 0
    assert seen["size"].stage_II_learning_rate == 3e-4
    assert seen["size"].training_overrides("II")["learning_rate"] == 3e-4
    assert "learning_rate" not in seen["size"].training_overrides("I")
    assert seen["fresh"] is True and seen["out"] == "x"
    assert seen["size"].name == "smoke" and seen["size"].stage_II_steps == 3 and seen["size"].tiny_model
    assert seen["seeds"] == (7, 8, 9) and seen["split"] == "validation" and seen["threads"] == 2
    assert cli.main([]) == 0 and seen["size"] == SIZES["default"] and seen["fresh"] is False
    assert seen["seeds"] == tuple(range(DEFAULT_SEED, DEFAULT_SEED + DEFAULT_SEEDS)) and seen["split"] == "test"
    assert DEFAULT_SEEDS == PRESETS["default"] == 2 and PRESETS["full"] == 3
    assert cli.main(["--preset", "full"]) == 0 and seen["seeds"] == (42, 43, 44) and seen["size"] == SIZES["default"]
    assert cli.main(["--preset", "full", "--seeds", "1"]) == 0 and seen["seeds"] == (42,)  # --seeds wins
    for bad in (["--stage_I_steps", "0"], ["--seeds", "0"], ["--threads", "0"], ["--stage_II_learning_rate", "0"]):
        with pytest.raises(SystemExit):
            cli.main(bad)


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


def test_rows_aggregate_per_seed_scores_into_mean_and_sample_std():
    """Each trained row's mean and spread equal the statistics module's over that row's seeds, metric by
    metric; the untrained row stays single; the tables show mean ± std and every seed."""
    import random
    import statistics

    rng = random.Random(0)
    keys = [k for k, _ in report.METRICS]
    untrained = {"row": "untrained", "label": "U", "scores": {k: rng.random() for k in keys}}
    seeds = {
        s: [{"row": r, "label": r.upper(), "scores": {k: rng.random() for k in keys}} for r in ("stage_I", "anchor")]
        for s in (42, 43, 44)
    }
    rows = report.aggregate(untrained, seeds)
    assert [r["row"] for r in rows] == ["untrained", "stage_I", "anchor"]
    assert rows[0]["mean"] == untrained["scores"] and rows[0]["std"] is None and rows[0]["per_seed"] is None
    for i, row in enumerate(rows[1:]):
        for k in keys:
            values = [seeds[s][i]["scores"][k] for s in (42, 43, 44)]
            assert row["per_seed"] == {str(s): seeds[s][i]["scores"] for s in (42, 43, 44)}
            assert row["mean"][k] == pytest.approx(statistics.mean(values), rel=1e-12)
            assert row["std"][k] == pytest.approx(statistics.stdev(values), rel=1e-12)
    one = report.aggregate(untrained, {42: seeds[42]})
    assert one[1]["std"] is None and one[1]["mean"] == seeds[42][0]["scores"]
    difference = {"per_seed": {"42": 0.1, "43": -0.05, "44": 0.2}, "mean": 0.25 / 3, "std": 0.1}
    tables = report.markdown_tables(rows, difference)
    a = rows[2]
    cell = f"{100 * a['mean']['ndcg_at_10']:.2f} ± {100 * a['std']['ndcg_at_10']:.2f}"
    assert f"| ANCHOR | {cell} |" in tables
    assert "| Anchor - Baseline | +10.00 | -5.00 | +20.00 |" in tables
    assert "+8.33 ± 10.00 (sample std) over 3 seed(s); positive in 2 of 3" in tables


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
    # validation nDCG@10 beside the loss: the points given, on the right axis
    scores = {"Anchor": [(0, 0.1), (5, 0.4), (10, 0.55)], "Baseline": [(0, 0.1), (5, 0.2)]}
    drawn = report.plot_losses({"Anchor": anchor, "Baseline": baseline}, tmp_path / "s.png", "t", scores)
    for label, points in scores.items():
        assert drawn[label]["score_steps"] == [s for s, _ in points]
        assert drawn[label]["score"] == pytest.approx([v for _, v in points])
    assert (tmp_path / "s.png").read_bytes() != (tmp_path / "a.png").read_bytes()


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


SEEDS = (42, 43)
TRAINED = ("stage_I", "baseline", "anchor")
STEPS = (
    ["model", "train_file", "validation_file", "eval_untrained"]
    + [
        f"seed{s}/{name}"
        for s in SEEDS
        for name in ("stage_I", "stage_II_anchor", "stage_II_baseline", *(f"eval_{r}" for r in TRAINED))
    ]
    + ["report"]
)
ROWS = {
    "untrained": "Untrained (no training)",
    "stage_I": "Stage I only",
    "baseline": "Stage II only (Baseline)",
    "anchor": "Stage I + II (Anchor)",
}
SMOKE_FLAGS = ("--seeds", "2", "--threads", "2")


def _step_folder(out, name):
    """The folder of a step of the smoke run, by its name."""
    seed, _, step = name.rpartition("/")
    base = out / seed if seed else out
    if step.startswith("eval_"):
        return base / "eval" / step[len("eval_") :]
    return base / {"train_file": "data", "validation_file": "validation"}.get(step, step)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    out = root / "smoke"
    return out, _run_demo(out, root, *SMOKE_FLAGS)


def _mteb_scores(folder):
    """The test-split scores of the local task in the mteb result files of an evaluation step."""
    (path,) = sorted(Path(folder, "mteb").rglob(f"{TASK_NAME}.json"))
    (scores,) = json.loads(path.read_text())["scores"]["test"]
    return scores


def _loss_history(folder):
    history = json.loads(Path(folder, "trainer_state.json").read_text())["log_history"]
    return [[entry["step"], entry["loss"]] for entry in history if "loss" in entry]


def test_smoke_run_reports_every_seed_and_their_mean_and_spread(smoke_run):
    """results.json: mteb's numbers per seed, their mean and sample std per row, the untrained row once;
    results.md: the same numbers x 100; the Anchor - Baseline difference per seed and its mean."""
    import statistics

    out, stdout = smoke_run
    results = (out / "report" / "results.md").read_text()
    assert results.strip() in stdout  # the table is printed too
    summary = json.loads((out / "report" / "results.json").read_text())
    assert summary["seeds"] == list(SEEDS) and summary["split"] == "test"
    assert [(r["row"], r["label"]) for r in summary["rows"]] == list(ROWS.items())
    untrained = summary["rows"][0]
    mteb_untrained = _mteb_scores(out / "eval" / "untrained")
    assert untrained["per_seed"] is None and untrained["mean"] == {k: mteb_untrained[k] for k, _ in report.METRICS}
    lines = results.splitlines()
    for row in summary["rows"][1:]:
        per_seed = {str(s): _mteb_scores(out / f"seed{s}" / "eval" / row["row"]) for s in SEEDS}
        for key, _ in report.METRICS:
            assert {s: v[key] for s, v in row["per_seed"].items()} == {s: v[key] for s, v in per_seed.items()}
            values = [v[key] for v in per_seed.values()]
            assert row["mean"][key] == pytest.approx(statistics.mean(values), rel=1e-12)
            assert row["std"][key] == pytest.approx(statistics.stdev(values), rel=1e-12)
        line = next(x for x in lines if x.startswith(f"| {row['label']} |"))
        cells = [cell.strip() for cell in line.strip("|").split("|")][1:]
        assert cells == [f"{100 * row['mean'][k]:.2f} ± {100 * row['std'][k]:.2f}" for k, _ in report.METRICS]
    diff = summary["anchor_minus_baseline"]
    for s in SEEDS:
        a, b = (_mteb_scores(out / f"seed{s}" / "eval" / r)["ndcg_at_10"] for r in ("anchor", "baseline"))
        assert diff["per_seed"][str(s)] == pytest.approx(a - b, abs=1e-12)
    assert diff["mean"] == pytest.approx(statistics.mean(diff["per_seed"].values()), abs=1e-12)
    assert f"Anchor - Baseline, nDCG@10: {100 * diff['mean']:+.2f}" in results
    # how many Stage II runs end below 0.7 x chance, and where each first got there
    chance, final = summary["stage_II_chance_loss"], summary["stage_II_final_loss"]
    below = sum(loss < report.STABLE_SHARE * chance for runs in final.values() for loss in runs.values())
    assert f"Runs whose final loss is below {report.STABLE_SHARE} x chance: {below} of {2 * len(SEEDS)}." in results
    firsts = {}
    for s, runs in summary["stage_II_loss"].items():
        for run, points in runs.items():
            steps = [step for step, loss in points if loss < report.STABLE_SHARE * chance]
            firsts[(s, run.split(" ")[0])] = str(steps[0]) if steps else "never"
    line = next(x for x in lines if x.startswith("First step whose loss is below"))
    for (s, run), first in firsts.items():
        assert f"{run} {first}" in line.split(f"seed {s} ")[1].split(";")[0]
        assert summary["first_step_below_0.7_chance"][s][run] == first
    # the bar of a run that trained, recomputed from each run's own trainer_state.json: the mean of its last 5 losses < 0.5 x chance
    trained = {str(s): [] for s in SEEDS}
    for s in SEEDS:
        for run, folder in (("Anchor", "stage_II_anchor"), ("Baseline", "stage_II_baseline")):
            tail = [loss for _, loss in _loss_history(out / f"seed{s}" / folder)][-5:]
            if sum(tail) / len(tail) < 0.5 * math.log(2 * SIZES["smoke"].batch_size):
                trained[str(s)].append(run)
    assert summary["stage_II_trained"] == trained
    count = sum(map(len, trained.values()))
    assert f"Runs that trained (mean of the last 5 losses below 0.5 x chance): {count} of {2 * len(SEEDS)}" in results
    # Stage I only - Untrained per seed, from mteb's own files
    untrained_ndcg = mteb_untrained["ndcg_at_10"]
    cells = [
        f"{100 * (_mteb_scores(out / f'seed{s}' / 'eval' / 'stage_I')['ndcg_at_10'] - untrained_ndcg):+.2f}"
        for s in SEEDS
    ]
    assert "| Stage I only - Untrained | " + " | ".join(cells) + " |" in lines


def test_smoke_run_trains_each_seed_with_its_seed_and_plots_every_loss(smoke_run, tmp_path):
    out, stdout = smoke_run
    summary = json.loads((out / "report" / "results.json").read_text())
    histories = {
        str(s): {
            report.ANCHOR_RUN: _loss_history(out / f"seed{s}" / "stage_II_anchor"),
            report.BASELINE_RUN: _loss_history(out / f"seed{s}" / "stage_II_baseline"),
        }
        for s in SEEDS
    }
    assert summary["stage_II_loss"] == histories
    for s in SEEDS:  # each Stage II run's validation nDCG@10 at the start and at its end, from its own log
        for run, folder in ((report.ANCHOR_RUN, "stage_II_anchor"), (report.BASELINE_RUN, "stage_II_baseline")):
            logged = json.loads((out / f"seed{s}" / folder / "trainer_state.json").read_text())["log_history"]
            expected = [[h["step"], h["eval_ndcg_at_10"]] for h in logged if "eval_ndcg_at_10" in h]
            assert [e[0] for e in expected] == [0, 2]
            assert summary["stage_II_validation_ndcg_at_10"][str(s)][run] == expected
    assert all([s for s, _ in h] == [1, 2] for runs in histories.values() for h in runs.values())
    for s in SEEDS:
        for run in ("stage_I", "stage_II_anchor", "stage_II_baseline"):
            assert json.loads((out / f"seed{s}" / run / "run_config.json").read_text())["seed"] == s
    assert histories["42"] != histories["43"]  # another seed, another run
    chance = summary["stage_II_chance_loss"]
    assert chance == pytest.approx(math.log(2 * SIZES["smoke"].batch_size))
    assert summary["stage_II_final_loss"]["43"][report.ANCHOR_RUN] == histories["43"][report.ANCHOR_RUN][-1][1]
    tail = [loss for _, loss in histories["43"][report.ANCHOR_RUN][-report.END_STEPS :]]
    ends = summary[f"stage_II_mean_loss_of_the_last_{report.END_STEPS}_steps"]
    assert ends["43"][report.ANCHOR_RUN] == pytest.approx(sum(tail) / len(tail))
    plot = out / "report" / "stage_II_loss.png"
    assert _png_size(plot) == (840, 504)
    # the image is the plot of every seed's two histories (the plot is byte-for-byte reproducible, see above)
    drawn = {
        f"{r.split(' ')[0]}, seed {s}": [tuple(p) for p in h] for s, runs in histories.items() for r, h in runs.items()
    }
    scores = {
        f"{r.split(' ')[0]}, seed {s}": [tuple(p) for p in h]
        for s, runs in summary["stage_II_validation_ndcg_at_10"].items()
        for r, h in runs.items()
    }
    report.plot_losses(drawn, tmp_path / "again.png", report.loss_plot_title("smoke"), scores)
    assert (tmp_path / "again.png").read_bytes() == plot.read_bytes()
    assert f"loss plot: {plot}" in stdout


def test_smoke_run_reports_the_anchor_gain_of_each_seeds_stage_I(smoke_run):
    """Each seed's Stage I evaluates the validation pairs at the start and at its end; the report shows what its
    trainer_state.json logged, and the last evaluation is the anchor gain of the saved Stage I model on those pairs
    (llm2vec.anchor_gain, tested against a per-pair reference in tests/test_anchor_gain.py)."""
    from llm2vec.anchor_gain import anchor_gain
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import load_jsonl
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    out, _ = smoke_run
    summary = json.loads((out / "report" / "results.json").read_text())
    results = (out / "report" / "results.md").read_text()
    pairs = load_jsonl([str(out / "validation" / "validation.jsonl")], global_batch_size=1, seed=0).examples
    assert len(pairs) > 2
    for s in SEEDS:
        logged = json.loads((out / f"seed{s}" / "stage_I" / "trainer_state.json").read_text())["log_history"]
        evals = [h for h in logged if "eval_anchor_gain_d2q" in h]
        assert [e["step"] for e in evals] == [0, 2]  # eval_on_start, then the end of the 2 smoke steps
        got = summary["stage_I_validation"][str(s)]
        assert [g["step"] for g in got] == [0, 2]
        for g, e in zip(got, evals):
            assert g["anchor_gain_d2q"] == e["eval_anchor_gain_d2q"] and g["loss_q2d"] == e["eval_loss_q2d"]
        model = LLM2Vec_q2d_d2q.load(str(out / f"seed{s}" / "stage_I"), max_length=SIZES["smoke"].max_seq_length)
        collate = TrainCollator.for_encoder(model, reconstruction="text", instruction_separator="; ")
        size = STAGE_I_EVAL["per_device_eval_batch_size"]
        batches = [collate(pairs[i : i + size]) for i in range(0, len(pairs), size)]
        if len(batches[-1]["query"]["input_ids"]) < 2:
            batches[-2:] = [collate(pairs[len(pairs) - size - 1 :])]
        after = anchor_gain(model, batches)
        for d in ("q2d", "d2q"):
            assert got[-1][f"anchor_gain_{d}"] == pytest.approx(after[f"anchor_gain_{d}"], abs=1e-4)
        last = got[-1]
        assert f"| {s} | 2 | {last['anchor_gain_q2d']:+.3f} | {last['anchor_gain_d2q']:+.3f} |" in results


def test_smoke_run_layout(smoke_run):
    out, stdout = smoke_run
    for s in SEEDS:
        for name in ("stage_I", "stage_II_anchor", "stage_II_baseline"):
            run = out / f"seed{s}" / name
            assert (run / "trainer_state.json").is_file() and not list(run.glob("checkpoint-*"))
        assert (out / f"seed{s}" / "stage_I" / "model.safetensors").is_file()
        assert (out / f"seed{s}" / "stage_II_anchor" / "adapter_model.safetensors").is_file()
    assert (out / "demo-data" / "manifest.json").is_file()  # the smoke size keeps its own data
    for name in STEPS:
        assert read_marker(_step_folder(out, name)) is not None, name
    assert not list(out.rglob("*.tmp")) and "table: " in stdout and "numbers (json): " in stdout


def test_a_second_run_of_the_same_command_gives_the_same_numbers(smoke_run, tmp_path):
    """Seed 42 redone from scratch in another folder (same thread count, same machine; ``--seeds 1``, half the
    cost of both seeds, the same code for each seed): every number of its report equals the first run's, and
    its untrained row, to the last bit (JSON round-trips floats exactly)."""
    out, _ = smoke_run
    again = tmp_path / "again"
    _run_demo(again, tmp_path, "--seeds", "1", "--threads", "2")
    first = json.loads((out / "report" / "results.json").read_text())
    second = json.loads((again / "report" / "results.json").read_text())
    assert second["seeds"] == [42] and second["threads"] == first["threads"] == 2
    assert [r["row"] for r in second["rows"]] == [r["row"] for r in first["rows"]]
    assert second["rows"][0]["mean"] == first["rows"][0]["mean"]  # untrained
    for a, b in zip(first["rows"][1:], second["rows"][1:], strict=True):
        assert b["per_seed"] == {"42": a["per_seed"]["42"]}, a["row"]
    per_seed = [k for k, v in first.items() if isinstance(v, dict) and set(v) == {str(s) for s in SEEDS}]
    assert {"stage_I_validation", "stage_II_loss", "stage_II_final_loss", "stage_II_trained"} <= set(per_seed)
    for key in per_seed:
        assert second[key] == {"42": first[key]["42"]}, key
    assert second["anchor_minus_baseline"]["per_seed"] == {"42": first["anchor_minus_baseline"]["per_seed"]["42"]}
    assert second["stage_II_chance_loss"] == first["stage_II_chance_loss"]


def test_validation_split_reuses_the_training_and_reports_apart(smoke_run):
    """``--validate`` (here for seed 42 alone: the same path for every seed, at half the cost) evaluates the trained
    models on the validation split, reusing every training step, and reports beside the test-split report."""
    out, _ = smoke_run
    stdout = _run_demo(out, REPO, "--seeds", "1", "--threads", "2", "--validate")
    for name in ("stage_I", "stage_II_anchor", "stage_II_baseline"):
        assert f"[seed42/{name}] reusing" in stdout
    assert "seed43" not in stdout
    summary = json.loads((out / "report_validation" / "results.json").read_text())
    assert summary["split"] == "validation" and summary["seeds"] == [42]
    manifest = json.loads((out / "demo-data" / "manifest.json").read_text())
    scores = _mteb_scores(out / "seed42" / "eval_validation" / "anchor")
    assert summary["rows"][3]["per_seed"]["42"] == {k: scores[k] for k, _ in report.METRICS}
    command = json.loads((out / "seed42" / "eval_validation" / "anchor" / MARKER).read_text())["key"]
    assert command["split"] == "validation" and manifest["sizes"]["val_queries"] > 0
    assert (out / "report" / "results.json").is_file()  # the test-split report is kept


def test_second_run_reuses_every_step_and_an_interrupted_one_is_redone(smoke_run):
    out, _ = smoke_run
    stdout = _run_demo(out, REPO, *SMOKE_FLAGS)
    for name in STEPS:
        assert f"[{name}] reusing" in stdout, name
    assert "$ " not in stdout  # no command was run
    # an interrupted training: the folder exists but its completion marker was never written
    (out / "seed43" / "stage_II_baseline" / MARKER).unlink()
    anchor_eval = read_marker(out / "seed43" / "eval" / "anchor")["run_id"]
    stdout = _run_demo(out, REPO, *SMOKE_FLAGS)
    assert "[seed43/stage_II_baseline] redoing" in stdout and "no completion marker" in stdout
    assert "[seed43/eval_baseline] redoing" in stdout and "[report] redoing" in stdout  # what reads it is redone too
    for name in STEPS:
        if name not in ("seed43/stage_II_baseline", "seed43/eval_baseline", "report"):
            assert f"[{name}] reusing" in stdout, name
    assert read_marker(out / "seed43" / "stage_II_baseline") is not None
    assert read_marker(out / "seed43" / "eval" / "anchor")["run_id"] == anchor_eval
