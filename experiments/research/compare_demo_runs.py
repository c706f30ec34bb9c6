"""Two demo reports side by side, say the default command and the same at one CPU thread:

    python experiments/run_demo.py                                                # 2 threads on a 2-core machine
    python experiments/run_demo.py --threads 1 --out_dir cache/demo-threads1
    python experiments/research/compare_demo_runs.py cache/demo-runs cache/demo-threads1 --labels "2 threads" "1 thread"

Prints a Markdown table: per seed, each row's nDCG@10, Anchor - Baseline, Stage I only - Untrained, the anchor
gain, each Stage II run's end loss and first step below 0.7 x chance, at both, and their difference; then how
many Stage II runs trained at each, and the largest difference over every number the two ``results.json``
share (the thread count left out). ``--out`` also writes the table to a file. A different thread count changes
the order of float sums, so it is a small stand-in for another machine.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from demo.report import END_STEPS, FIRST_BELOW_KEY, RESULTS_JSON, STABLE_SHARE, TRAINED_SHARE  # noqa: E402

from llm2vec.io import read_json_file  # noqa: E402

ROWS = (("untrained", "Untrained"), ("stage_I", "Stage I only"), ("baseline", "Baseline"), ("anchor", "Anchor"))


def read_results(path: str | Path) -> dict[str, Any]:
    """A report's ``results.json``, given the file, its report folder or the demo's output folder."""
    path = Path(path)
    for candidate in (path, path / RESULTS_JSON, path / "report" / RESULTS_JSON):
        if candidate.is_file():
            return read_json_file(candidate)
    raise FileNotFoundError(f"{path}: no {RESULTS_JSON} there, nor in {path / 'report'}; run the demo first")


def seed_figures(results: dict[str, Any]) -> dict[str, dict[str, float | str]]:
    """Per seed: nDCG@10 x 100 of each row, Anchor - Baseline, Stage I only - Untrained, the anchor gain at the end
    of Stage I, each Stage II run's mean loss of its last steps as a share of chance, and its first step below
    0.7 x chance."""
    rows = {r["row"]: r for r in results["rows"]}
    untrained = rows["untrained"]["mean"]["ndcg_at_10"]
    chance = results["stage_II_chance_loss"]
    end = results[f"stage_II_mean_loss_of_the_last_{END_STEPS}_steps"]
    out: dict[str, dict[str, float | str]] = {}
    for seed in map(str, results["seeds"]):
        ndcg = {
            name: untrained if name == "untrained" else rows[name]["per_seed"][seed]["ndcg_at_10"] for name, _ in ROWS
        }
        figures: dict[str, float | str] = {f"nDCG@10 {title}": 100 * ndcg[name] for name, title in ROWS}
        figures["Anchor - Baseline"] = 100 * (ndcg["anchor"] - ndcg["baseline"])
        figures["Stage I only - Untrained"] = 100 * (ndcg["stage_I"] - ndcg["untrained"])
        last = (results.get("stage_I_validation", {}).get(seed) or [None])[-1]
        if last is not None:
            figures["anchor gain EBQ2D (end of Stage I)"] = last["anchor_gain_q2d"]
            figures["anchor gain EBD2Q (end of Stage I)"] = last["anchor_gain_d2q"]
        for run, loss in end[seed].items():
            figures[f"{run.split(' ')[0]}: last {END_STEPS} losses / chance"] = loss / chance
        for run, step in results.get(FIRST_BELOW_KEY, {}).get(seed, {}).items():
            figures[f"{run}: first step below {STABLE_SHARE} x chance"] = step
        out[seed] = figures
    return out


def numbers(value: Any, prefix: str = "") -> dict[str, float]:
    """Every number of a JSON value by its path (``rows/2/mean/ndcg_at_10``); the thread count is left out."""
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() if key != "threads" for k, v in numbers(item, f"{prefix}{key}/").items()
        }
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in numbers(item, f"{prefix}{i}/").items()}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {prefix.rstrip("/"): float(value)}
    return {}


def largest_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str | None, int]:
    """The largest absolute difference over the numbers both files hold at the same path, that path, and how many
    numbers were compared."""
    na, nb = numbers(a), numbers(b)
    shared = sorted(set(na) & set(nb))
    worst, where = 0.0, None
    for key in shared:
        d = abs(na[key] - nb[key])
        if math.isnan(d):  # NaN against a number differs without bound; NaN against NaN is the same
            d = 0.0 if math.isnan(na[key]) and math.isnan(nb[key]) else math.inf
        if d > worst:
            worst, where = d, key
    return worst, where, len(shared)


def cell(value: float | str | None) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.3f}"


def comparison_table(a: dict[str, Any], b: dict[str, Any], label_a: str, label_b: str) -> str:
    """The Markdown comparison of two reports (the module docstring says what it holds)."""
    fa, fb = seed_figures(a), seed_figures(b)
    lines = [f"| seed | figure | {label_a} | {label_b} | difference |", "|---|---|---:|---:|---:|"]
    for seed in [s for s in fa if s in fb]:
        for name in fa[seed]:
            va, vb = fa[seed][name], fb[seed].get(name)
            diff = (
                f"{vb - va:+.3f}"
                if isinstance(va, float) and isinstance(vb, float)
                else ("same" if va == vb else "differs")
            )
            lines.append(f"| {seed} | {name} | {cell(va)} | {cell(vb)} | {diff} |")
    if a["seeds"] == b["seeds"]:
        worst, where, count = largest_difference(a, b)
        scope = f"the {count} numbers both results.json hold"
    else:  # means and spreads over different seeds are not comparable: the per-seed figures only
        shared = [s for s in fa if s in fb]
        worst, where, count = largest_difference({s: fa[s] for s in shared}, {s: fb[s] for s in shared})
        scope = f"the {count} per-seed figures of the seeds both hold (their seed sets differ)"
    counts = []
    for label, r in ((label_a, a), (label_b, b)):
        ends = list(r[f"stage_II_mean_loss_of_the_last_{END_STEPS}_steps"].values())
        trained = sum(loss < TRAINED_SHARE * r["stage_II_chance_loss"] for e in ends for loss in e.values())
        counts.append(f"{trained} of {sum(len(e) for e in ends)} at {label}")
    lines += [
        "",
        f"Stage II runs that trained (mean of the last {END_STEPS} losses below {TRAINED_SHARE} x chance): "
        + ", ".join(counts)
        + ".",
        f"Largest difference over {scope}: {worst:.6g}"
        + (f" ({where})." if where and worst else " (every number equal)."),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="compare_demo_runs.py", description=__doc__.split("\n\n")[0])
    p.add_argument("first", help="a demo output folder, its report folder or its results.json")
    p.add_argument("second", help="the same for the other run")
    p.add_argument("--labels", nargs=2, default=None, help="column titles (default: the thread counts)")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = p.parse_args(argv)
    try:
        a, b = read_results(args.first), read_results(args.second)
    except (FileNotFoundError, ValueError) as e:
        print(f"compare_demo_runs.py: error: {e}", file=sys.stderr)
        return 1
    labels = args.labels or [f"{r.get('threads')} thread(s)" for r in (a, b)]
    text = comparison_table(a, b, *labels)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
