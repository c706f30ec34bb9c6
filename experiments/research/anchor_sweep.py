"""One Stage I setting of the anchor-gain sweep (docs/demo.md): train SmolLM2 on the demo's train split and
measure the anchor's information gain (llm2vec.anchor_gain) on the demo's validation pairs as it trains.

The loop is the Stage I step of the package (the model's forward, the collator, the reconstruction loss)
with the Trainer's recipe written out: AdamW (weight decay 0), linear warm-up then linear decay to zero
at ``--steps``, gradient clipping at 1.0, float32. Every ``--eval_every`` steps (and at step 0) one JSON
line goes to ``--out``: the step, the training loss parts since the last line, and the gain measurement.

    python experiments/research/anchor_sweep.py --name lr1e-4 --lr 1e-4 --steps 120 --out cache/sweep/runs.jsonl
    python experiments/research/anchor_sweep.py --table cache/sweep/runs.jsonl      # the measurements as a Markdown table

Needs the demo's data and model (``python experiments/run_demo.py`` makes both, or
``experiments/demo/stdlib_data.py`` and ``experiments/demo/smollm2.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from demo import settings  # noqa: E402
from demo.stages import validation_rows  # noqa: E402
from demo.stdlib_data import DEFAULT_OUT_DIR  # noqa: E402

from llm2vec.anchor_gain import anchor_gain  # noqa: E402
from llm2vec.collator import TrainCollator  # noqa: E402
from llm2vec.dataset import TrainExample  # noqa: E402
from llm2vec.io import iter_jsonl  # noqa: E402
from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q  # noqa: E402


def train_examples(data_dir: Path) -> list[TrainExample]:
    rows = [row for _, row in iter_jsonl(data_dir / "train" / "stdlib.jsonl") if row is not None]
    return [TrainExample(r["query"], r["positive"], r.get("negative"), settings.INSTRUCTION, "stdlib") for r in rows]


def validation_examples(data_dir: Path, limit: int) -> list[TrainExample]:
    """``limit`` of the validation split's (query, relevant document) pairs, the demo's fixed choice
    (:func:`demo.stages.validation_rows`: the same pairs for every run, shuffled so that the other pair of a
    batch comes from another module)."""
    rows = validation_rows(data_dir / "val", limit)
    return [TrainExample(r["query"], r["positive"], None, r["instruction"], "stdlib") for r in rows]


def markdown_table(path: Path) -> str:
    """The measurements of a runs file as the Markdown table of docs/demo.md: one row per run and evaluation."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    lines = [
        "| run | step | train loss q2d / d2q | val loss q2d / d2q | gain EBQ2D | gain EBD2Q |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        train = f"{r['train_q2d']:.2f} / {r['train_d2q']:.2f}" if "train_q2d" in r else "-"
        lines.append(
            f"| {r['name']} | {r['step']} | {train} | {r['loss_q2d']:.3f} / {r['loss_d2q']:.3f} | "
            f"{r['anchor_gain_q2d']:+.3f} | {r['anchor_gain_d2q']:+.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(markdown_table(Path(sys.argv[2])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True, help="JSON-lines file the measurements are appended to")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup_share", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max_len", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=0.2)
    parser.add_argument("--input_dropout", type=float, default=0.0)
    parser.add_argument("--prefix", default="", help="reconstruction_prefix (text read before the anchor)")
    parser.add_argument("--stop_decoder_gradient", action="store_true")
    parser.add_argument("--train_pairs", type=int, default=0, help="keep this many train pairs (0: all)")
    parser.add_argument("--val_pairs", type=int, default=64)
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data_dir", default=str(settings.REPO_ROOT / DEFAULT_OUT_DIR))
    parser.add_argument("--model", default=str(settings.SMOLLM2_DIR))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = LLM2Vec_q2d_d2q.load(
        args.model,
        max_length=args.max_len,
        alpha=args.alpha,
        reconstruction_input_dropout=args.input_dropout,
        reconstruction_prefix=args.prefix,
        stop_decoder_gradient=args.stop_decoder_gradient,
    )
    collator = TrainCollator.for_encoder(model, reconstruction="text")
    data_dir = Path(args.data_dir)
    train = train_examples(data_dir)
    random.Random(args.seed).shuffle(train)
    if args.train_pairs:
        train = train[: args.train_pairs]
    val = validation_examples(data_dir, args.val_pairs)
    val_batches = [collator(val[i : i + 16]) for i in range(0, len(val), 16)]

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = max(1, round(args.warmup_share * args.steps))

    def rate(step: int) -> float:  # the factor of the lr at optimizer step `step` (0-based), as the Trainer's linear
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (args.steps - step) / max(1, args.steps - warmup))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("out", "data_dir", "model")}

    def record(step: int, losses: list[tuple[float, float]], seconds: float) -> None:
        line = {"name": args.name, "step": step, "config": config, "seconds": round(seconds, 1)}
        if losses:
            line["train_q2d"] = sum(q for q, _ in losses) / len(losses)
            line["train_d2q"] = sum(d for _, d in losses) / len(losses)
        line.update(anchor_gain(model, val_batches))
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)

    start = time.time()
    record(0, [], 0.0)
    model.train()
    losses, cursor = [], 0
    for step in range(args.steps):
        if cursor + args.batch > len(train):
            random.Random(args.seed + step).shuffle(train)
            cursor = 0
        batch = collator(train[cursor : cursor + args.batch])
        cursor += args.batch
        output = model(**batch)
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((output.loss_q2d.item(), output.loss_d2q.item()))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            record(step + 1, losses, time.time() - start)
            losses = []
    return 0


if __name__ == "__main__":
    sys.exit(main())
