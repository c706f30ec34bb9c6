"""The anchor measures of Stage I models on held-out pairs, with a standard error over modules: is a gain real?

    python experiments/demo/anchor_spread.py --model cache/models/SmolLM2-135M-Instruct \
        --model cache/long-run/stage_I --data cache/package-data --skip 64 --pairs 512 --out cache/anchor-spread.json

A Stage I evaluation reports one number per measure (:mod:`llm2vec.anchor_gain`), with no uncertainty. This
measures each model on ``--pairs`` fixed pairs of the corpus's validation split, after the first ``--skip`` of the
one choice of validation pairs (:func:`demo.stages.validation_rows`; the long run evaluates the first 64, so
``--skip 64`` gives pairs that no run's evaluation saw), in batches of ``--batch`` pairs as a run's evaluation
takes them, and keeps each pair's terms (:func:`llm2vec.anchor_gain.pair_terms`). Each measure is a ratio over
all pairs, as a run's evaluation computes it (the gain: sum of rolled minus own losses over the sum of target
tokens; rank accuracy: the mean credit), with a standard error **clustered by module**.

Why by module: the pairs of one module (the methods of one class, the functions of one file) share vocabulary and
style, so their gains move together, and one module can fill several pairs of a batch; treating pairs or batches
as independent understates the error. The unit of the error is the module (the corpus's splits are drawn by
module, :mod:`demo.package_data`). For a ratio R = sum_g Y_g / sum_g X_g over modules g (Y_g, X_g: the sums over
the module's pairs), the delta-method (linearised) cluster-robust variance is

    Var(R) = C / (C - 1) x sum_g (Y_g - R X_g)^2 / (sum_g X_g)^2        (C modules)

the analytic counterpart of a bootstrap that resamples modules (a test compares the two). A gain whose value lies
within two standard errors of 0 is not told apart from none. What it does not remove: a pair's rolled loss uses
another pair's anchor in its batch, possibly of another module, so modules are not exactly independent either.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo.settings import PACKAGE_DATA_DIR  # noqa: E402
from demo.stages import validation_rows  # noqa: E402

MEASURES = ("loss", "anchor_gain", "anchor_gain_first4", "rank_accuracy")
# measure -> (numerator, denominator) of its ratio over pairs: a term name, a difference of two, or 1 per pair
RATIOS = {
    "loss": (("loss",), "tokens"),
    "anchor_gain": (("rolled", "loss"), "tokens"),
    "anchor_gain_first4": (("first_rolled", "first_loss"), "first_tokens"),
    "rank_accuracy": (("hit",), None),
    "rank_chance": (("chance",), None),
}


def module_of(name: str, modules: Sequence[str]) -> str:
    """The module of the object ``name`` (a dotted name): the longest of ``modules`` that is ``name`` or a prefix
    of it at a dot; ``name`` itself when none is."""
    return max((m for m in modules if name == m or name.startswith(m + ".")), key=len, default=name)


def validation_pairs(data: Path, count: int, skip: int = 0) -> list[dict]:
    """Pairs ``skip`` to ``skip + count`` of the validation pairs of the corpus ``data`` (the long run's 64 are the
    first), each with its ``module`` (from the corpus's ``manifest.json``: ``val_modules``)."""
    rows = validation_rows(data / "val", skip + count, with_ids=True)[skip:]
    if len(rows) < count:
        raise SystemExit(f"{data / 'val'}: {len(rows)} validation pairs after --skip {skip}, --pairs asks for {count}")
    manifest = data / "manifest.json"
    if not manifest.is_file():
        raise SystemExit(f"{manifest}: missing; --data must be a corpus folder built by demo.package_data")
    modules = json.loads(manifest.read_text())["val_modules"]
    return [{**row, "module": module_of(row.pop("id"), modules)} for row in rows]


def clustered(terms: list[dict[str, float]], groups: list[str], numerator: tuple[str, ...], denominator) -> dict:
    """The ratio sum Y / sum X over all pairs (Y: the ``numerator`` term, or the difference of two; X: the
    ``denominator`` term, or 1) and its standard error clustered by ``groups`` (module docstring)."""
    y_g: dict[str, float] = {}
    x_g: dict[str, float] = {}
    for term, g in zip(terms, groups, strict=True):
        y = term[numerator[0]] - (term[numerator[1]] if len(numerator) > 1 else 0.0)
        y_g[g] = y_g.get(g, 0.0) + y
        x_g[g] = x_g.get(g, 0.0) + (term[denominator] if denominator else 1.0)
    total_x = sum(x_g.values())
    value = sum(y_g.values()) / total_x
    c = len(y_g)
    if c < 2:
        return {"value": value, "se": float("nan"), "modules": c}
    residuals = sum((y_g[g] - value * x_g[g]) ** 2 for g in y_g)
    return {"value": value, "se": math.sqrt(c / (c - 1) * residuals) / total_x, "modules": c}


def summarise(terms: dict[str, list[dict[str, float]]], groups: list[str]) -> dict[str, dict]:
    """Every measure of every direction (``anchor_gain_d2q``, ...) as :func:`clustered` gives it."""
    out = {}
    for direction, pairs in terms.items():
        for measure in MEASURES:
            out[f"{measure}_{direction}"] = clustered(pairs, groups, *RATIOS[measure])
    out["rank_chance"] = clustered(next(iter(terms.values())), groups, *RATIOS["rank_chance"])  # one per batch size
    return out


def measure(model_path: str, pairs: list[dict], batch: int, max_length: int, alpha: float) -> dict:
    """The anchor measures of the Stage I model at ``model_path`` on ``pairs``, batch by batch, with their
    standard errors over the pairs' modules."""
    import torch

    from llm2vec.anchor_gain import pair_terms
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    torch.manual_seed(0)
    model = LLM2Vec_q2d_d2q.load(model_path, max_length=max_length, alpha=alpha)
    collate = TrainCollator.for_encoder(model, reconstruction="text")
    examples = [TrainExample(p["query"], p["positive"], None, p["instruction"], "val") for p in pairs]
    starts = [a for a in range(0, len(examples), batch) if len(examples[a : a + batch]) >= 2]
    terms: dict[str, list] = {}
    for a in starts:
        for direction, rows in pair_terms(model, [collate(examples[a : a + batch])]).items():
            terms.setdefault(direction, []).extend(rows)
    measured = sum(min(batch, len(examples) - a) for a in starts)
    groups = [p["module"] for p in pairs[:measured]]
    return {"model": model_path, "pairs": measured, "batches": len(starts), "spread": summarise(terms, groups)}


def table(results: list[dict]) -> str:
    head = "| model | pairs (modules) | measure | EBQ2D (q2d) | EBD2Q (d2q) |"
    lines = [head, "|---|---:|---|---:|---:|"]
    for r in results:
        s = r["spread"]
        size = f"{r['pairs']} ({s['rank_chance']['modules']})"
        for m in MEASURES:
            sign = "+" if m.startswith("anchor_gain") else ""  # a gain has a sign; a loss or a share has none
            cells = [f"{s[f'{m}_{d}']['value']:{sign}.4f} ± {s[f'{m}_{d}']['se']:.4f}" for d in ("q2d", "d2q")]
            lines.append(f"| `{r['model']}` | {size} | {m} | {cells[0]} | {cells[1]} |")
        lines.append(f"| `{r['model']}` | {size} | rank chance | {s['rank_chance']['value']:.3f} | |")
    return "\n".join(lines) + "\n\nvalue over all pairs ± standard error clustered by module"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="a Stage I model folder (repeatable)")
    parser.add_argument("--data", type=Path, default=PACKAGE_DATA_DIR, help="corpus folder")
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--skip", type=int, default=64, help="validation pairs left out first (the long run's 64)")
    parser.add_argument("--batch", type=int, default=8, help="pairs per measured batch (the long run's 8)")
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=0.2)
    parser.add_argument("--out", type=Path, help="JSON file of the results (written after each model)")
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error("--batch: at least 2 pairs (a gain needs another pair's anchor)")
    if args.skip < 0 or args.pairs < 2:
        parser.error("--skip must be >= 0 and --pairs >= 2")
    pairs = validation_pairs(args.data, args.pairs, args.skip)
    results = []
    for model in args.model:
        results.append({**measure(model, pairs, args.batch, args.max_length, args.alpha), "skip": args.skip})
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"[anchor-spread] {model}: done", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
