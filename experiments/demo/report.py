"""The demo's report: Table 10 (mean ± sample std over seeds), the Stage II loss plot (paper Figure 4) and
``results.json``; its tables are rendered by :func:`demo.stages.markdown_table`, as :mod:`demo.scale`'s are."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from llm2vec.io import atomic_write, read_json_file

from .settings import ANCHOR_CONFIG, INSTRUCTION, STAGE_I_CONFIG, TASK_NAME, DemoSize, rel
from .stages import markdown_table, read_state

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
SIZE_KEYS = {"test": "eval_queries", "validation": "val_queries"}  # the manifest's query count of each split
GAIN_KEYS = ("eval_loss_q2d", "eval_loss_d2q", "eval_anchor_gain_q2d", "eval_anchor_gain_d2q")
END_STEPS = 5  # the steps the "end of a run" loss averages
STABLE_SHARE = 0.7  # a run has left the plateau when its loss is below this share of chance
TRAINED_SHARE = 0.5  # a run has trained when the mean of its last END_STEPS losses is below this share
FIRST_BELOW_KEY = f"first_step_below_{STABLE_SHARE}_chance"  # results.json: each run's first step under STABLE_SHARE


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def history(folder: Path, key: str) -> list[tuple[int, float]]:
    """(step, ``key``) of every entry of a finished run's ``log_history`` that logged ``key`` (``"loss"``, ...)."""
    return [
        (int(h["step"]), float(h[key])) for h in read_state(Path(folder))["log_history"] if key in h and "step" in h
    ]


def stage_I_evaluations(folder: Path) -> list[dict[str, float]]:
    """Stage I's evaluations on the validation pairs: step, validation loss and anchor gain per direction."""
    state = read_state(Path(folder))
    return [{"step": int(h["step"]), **{k.removeprefix("eval_"): float(h[k]) for k in GAIN_KEYS}}
            for h in state["log_history"] if all(k in h for k in GAIN_KEYS)]  # fmt: skip


def anchor_gain_table(evaluations: dict[str, list[dict[str, float]]]) -> str:
    """Per seed the anchor gain and validation loss at Stage I's first and last evaluation, then the mean ± sample
    std of the last ones."""
    rows = [
        [seed, e["step"], f"{e['anchor_gain_q2d']:+.3f}", f"{e['anchor_gain_d2q']:+.3f}", f"{e['loss_q2d']:.3f}",
         f"{e['loss_d2q']:.3f}"]
        for seed, evals in evaluations.items() for e in ((evals[0], evals[-1]) if len(evals) > 1 else evals)
    ]  # fmt: skip
    lines = markdown_table(["seed", "step", "gain EBQ2D", "gain EBD2Q", "loss EBQ2D", "loss EBD2Q"], rows)
    last = [evals[-1] for evals in evaluations.values() if evals]
    for direction, title in (("q2d", "EBQ2D"), ("d2q", "EBD2Q")):
        gains = [e[f"anchor_gain_{direction}"] for e in last]
        mean, std = mean_std(gains)
        lines.append(
            f"\nAnchor gain at the end of Stage I, {title}: {mean:+.3f}{'' if std is None else f' ± {std:.3f}'} nats "
            f"per token; positive in {sum(g > 0 for g in gains)} of {len(last)} seed(s)."
        )
    return "\n".join(lines)


def loss_plot_title(size_name: str) -> str:
    return f"Stage II training loss, Anchor vs Baseline (paper Fig. 4; demo: {size_name} size)"


COLORS = {"Anchor": ("tab:red", "tab:orange", "tab:brown"), "Baseline": ("tab:blue", "tab:cyan", "tab:purple")}


def _color(label: str, taken: list[str] | None = None) -> str | None:
    """The colour of a run by its label's start (Anchor red, Baseline blue); with ``taken``, the first of its kind's
    colours not yet used there (several Anchor arms in one panel)."""
    kind = next((k for k in COLORS if label.startswith(k)), None)
    if kind is None:
        return None
    free = [c for c in COLORS[kind] if c not in (taken or [])]
    return (free or COLORS[kind])[0]


