"""The demo's report: the table of the paper's Table 10 rows, the Stage II loss plot (the paper's Figure 4)
and ``results.json`` with every number behind them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from llm2vec.io import atomic_write

from .settings import ANCHOR_CONFIG, INSTRUCTION, STAGE_I_CONFIG, TASK_NAME, DemoSize, rel

# (key in mteb's scores, column title); values are shown x 100, as in the paper's tables
METRICS = (
    ("ndcg_at_10", "nDCG@10"),
    ("map_at_10", "MAP@10"),
    ("mrr_at_10", "MRR@10"),
    ("recall_at_10", "Recall@10"),
    ("recall_at_100", "Recall@100"),
    ("precision_at_1", "P@1"),
)
ANCHOR_RUN = "Anchor (Stage I, then Stage II)"
BASELINE_RUN = "Baseline (Stage II only)"
RESULTS_MD, RESULTS_JSON, LOSS_PLOT = "results.md", "results.json", "stage_II_loss.png"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per row (``label``, ``scores``), the :data:`METRICS` x 100 with two decimals."""
    header = "| Model (paper Table 10 row) | " + " | ".join(title for _, title in METRICS) + " |"
    lines = [header, "|---|" + "---:|" * len(METRICS)]
    for row in rows:
        cells = [f"{100 * row['scores'][key]:.2f}" if key in row["scores"] else "n/a" for key, _ in METRICS]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_history(folder: Path) -> list[tuple[int, float]]:
    """``(step, training loss)`` of each logged step of a run, from the trainer's ``trainer_state.json``."""
    state = json.loads((Path(folder) / "trainer_state.json").read_text())
    return [(int(h["step"]), float(h["loss"])) for h in state["log_history"] if "loss" in h and "step" in h]


def loss_plot_title(size_name: str) -> str:
    return f"Stage II training loss, Anchor vs Baseline (paper Fig. 4; demo: {size_name} size)"


def plot_losses(histories: dict[str, list[tuple[int, float]]], path: Path, title: str) -> dict[str, dict[str, Any]]:
    """Training loss per step of each run (thin line) and its moving average (thick), as a PNG.

    Returns what was drawn, read back from the figure's lines: for each run its ``steps``, ``loss``, the
    moving ``mean`` and its ``window``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    colors = {"Anchor": "tab:red", "Baseline": "tab:blue"}
    drawn: dict[str, dict[str, Any]] = {}
    for label, points in histories.items():
        steps = [s for s, _ in points]
        losses = [v for _, v in points]
        color = next((c for name, c in colors.items() if label.startswith(name)), None)
        (raw,) = ax.plot(
            steps,
            losses,
            color=color,
            alpha=0.35,
            linewidth=1,
            marker="o" if len(points) <= 30 else None,
            markersize=2.5,
        )
        window = max(1, len(points) // 8)
        (mean,) = ax.plot(
            steps,
            moving_average(losses, window),
            color=color,
            linewidth=2.2,
            label=f"{label}" + (f" (mean of {window} steps)" if window > 1 else ""),
        )
        drawn[label] = {
            "steps": [int(x) for x in raw.get_xdata()],
            "loss": [float(y) for y in raw.get_ydata()],
            "mean": [float(y) for y in mean.get_ydata()],
            "window": window,
        }
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
    return drawn


def describe_run(size: DemoSize, manifest: dict[str, Any], model_dir: Path, max_length: int) -> str:
    """The settings of the run, as a Markdown list under the table."""
    one, two = json.loads(STAGE_I_CONFIG.read_text()), json.loads(ANCHOR_CONFIG.read_text())
    batch, length = size.batch_size, size.max_seq_length
    model = "tiny random SmolLM2-family model (smoke size)" if size.tiny_model else "SmolLM2-135M-Instruct"
    lines = [
        "Run:",
        f"- model: {model} ({rel(model_dir)})",
        f"- train data: {manifest['sizes']['train']} standard-library docstring triples "
        f"({manifest['sizes']['train_modules']} modules, none of the eval modules)",
        f"- Stage I: {size.stage_I_steps or one['max_steps']} steps x {batch or one['per_device_train_batch_size']} "
        f"pairs, lr {one['learning_rate']}, alpha {one['alpha']}, max length {length or one['max_seq_length']}",
        f"- Stage II (Anchor and Baseline alike): {size.stage_II_steps or two['max_steps']} steps x "
        f"{batch or two['per_device_train_batch_size']} triples, LoRA r {two['lora_r']}, lr {two['learning_rate']}, "
        f"loss scale {two['loss_scale']}, seed {two['seed']}",
        f"- evaluation: max length {max_length}, instruction {INSTRUCTION!r} on queries only",
    ]
    return "\n".join(lines)


def write_report(
    folder: Path,
    size: DemoSize,
    manifest: dict[str, Any],
    rows: list[dict[str, Any]],
    anchor_dir: Path,
    baseline_dir: Path,
    run_text: str,
) -> dict[str, Any]:
    """Write :data:`RESULTS_MD` (the table and a verdict), :data:`LOSS_PLOT` and :data:`RESULTS_JSON` into
    ``folder``. ``rows`` are the table's rows (``row``, ``label``, ``scores``, ``run_id``), one of them
    ``anchor`` and one ``baseline``; returns their nDCG@10."""
    histories = {ANCHOR_RUN: loss_history(anchor_dir), BASELINE_RUN: loss_history(baseline_dir)}
    plot_losses(histories, folder / LOSS_PLOT, loss_plot_title(size.name))
    anchor = next(r for r in rows if r["row"] == "anchor")["scores"]["ndcg_at_10"]
    baseline = next(r for r in rows if r["row"] == "baseline")["scores"]["ndcg_at_10"]
    verdict = "beat" if anchor > baseline else "tied with" if anchor == baseline else "did not beat"
    text = (
        f"# Anchor Embedding demo ({size.name} size)\n\n"
        f"Held-out retrieval task {TASK_NAME}: {manifest['sizes']['eval_queries']} queries over "
        f"{manifest['sizes']['eval_corpus']} documents (mteb, scores x 100).\n\n{markdown_table(rows)}\n\n"
        f"At this scale Anchor {verdict} the Baseline on nDCG@10 "
        f"({100 * anchor:.2f} vs {100 * baseline:.2f}).\n\n{run_text}\n"
    )
    with atomic_write(folder / RESULTS_MD) as f:
        f.write(text)
    summary = {
        "size": dataclasses.asdict(size),
        "task": TASK_NAME,
        "instruction": INSTRUCTION,
        "rows": rows,
        "stage_II_loss": histories,
        "anchor_beats_baseline": anchor > baseline,
    }
    with atomic_write(folder / RESULTS_JSON) as f:
        f.write(json.dumps(summary, indent=2) + "\n")
    return {"anchor_ndcg_at_10": anchor, "baseline_ndcg_at_10": baseline}
