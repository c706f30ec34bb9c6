"""The GPU preset (``experiments/demo/scale.py``) at smoke size on CPU, and the carry of its inputs.

The smoke run goes through every stage of the preset (tiny model, small standard-library corpus): Stage I with the
anchor measures, both Stage II arms, the retrieval evaluation without mteb and the report; its nDCG@10 of the
untrained model is then compared with ``mteb_eval_custom.py`` (mteb's own scoring) on the same folder and model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo import gpu_carry, scale  # noqa: E402
from demo.stdlib_data import build_stdlib_dataset  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    data = root / "data"
    build_stdlib_dataset(data, max_train=32, max_eval_queries=20)
    out = root / "out"
    assert scale.main(["--preset", "smoke", "--data", str(data), "--out", str(out)]) == 0
    return data, out, json.loads((out / "report.json").read_text())


def test_smoke_runs_every_stage_and_reports_them(smoke):
    _, out, report = smoke
    preset = scale.PRESETS["smoke"]
    curve = report["stage_I_curve"]["stage_I"]
    assert [r["step"] for r in curve] == list(range(0, preset.stage_I_steps + 1, preset.eval_every))
    assert [r["pairs_seen"] for r in curve] == [r["step"] * preset.global_batch for r in curve]
    for r in curve:
        for m in scale.MEASURES:
            assert f"{m}_q2d" in r and f"{m}_d2q" in r
    for arm in ("stage_II_anchor", "stage_II_baseline"):
        assert (out / arm / "adapter_config.json").is_file()
    assert set(report["evaluation"]) == set(scale.ROWS)
    e = report["evaluation"]
    assert report["differences"]["anchor_minus_baseline"] == e["anchor"]["ndcg_at_10"] - e["baseline"]["ndcg_at_10"]
    # Stage II trained the adapters: the Baseline row is not the untrained model's
    assert e["baseline"] != e["untrained"]
    assert set(report["seconds"]) == {"inputs", "stage_I", "stage_II", "evaluation", "report"}
    text = (out / "report.md").read_text()
    assert "Anchor - Baseline" in text and "| 0 | 0 |" in text
    # the anchors' geometry at each Stage I evaluation (llm2vec.geometry), its own table
    assert all("geometry_accuracy_at_1_centred" in r for r in curve)
    assert "| step | pairs seen | cos docs | cos queries |" in text and "chance: InfoNCE 2.079 (ln N)" in text


def test_a_preset_in_steps_probes_each_batch_then_trains_stage_I_as_its_rule_chose(tmp_path):
    """``steps-smoke``: each probed batch trains its steps and is timed, the probe's model is gone, Stage I trains at
    the batch and for the steps :func:`choose_batch` gives for the measured times, evaluating as the preset says;
    the report shows the probe and both Stage II arms train as in the pair-sized presets."""
    data, out = tmp_path / "data", tmp_path / "out"
    build_stdlib_dataset(data, max_train=32, max_eval_queries=20)
    assert scale.main(["--preset", "steps-smoke", "--data", str(data), "--out", str(out)]) == 0
    report, probe = json.loads((out / "report.json").read_text()), scale.PRESETS["steps-smoke"].probe
    probes = {int(b): r for b, r in report["probe"].items()}
    assert set(probes) == set(probe.batches) and not (out / "probe").exists()
    assert all(
        r["steps"] == probe.steps == len(r["losses"]) and r["step_seconds"] > 0 and r["finite"] for r in probes.values()
    )
    batch, steps = scale.choose_batch(probes, probe)
    assert (report["preset"]["per_device_batch"], report["preset"]["stage_I_steps"]) == (batch, steps)
    config = json.loads((out / "stage_I" / "run_config.json").read_text())
    assert config["per_device_train_batch_size"] == batch and config["max_steps"] == steps
    assert report["stage_I"]["stage_I"]["steps"] == steps
    every = max(1, steps // probe.evaluations)
    assert [r["step"] for r in report["stage_I_curve"]["stage_I"]] == list(range(0, steps + 1, every))
    assert {a: r["steps"] for a, r in report["stage_II"].items()} == {"anchor": 2, "baseline": 2}
    assert set(report["seconds"]) == {"inputs", "probe", "stage_I", "stage_II", "evaluation", "report"}
    assert f"Chosen: {batch} pairs a step, {steps} steps" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ({32: 0.15, 64: 0.3}, (64, 1200)),  # both reach 1,000: the larger batch
        ({32: 0.15, 64: 0.5}, (32, 2000)),  # only 32 does (2,400 fit, capped at 2,000)
        ({32: 0.5, 64: 1.0}, (32, 720)),  # neither: the most steps
        ({32: 0.5, 64: None}, (32, 720)),  # 64's loss is not finite: never chosen
    ],
)
def test_the_probe_rule_takes_the_largest_batch_that_reaches_the_least_steps(times, expected):
    probe = scale.Probe(batches=(32, 64), steps=30, minutes=6.0, least=1000, most=2000, evaluations=10)
    probes = {b: {"step_seconds": t or 0.1, "finite": t is not None} for b, t in times.items()}
    assert scale.choose_batch(probes, probe) == expected
    with pytest.raises(scale.ScaleError, match="every probed batch .* not finite"):
        scale.choose_batch({b: {**r, "finite": False} for b, r in probes.items()}, probe)


def test_stage_II_losses_are_reported_and_drawn_in_the_figure_4_layout(smoke):
    """Each arm's training loss per step (its trainer_state's) in report.json, its first and last steps' means in
    report.md beside the plot."""
    _, out, report = smoke
    for arm in ("anchor", "baseline"):
        state = json.loads((out / f"stage_II_{arm}" / "trainer_state.json").read_text())
        expected = [[h["step"], h["loss"]] for h in state["log_history"] if "loss" in h]
        assert report["stage_II_loss"][arm] == expected and len(expected) == scale.PRESETS["smoke"].stage_II_steps
    assert scale.loss_panels(report) == {
        "Stage II": {k.capitalize(): [tuple(p) for p in report["stage_II_loss"][k]] for k in ("anchor", "baseline")}
    }
    text = (out / "report.md").read_text()
    assert (out / scale.LOSS_PLOT).stat().st_size > 0 and f"![Stage II training loss]({scale.LOSS_PLOT})" in text
    mean = sum(v for _, v in report["stage_II_loss"]["anchor"]) / 2
    assert f"- anchor: 2 of 2 steps; loss {mean:.2f} over the first 2 steps, {mean:.2f} over the last 2" in text


def test_a_finished_reports_plot_is_drawn_from_its_arms_logs(tmp_path, capsys, monkeypatch):
    """--plot DIR: the arms' losses from the Trainer's lines of their logs (progress bars and evaluations around
    them), one panel per seed; a log that does not hold one loss per step is refused in one line."""
    arms = {"anchor_seed42": ("anchor", 42), "baseline_seed42": ("baseline", 42), "anchor_seed43": ("anchor", 43)}
    losses = {arm: [(s, 5.0 - s + 0.25 * k) for s in (1, 2, 3)] for k, arm in enumerate(arms)}
    for arm, points in losses.items():
        lines = [f" 33%|###  | {s}/3 [00:01<00:02] {{'loss': '{v:.4g}', 'grad_norm': '1.5', 'epoch': '0.1'}}"
                 for s, v in points] + ["{'eval_loss': '2.0', 'eval_ndcg_at_10': '0.1'}"]  # fmt: skip
        (tmp_path / "logs").mkdir(exist_ok=True)
        (tmp_path / "logs" / f"{arm}.log").write_text("\n".join(lines))
    stage_II = {
        arm: {"kind": kind, "seed": seed, "stage_I": "stage_I", "steps": 3} for arm, (kind, seed) in arms.items()
    }
    (tmp_path / "report.json").write_text(
        json.dumps({"preset": {"name": "cpu", "stage_II_batch": 8}, "stage_II": stage_II})
    )
    drawn = {}
    draw = scale.plot_loss_panels
    monkeypatch.setattr(
        scale, "plot_loss_panels", lambda panels, *a, **k: drawn.update(panels) or draw(panels, *a, **k)
    )
    assert scale.main(["--plot", str(tmp_path)]) == 0
    assert (tmp_path / scale.LOSS_PLOT).stat().st_size > 0
    assert drawn == {
        "Stage II seed 42": {"Anchor": losses["anchor_seed42"], "Baseline": losses["baseline_seed42"]},
        "Stage II seed 43": {"Anchor": losses["anchor_seed43"]},
    }
    stage_II["anchor_seed43"]["steps"] = 4
    (tmp_path / "report.json").write_text(
        json.dumps({"preset": {"name": "cpu", "stage_II_batch": 8}, "stage_II": stage_II})
    )
    capsys.readouterr()
    assert scale.main(["--plot", str(tmp_path)]) == 2
    assert "anchor_seed43.log: 3 logged losses for 4 steps; give the log of a run with logging_steps 1" in (
        capsys.readouterr().err
    )


def test_a_time_budget_cuts_stage_I_short_and_the_report_is_still_complete(smoke, tmp_path):
    """A budget that leaves Stage I no time (the smoke preset keeps 1.5 minutes for the later stages): Stage I
    stops after its first step, evaluates there, and every later stage still runs; the report says where and why."""
    data = smoke[0]
    preset = dataclasses.replace(scale.PRESETS["smoke"], stage_I_steps=40, eval_every=10)
    report = scale.run(preset, tmp_path / "out", data, tmp_path / "unused", tmp_path / "unused", minutes=0.01)
    assert report["status"] == "complete" and report["budget"]["minutes"] == 0.01
    s1 = report["stage_I"]["stage_I"]
    assert (s1["steps"], s1["planned_steps"]) == (1, 40) and s1["stopped_by"]["stopped_by"] == "stop_after_minutes"
    assert [r["step"] for r in report["stage_I_curve"]["stage_I"]] == [0, 1]  # evaluated on start and at the stop
    assert set(report["evaluation"]) == set(scale.ROWS) and report["differences"]
    for arm in ("anchor", "baseline"):
        assert report["stage_II"][arm]["steps"] <= preset.stage_II_steps
    text = (tmp_path / "out" / "report.md").read_text()
    assert "Status: complete." in text and "1 of 40 steps, stopped by its time budget after" in text
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report


def test_a_budget_that_cuts_the_first_stage_II_arm_stops_every_later_arm_at_the_same_step(smoke, tmp_path, monkeypatch):
    """Anchor - Baseline compares equal training: when its time budget stops the first arm (Anchor) early, every
    later arm stops at that step too (``stop_after_n_steps``, on the same learning-rate schedule), whatever time it
    has; the report says so and does not call the arms unequal."""
    data = smoke[0]
    # the Anchor arm (one arm after it) gets a spent share; Stage I and the Baseline arm no limit
    monkeypatch.setattr(scale.Budget, "share", lambda self, arms_after: 1e-3 if arms_after == 1 else None)
    report = scale.run(scale.PRESETS["smoke"], tmp_path / "out", data, tmp_path / "unused", tmp_path / "unused")
    anchor, baseline = report["stage_II"]["anchor"], report["stage_II"]["baseline"]
    assert scale.PRESETS["smoke"].stage_II_steps > 1
    assert anchor["steps"] == 1 and anchor["stopped_by"]["stopped_by"] == "stop_after_minutes"
    assert (baseline["steps"], baseline["stop_after_n_steps"], baseline["stopped_by"]) == (1, 1, None)
    text = (tmp_path / "out" / "report.md").read_text()
    assert "- baseline: 1 of 2 steps, stopped where the first arm's time budget stopped it" in text
    assert "unequal training" not in text


def test_a_run_killed_in_stage_II_leaves_a_report_of_what_finished(smoke, tmp_path, monkeypatch):
    """What is on disk at the moment the Baseline arm starts (where a kill would find it): Stage I's curve and the
    Anchor arm, the evaluation said not reached. While Stage I runs, its evaluations reach the report as they
    are logged."""
    data, out = smoke[0], tmp_path / "out"
    real_run_script, real_write = scale.run_script, scale.write_report
    seen, during_stage_I = {}, []

    def write_report(folder, result):
        real_write(folder, result)
        if result["status"] == "running: stage_I":
            during_stage_I.append(len(result["stage_I_curve"]["stage_I"]))

    def run_script(script, config, flags, log, poll=None):
        if log.name == "baseline.log":  # killed here: keep what is on disk
            seen["json"] = json.loads((out / "report.json").read_text())
            seen["md"] = (out / "report.md").read_text()
            raise KeyboardInterrupt
        real_run_script(script, config, flags, log, poll)

    monkeypatch.setattr(scale, "run_script", run_script)
    monkeypatch.setattr(scale, "write_report", write_report)
    monkeypatch.setattr(scale, "POLL_SECONDS", 0.05)
    with pytest.raises(KeyboardInterrupt):
        scale.run(scale.PRESETS["smoke"], out, data, tmp_path / "unused", tmp_path / "unused")
    assert max(during_stage_I) >= 1  # a curve row in the report before Stage I ended
    report, text = seen["json"], seen["md"]
    assert report["status"] == "running: stage_II_baseline"
    assert [r["step"] for r in report["stage_I_curve"]["stage_I"]] == [0, 1, 2]
    assert report["stage_I"]["stage_I"]["steps"] == 2
    assert list(report["stage_II"]) == ["anchor"] and "evaluation" not in report
    assert "## Retrieval on the test split (no mteb)\n\n" + scale.NOT_YET in text
    final = json.loads((out / "report.json").read_text())  # the error is then named in the status
    assert final["status"].startswith("failed at stage_II_baseline: KeyboardInterrupt")


def test_a_finished_stage_I_run_is_taken_to_stage_II_and_the_test_split(smoke, tmp_path, capsys):
    """--stage_I: the run's model and curve, nothing trained again; its Stage I only row equals the first run's
    (the same model scored twice). --seeds 2: each arm trained with the configs' seed and the next, each scored,
    Anchor - Baseline per seed, their mean and SD. A folder that is not a finished Stage I run is refused by name."""
    data, out, first = smoke
    again = tmp_path / "again"
    argv = [
        "--preset",
        "smoke",
        "--data",
        str(data),
        "--out",
        str(again),
        "--seeds",
        "2",
        "--stage_I",
        str(out / "stage_I"),
    ]
    assert scale.main(argv) == 0
    report = json.loads((again / "report.json").read_text())
    assert not (again / "stage_I").exists() and not (again / "logs" / "stage_I.log").exists()
    given = {"from": str(out / "stage_I"), "planned_steps": 2, "steps": 2, "global_batch": 4}
    assert report["stage_I"] == {"stage_I": given}
    assert report["stage_I_curve"] == first["stage_I_curve"]
    assert report["evaluation"]["stage_I"] == first["evaluation"]["stage_I"]
    assert report["evaluation"]["untrained"] == first["evaluation"]["untrained"]
    e, d = report["evaluation"], report["differences"]
    arms = ["anchor_seed42", "baseline_seed42", "anchor_seed43", "baseline_seed43"]
    assert list(report["stage_II"]) == arms and set(e) == {"untrained", "stage_I", *arms}
    for arm in arms:
        seed = arm[-2:]
        assert (again / f"stage_II_{arm}" / "adapter_config.json").is_file()
        assert f"seed {seed}" in (again / "logs" / f"{arm}.log").read_text()
    gaps = {s: e[f"anchor_{s}"]["ndcg_at_10"] - e[f"baseline_{s}"]["ndcg_at_10"] for s in ("seed42", "seed43")}
    assert d["anchor_minus_baseline_by_pair"] == gaps
    assert d["anchor_minus_baseline"] == pytest.approx(sum(gaps.values()) / 2, rel=1e-12)
    assert d["anchor_minus_baseline_sd"] == pytest.approx(abs(gaps["seed42"] - gaps["seed43"]) / math.sqrt(2))
    assert {k: list(v) for k, v in scale.loss_panels(report).items()} == {
        "Stage II seed 42": ["Anchor", "Baseline"],
        "Stage II seed 43": ["Anchor", "Baseline"],
    }
    text = (again / "report.md").read_text()
    assert f"(the run in `{out / 'stage_I'}`, not trained by this command)" in text
    assert (
        "mean of 2 pairs of an Anchor arm and the Baseline of its seed" in text
        and "| Stage I + II (Anchor), seed 43 |" in text
    )
    capsys.readouterr()
    argv[-1] = str(out / "stage_II_anchor")
    assert scale.main(argv) == 2
    assert "--stage_I" in capsys.readouterr().err
    other = tmp_path / "other"
    build_stdlib_dataset(other, max_train=16, max_eval_queries=20)  # another train split: refused before Stage II
    argv[-1], argv[argv.index("--data") + 1] = str(out / "stage_I"), str(other)
    assert scale.main(argv) == 2
    assert "not trained on the train split of --data" in capsys.readouterr().err
    assert not any(again.glob("stage_II_*"))


def test_several_finished_stage_I_runs_each_get_an_anchor_arm_and_share_the_baseline(smoke, tmp_path):
    """--stage_I twice: an Anchor arm from each run, one Baseline arm per seed (it does not depend on Stage I), a
    Stage I only row per run, and Anchor - Baseline per pair of an Anchor arm and its seed's Baseline. The same run
    given under two names trains the same Anchor arm twice: equal rows, both gaps equal, SD 0."""
    import shutil

    data, out, first = smoke
    second = tmp_path / "second" / "stage_I"
    shutil.copytree(out / "stage_I", second)
    again = tmp_path / "again"
    argv = ["--preset", "smoke", "--data", str(data), "--out", str(again), "--stage_I", str(out / "stage_I")]
    assert scale.main([*argv, "--stage_I", str(second)]) == 0
    report = json.loads((again / "report.json").read_text())
    assert list(report["stage_I"]) == ["stage_I_out", "stage_I_second"]
    assert list(report["stage_II"]) == ["anchor_out", "anchor_second", "baseline"]
    assert sorted(p.name for p in again.glob("stage_II_*")) == ["stage_II_anchor_out", "stage_II_anchor_second",
                                                               "stage_II_baseline"]  # fmt: skip
    e, d = report["evaluation"], report["differences"]
    assert e["stage_I_out"] == e["stage_I_second"] == first["evaluation"]["stage_I"]
    assert e["anchor_out"] == e["anchor_second"] and e["baseline"] == first["evaluation"]["baseline"]
    gap = e["anchor_out"]["ndcg_at_10"] - e["baseline"]["ndcg_at_10"]
    assert d["anchor_minus_baseline_by_pair"] == {"out": gap, "second": gap} and d["anchor_minus_baseline_sd"] == 0
    assert d["stage_I_minus_untrained"] == {
        run: e[run]["ndcg_at_10"] - e["untrained"]["ndcg_at_10"] for run in ("stage_I_out", "stage_I_second")
    }
    assert {k: list(v) for k, v in scale.loss_panels(report).items()} == {
        "Stage II": ["Anchor (out)", "Anchor (second)", "Baseline"]
    }
    text = (again / "report.md").read_text()
    assert "| Stage I + II (Anchor), second |" in text and "| Stage I only (out) |" in text
    assert text.index("| Stage II only (Baseline) |") < text.index("| Stage I + II (Anchor), out |")


def test_a_resumed_runs_repeated_evaluation_is_one_row(tmp_path):
    history = [{"step": s, "eval_anchor_gain_d2q": g, "eval_loss_q2d": 1.0} for s, g in ((0, 0.1), (40, 0.2))]
    history.append({"step": 40, "eval_anchor_gain_d2q": 0.2, "eval_loss_q2d": 1.0})  # evaluated again on resume
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert [r["pairs_seen"] for r in scale.stage_I_curve(scale.read_state(tmp_path), 8)] == [0, 320]


def test_evaluation_without_mteb_equals_mteb_eval_custom(smoke, tmp_path):
    data, out, report = smoke
    pytest.importorskip("mteb")
    import mteb_eval_custom
    from demo.settings import INSTRUCTION, TASK_NAME

    argv = ["--base_model_name_or_path", str(out / "model"), "--local_retrieval_dir", str(data / "eval")]
    argv += ["--local_task_name", TASK_NAME, "--local_instruction", INSTRUCTION, "--output_dir", str(tmp_path)]
    argv += ["--max_length", str(scale.PRESETS["smoke"].max_seq_length), "--device", "cpu"]
    assert mteb_eval_custom.main(argv) == 0
    found = json.loads(next(tmp_path.rglob(f"{TASK_NAME}.json")).read_text())["scores"]["test"][0]
    ours = report["evaluation"]["untrained"]
    assert ours["ndcg_at_10"] == pytest.approx(found["ndcg_at_10"], abs=1e-4)
    assert ours["mrr_at_10"] == pytest.approx(found["mrr_at_10"], abs=1e-4)


def test_carry_parts_reassemble_to_the_file_and_a_damaged_part_is_refused(tmp_path):
    data = tmp_path / "data"
    (data / "eval").mkdir(parents=True)
    (data / "manifest.json").write_text("{}")
    (data / "eval" / "qrels.jsonl").write_text('{"query-id": "q", "corpus-id": "d", "score": 1}\n')
    gguf = tmp_path / "model.gguf"
    payload = bytes(range(256)) * (gpu_carry.PART1_BYTES // 256 + 1000)  # over one part: both parts hold bytes
    gguf.write_bytes(payload)
    wheel = tmp_path / "gguf-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("gguf/__init__.py", "MARK = 1\n")
    gpu_carry.prepare(tmp_path / "carry", data, gguf, wheel)
    assert (tmp_path / "carry" / "part2" / "gguf.part2").stat().st_size == len(payload) - gpu_carry.PART1_BYTES
    joined = gpu_carry.reassemble(tmp_path / "carry", tmp_path / "there" / "joined.gguf")
    assert joined.read_bytes() == payload
    corpus = gpu_carry.unpack_corpus(tmp_path / "carry", tmp_path / "there")
    assert (corpus / "eval" / "qrels.jsonl").read_text() == (data / "eval" / "qrels.jsonl").read_text()
    part2 = tmp_path / "carry" / "part2" / "gguf.part2"
    part2.write_bytes(b"x" + part2.read_bytes()[1:])
    with pytest.raises(gpu_carry.CarryError, match="SHA-256 differs"):
        gpu_carry.reassemble(tmp_path / "carry", tmp_path / "there" / "again.gguf")


def test_a_first_seed_names_every_arm_by_its_seed_and_reaches_the_run(monkeypatch, tmp_path):
    """--seed S: Stage II seeds S, S+1, ... and every arm named ``_seed<s>``, one seed included, so that a
    second report adds seeds to a first without a name in common; without it one seed is the configs', unnamed."""
    assert scale.stage_II_seeds(1) == [("", None)]
    assert scale.stage_II_seeds(2) == [("_seed42", 42), ("_seed43", 43)]
    assert scale.stage_II_seeds(1, 44) == [("_seed44", 44)]
    assert scale.stage_II_seeds(2, 7) == [("_seed7", 7), ("_seed8", 8)]
    runs = {"stage_I_long-run": tmp_path / "a", "stage_I_long-run-seed43": tmp_path / "b"}
    arms = scale.stage_II_arms(tmp_path, runs, scale.stage_II_seeds(1, 44))
    assert [(a["name"], a["seed"]) for a in arms] == [
        ("anchor_long-run_seed44", 44),
        ("anchor_long-run-seed43_seed44", 44),
        ("baseline_seed44", 44),
    ]
    given = {}
    monkeypatch.setattr(scale, "run", lambda *args: given.update(args=args))
    assert scale.main(["--preset", "cpu", "--stage_I", "x", "--data", "d", "--seed", "44"]) == 0
    assert given["args"][-2:] == (1, 44)