def _draw_losses(ax, histories: dict[str, list[tuple[int, float]]], colors: dict[str, Any]) -> dict[str, dict]:
    """Each run's loss per step (thin) and its moving average (thick) on ``ax``; what was drawn, per run."""
    drawn: dict[str, dict[str, Any]] = {}
    for label, points in histories.items():
        steps, losses, color = [s for s, _ in points], [v for _, v in points], colors[label]
        marker = "o" if len(points) <= 30 else None
        (raw,) = ax.plot(steps, losses, color=color, alpha=0.35, linewidth=1, marker=marker, markersize=2.5)
        window = max(1, len(points) // 8)
        mean_label = label + (f" (mean of {window} steps)" if window > 1 else "")
        (mean,) = ax.plot(steps, moving_average(losses, window), color=color, linewidth=2.2, label=mean_label)
        drawn[label] = {
            "steps": [int(x) for x in raw.get_xdata()],
            "loss": [float(y) for y in raw.get_ydata()],
            "mean": [float(y) for y in mean.get_ydata()],
            "window": window,
        }
    return drawn


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    with atomic_write(path, mode="wb", encoding=None) as f:
        fig.savefig(f, format="png")


def plot_losses(
    histories: dict[str, list[tuple[int, float]]],
    path: Path,
    title: str,
    scores: dict[str, list[tuple[int, float]]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each run's training loss per step (thin) and its moving average (thick) as a PNG; with ``scores``, each
    run's validation nDCG@10 (dashed, right axis). Returns what was drawn, read back from the figure's lines: per
    run ``steps``, ``loss``, ``mean``, ``window`` and, with scores, ``score_steps`` and ``score``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    drawn = _draw_losses(ax, histories, {label: _color(label) for label in histories})
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("Stage II step")
    ax.set_ylabel("InfoNCE training loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    if scores:
        right = ax.twinx()
        for label, points in scores.items():
            (line,) = right.plot(
                [s for s, _ in points], [100 * v for _, v in points], color=_color(label), linestyle="--",
                marker="s", markersize=3, linewidth=1.2,
            )  # fmt: skip
            drawn.setdefault(label, {}).update(
                score_steps=[int(x) for x in line.get_xdata()], score=[float(y) / 100 for y in line.get_ydata()]
            )
        right.set_ylabel("validation nDCG@10 (dashed)")
    _save(fig, path)
    plt.close(fig)
    return drawn


def plot_loss_panels(
    panels: dict[str, dict[str, list[tuple[int, float]]]], path: Path, title: str, chance: float | None = None
) -> dict[str, dict[str, dict[str, Any]]]:
    """The paper's Figure 4 per panel, side by side on one loss axis: each panel's runs (``{panel title: {run
    label: [(step, loss)]}}``, Anchor runs red-orange, Baseline blue) as :func:`plot_losses` draws them, with
    ``chance`` as a dotted line. Returns what was drawn, per panel and run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(1 + 4.2 * n, 4.2), dpi=120, sharey=True, squeeze=False)
    drawn = {}
    for ax, (name, histories) in zip(axes[0], panels.items()):
        colors: dict[str, Any] = {}
        for label in histories:
            colors[label] = _color(label, list(colors.values()))
        drawn[name] = _draw_losses(ax, histories, colors)
        if chance is not None:
            ax.axhline(chance, color="gray", linestyle=":", linewidth=1, label=f"chance, ln {math.exp(chance):.0f}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("Stage II step")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
    axes[0][0].set_ylabel("InfoNCE training loss")
    fig.suptitle(title, fontsize=10)
    _save(fig, path)
    plt.close(fig)
    return drawn


def describe_run(
    size: DemoSize,
    manifest: dict[str, Any],
    model_dir: Path,
    max_length: int,
    seeds: tuple[int, ...],
    split: str,
    threads: int | None,
) -> str:
    """The settings of the run, as a Markdown list under the tables."""
    one, two = read_json_file(STAGE_I_CONFIG), read_json_file(ANCHOR_CONFIG)
    batch, length = size.batch_size, size.max_seq_length
    model = "tiny random SmolLM2-family model (smoke size)" if size.tiny_model else "SmolLM2-135M-Instruct"
    s1, s2 = size.stage_I_steps or one["max_steps"], size.stage_II_steps or two["max_steps"]
    w1, w2 = (size.training_overrides(st).get("warmup_steps", c["warmup_steps"]) for st, c in (("I", one), ("II", two)))
    return "\n".join([
        "Run:",
        f"- model: {model} ({rel(model_dir)})",
        f"- train data: {manifest['sizes']['train']} standard-library docstring triples "
        f"({manifest['sizes']['train_modules']} modules, none of the test or validation modules)",
        f"- Stage I: {s1} steps x {batch or one['per_device_train_batch_size']} pairs, lr {one['learning_rate']} "
        f"(warm-up {w1}), alpha {one['alpha']}, max length {length or one['max_seq_length']}",
        f"- Stage II (Anchor and Baseline alike): {s2} steps x {batch or two['per_device_train_batch_size']} "
        f"triples, LoRA r {two['lora_r']}, lr {size.stage_II_learning_rate or two['learning_rate']} "
        f"(warm-up {w2}), loss scale {two['loss_scale']}",
        f"- seeds: {', '.join(map(str, seeds))} (each: its own Stage I and both Stage II runs; the untrained row once)",
        f"- evaluation: {split} split, max length {max_length}, instruction {INSTRUCTION!r} on queries only",
        f"- CPU threads per command: {threads}",
    ])  # fmt: skip


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1 in the denominator; None for a single value)."""
    n = len(values)
    mean = sum(values) / n
    return mean, None if n < 2 else math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def pm(mean: float, std: float | None, scale: float = 100.0) -> str:
    """``mean ± std`` x ``scale`` with two decimals (just the mean for one seed)."""
    return f"{scale * mean:.2f}" + ("" if std is None else f" ± {scale * std:.2f}")


def aggregate(untrained: dict[str, Any], seeds: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The table's rows: ``untrained`` once (``per_seed`` and ``std`` None), then each trained row with its
    :data:`METRICS` per seed, their mean and sample std (``std`` None for one seed)."""

    def metrics(scores: dict[str, float]) -> dict[str, float]:
        return {k: scores[k] for k, _ in METRICS if k in scores}

    rows = [{"row": untrained["row"], "label": untrained["label"], "per_seed": None,
             "mean": metrics(untrained["scores"]), "std": None}]  # fmt: skip
    for first in next(iter(seeds.values())):
        per_seed = {
            str(s): metrics(next(r for r in rs if r["row"] == first["row"])["scores"]) for s, rs in seeds.items()
        }
        stats = {k: mean_std([sc[k] for sc in per_seed.values()]) for k, _ in METRICS}
        rows.append({
            "row": first["row"], "label": first["label"], "per_seed": per_seed,
            "mean": {k: m for k, (m, _) in stats.items()},
            "std": None if len(per_seed) < 2 else {k: sd for k, (_, sd) in stats.items()},
        })  # fmt: skip
    return rows


def markdown_tables(rows: list[dict[str, Any]], difference: dict[str, Any]) -> str:
    """The mean ± spread table over :data:`METRICS`, the per-seed nDCG@10 table and the Anchor - Baseline line."""
    lines = markdown_table(
        ["Model (paper Table 10 row)", *(title for _, title in METRICS)],
        ([r["label"], *(pm(r["mean"][k], (r["std"] or {}).get(k)) if k in r["mean"] else "n/a" for k, _ in METRICS)]
         for r in rows),
    )  # fmt: skip
    seeds, untrained = list(difference["per_seed"]), rows[0]["mean"]["ndcg_at_10"]
    per_seed = [
        [r["label"], *(f"{100 * (r['per_seed'] or {s: r['mean'] for s in seeds})[s]['ndcg_at_10']:.2f}" for s in seeds)]
        for r in rows
    ]
    per_seed.append(["Anchor - Baseline", *(f"{100 * difference['per_seed'][s]:+.2f}" for s in seeds)])
    stage_I = next((r for r in rows if r["row"] == "stage_I" and r["per_seed"]), None)
    if stage_I is not None:
        cells = (f"{100 * (stage_I['per_seed'][s]['ndcg_at_10'] - untrained):+.2f}" for s in seeds)
        per_seed.append(["Stage I only - Untrained", *cells])
    lines += ["", "nDCG@10 per seed:", "", *markdown_table(["Model", *(f"seed {s}" for s in seeds)], per_seed)]
    spread = "" if difference["std"] is None else f" ± {100 * difference['std']:.2f} (sample std)"
    lines += [
        "",
        f"Anchor - Baseline, nDCG@10: {100 * difference['mean']:+.2f}{spread} over {len(seeds)} seed(s); "
        f"positive in {sum(d > 0 for d in difference['per_seed'].values())} of {len(seeds)}.",
    ]
    return "\n".join(lines)


def write_report(
    folder: Path,
    size: DemoSize,
    manifest: dict[str, Any],
    split: str,
    untrained: dict[str, Any],
    seeds: dict[int, dict[str, Any]],
    run_text: str,
    threads: int | None = None,
) -> dict[str, Any]:
    """:data:`RESULTS_MD`, :data:`LOSS_PLOT` and :data:`RESULTS_JSON` into ``folder``. ``untrained`` is the
    untrained row (``row``, ``label``, ``scores``); ``seeds`` maps each seed to its ``rows`` (stage_I, baseline,
    anchor) and its run folders. ``results.json`` holds numbers only (no run ids, times or paths), so two runs that
    computed the same give the same file."""
    rows = aggregate(untrained, {s: v["rows"] for s, v in seeds.items()})
    per_seed = {str(s): {r["row"]: r["scores"]["ndcg_at_10"] for r in v["rows"]} for s, v in seeds.items()}
    diffs = {s: v["anchor"] - v["baseline"] for s, v in per_seed.items()}
    mean, std = mean_std(list(diffs.values()))
    difference = {"metric": "ndcg_at_10", "per_seed": diffs, "mean": mean, "std": std}

    gains = {str(s): stage_I_evaluations(v["stage_I_dir"]) for s, v in seeds.items()}
    runs = ((ANCHOR_RUN, "anchor_dir"), (BASELINE_RUN, "baseline_dir"))
    histories = {str(s): {run: history(v[d], "loss") for run, d in runs} for s, v in seeds.items()}
    validation = {str(s): {run: history(v[d], "eval_ndcg_at_10") for run, d in runs} for s, v in seeds.items()}
    short = lambda run: run.split(" ")[0]  # noqa: E731
    drawn = {f"{short(run)}, seed {s}": points for s, rs in histories.items() for run, points in rs.items()}
    scores = {f"{short(run)}, seed {s}": points for s, rs in validation.items() for run, points in rs.items()}
    plot_losses(drawn, folder / LOSS_PLOT, loss_plot_title(size.name), scores if any(scores.values()) else None)
    batch = size.batch_size or read_json_file(ANCHOR_CONFIG)["per_device_train_batch_size"]
    chance = math.log(2 * batch)  # a uniform softmax over the batch's positives and hard negatives
    final = {s: {run: points[-1][1] for run, points in rs.items()} for s, rs in histories.items()}
    # the end of a run, less noisy than its last batch: the mean loss of its last END_STEPS logged steps
    end = {s: {run: sum(p[1] for p in pts[-END_STEPS:]) / len(pts[-END_STEPS:]) for run, pts in rs.items()}
           for s, rs in histories.items()}  # fmt: skip
    final_lines = [
        f"- seed {s}: "
        + ", ".join(
            f"{short(run)} {loss:.3f} ({loss / chance:.2f} x chance; last {END_STEPS} steps "
            f"{end[s][run]:.3f}, {end[s][run] / chance:.2f} x)"
            for run, loss in f.items()
        )
        for s, f in final.items()
    ]
    n_runs = sum(len(f) for f in final.values())
    below = sum(loss < STABLE_SHARE * chance for f in final.values() for loss in f.values())
    trained = {
        s: sorted(short(run) for run, loss in e.items() if loss < TRAINED_SHARE * chance) for s, e in end.items()
    }
    missing = [f"seed {s} {short(run)}" for s, e in end.items() for run in e if short(run) not in trained[s]]
    # per seed and run: the first logged step whose loss is under STABLE_SHARE x chance, or "never"
    firsts = {
        s: {short(run): next((str(step) for step, loss in pts if loss < STABLE_SHARE * chance), "never")
            for run, pts in rs.items()}
        for s, rs in histories.items()
    }  # fmt: skip
    final_lines += [
        f"\nRuns whose final loss is below {STABLE_SHARE} x chance: {below} of {n_runs}.",
        f"Runs that trained (mean of the last {END_STEPS} losses below {TRAINED_SHARE} x chance): "
        f"{n_runs - len(missing)} of {n_runs}" + (f"; not: {', '.join(missing)}." if missing else "."),
        f"First step whose loss is below {STABLE_SHARE} x chance: "
        + "; ".join(f"seed {s} " + ", ".join(f"{run} {step}" for run, step in f.items()) for s, f in firsts.items())
        + ".",
    ]
    text = (
        f"# Anchor Embedding demo ({size.name} size, {split} split)\n\n"
        f"Retrieval task {TASK_NAME}, {split} split: {manifest['sizes'][SIZE_KEYS[split]]} queries "
        f"(mteb, scores x 100; mean ± sample standard deviation over seeds).\n\n"
        f"{markdown_tables(rows, difference)}\n\n"
        "What Stage I taught the anchor, on the validation pairs (docs/demo.md): the anchor's information gain is "
        "the reconstruction loss with another pair's anchor minus the loss with the pair's own (0: the decoder "
        "ignores the anchor), at the first and the last evaluation of each seed's Stage I:\n\n"
        f"{anchor_gain_table(gains)}\n\n"
        f"Final Stage II training loss (chance: ln {2 * batch} = {chance:.3f}, a uniform softmax over the "
        f"{2 * batch} candidates of a batch):\n\n" + "\n".join(final_lines) + f"\n\n{run_text}\n"
    )
    with atomic_write(folder / RESULTS_MD) as f:
        f.write(text)
    summary = {
        "size": dataclasses.asdict(size), "task": TASK_NAME, "split": split, "threads": threads,
        "instruction": INSTRUCTION, "seeds": [int(s) for s in seeds], "rows": rows,
        "anchor_minus_baseline": difference, "stage_I_validation": gains, "stage_II_loss": histories,
        "stage_II_validation_ndcg_at_10": validation, "stage_II_final_loss": final,
        f"stage_II_mean_loss_of_the_last_{END_STEPS}_steps": end, "stage_II_chance_loss": chance,
        "stage_II_trained": trained, FIRST_BELOW_KEY: firsts,
    }  # fmt: skip
    with atomic_write(folder / RESULTS_JSON) as f:
        f.write(json.dumps(summary, indent=2) + "\n")
    return {"anchor_minus_baseline_ndcg_at_10": mean}
