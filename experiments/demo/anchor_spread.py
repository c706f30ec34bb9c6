"""The anchor measures of Stage I models on more validation pairs, with their spread: is a gain real?

    python experiments/demo/anchor_spread.py --model cache/models/SmolLM2-135M-Instruct \
        --model cache/long-run/stage_I --data cache/package-data --pairs 256 --out cache/anchor-spread.json

A Stage I evaluation reports one number per measure over 64 pairs (:mod:`llm2vec.anchor_gain`), with no
uncertainty. This measures each model on ``--pairs`` fixed pairs of the corpus's validation split (the long run's
64 first: :func:`demo.pipeline.validation_rows`), batch by batch (``--batch`` pairs, as the run's
evaluation), and reports per measure the mean over batches and its standard error (sample SD / sqrt(batches)):
a gain whose mean lies within two standard errors of 0 is not told apart from none. The per-batch mean weighs
batches equally, where a run's evaluation weighs target tokens; the two differ a little.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo.pipeline import validation_rows  # noqa: E402
from demo.settings import INSTRUCTION  # noqa: E402

MEASURES = ("loss", "anchor_gain", "anchor_gain_first4", "rank_accuracy")


def validation_pairs(data: Path, count: int) -> list[dict]:
    """``count`` validation pairs of the corpus ``data``, the long run's choice (its 64 first)."""
    if len(rows := validation_rows(data / "val", count)) < count:
        raise SystemExit(f"{data / 'val'}: {len(rows)} validation pairs, --pairs asks for {count}")
    return rows


def spread(per_batch: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per measure: the mean over batches and its standard error (sample SD / sqrt(batches))."""
    out = {}
    for key in per_batch[0]:
        values = [b[key] for b in per_batch]
        se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
        out[key] = {"mean": statistics.fmean(values), "se": se}
    return out


def measure(model_path: str, pairs: list[dict], batch: int, max_length: int, alpha: float) -> dict:
    """The anchor measures of the Stage I model at ``model_path``, one :func:`anchor_gain` call per batch."""
    import torch

    from llm2vec.anchor_gain import anchor_gain
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    torch.manual_seed(0)
    model = LLM2Vec_q2d_d2q.load(model_path, max_length=max_length, alpha=alpha)
    collate = TrainCollator.for_encoder(model, reconstruction="text")
    examples = [TrainExample(p["query"], p["positive"], None, p.get("instruction", INSTRUCTION), "val") for p in pairs]
    per_batch = []
    for start in range(0, len(examples) - 1, batch):
        part = examples[start : start + batch]
        if len(part) >= 2:
            per_batch.append(anchor_gain(model, [collate(part)]))
    return {"model": model_path, "batches": len(per_batch), "pairs": len(examples), "spread": spread(per_batch)}


def table(results: list[dict]) -> str:
    head = "| model | pairs | measure | EBQ2D (q2d) | EBD2Q (d2q) |"
    lines = [head, "|---|---:|---|---:|---:|"]
    for r in results:
        s = r["spread"]
        for m in MEASURES:
            sign = "+" if m.startswith("anchor_gain") else ""  # a gain has a sign; a loss or a share has none
            cells = [f"{s[f'{m}_{d}']['mean']:{sign}.4f} ± {s[f'{m}_{d}']['se']:.4f}" for d in ("q2d", "d2q")]
            lines.append(f"| `{r['model']}` | {r['pairs']} | {m} | {cells[0]} | {cells[1]} |")
        lines.append(f"| `{r['model']}` | {r['pairs']} | rank chance | {s['rank_chance']['mean']:.3f} | |")
    return "\n".join(lines) + "\n\nmean over batches ± standard error (sample SD / sqrt(batches))"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="a Stage I model folder (repeatable)")
    parser.add_argument("--data", type=Path, default=REPO / "cache" / "package-data", help="corpus folder")
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="pairs per measured batch (the long run's 8)")
    parser.add_argument("--max_length", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=0.2)
    parser.add_argument("--out", type=Path, help="JSON file of the results (written after each model)")
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error("--batch: at least 2 pairs (a gain needs another pair's anchor)")
    pairs = validation_pairs(args.data, args.pairs)
    results = []
    for model in args.model:
        results.append(measure(model, pairs, args.batch, args.max_length, args.alpha))
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"[anchor-spread] {model}: done", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
