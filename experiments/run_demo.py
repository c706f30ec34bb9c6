"""The paper's pipeline end to end, offline, on a laptop CPU: SmolLM2-135M-Instruct, Stage I, Stage II
(Anchor and Baseline), mteb evaluation of the four rows of Table 10, and the Stage II loss plot (Figure 4).

    python experiments/run_demo.py            # outputs in cache/demo-runs/ (time: docs/demo.md)
    python experiments/run_demo.py --smoke    # tiny random model, 2 steps per stage (CI); cache/demo-smoke/
    python experiments/run_demo.py --fresh    # redo every step
    python experiments/run_demo.py --seeds 1  # one seed (42) instead of two (42, 43)
    python experiments/run_demo.py --preset full  # three seeds (42, 43, 44): longer than the plain command
    python experiments/run_demo.py --validate # the same runs, evaluated on the validation split

Finished steps are reused on the next run. The steps are in ``experiments/demo/pipeline.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from demo.pipeline import DemoError, run_demo
from demo.settings import DEFAULT_SEED, PRESETS, SIZES


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_demo.py",
        description="The Anchor Embedding pipeline end to end, offline, on CPU: SmolLM2-135M-Instruct, Stage I, "
        "Stage II (Anchor and Baseline), mteb evaluation of the paper's Table 10 rows, loss plot.",
    )
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="default",
        help="default: SmolLM2-135M-Instruct; smoke: tiny random model, 2 steps per stage (CI)",
    )
    p.add_argument("--smoke", action="store_const", const="smoke", dest="size", help="same as --size smoke")
    p.add_argument("--fresh", action="store_true", help="redo every step, even those whose output exists")
    p.add_argument(
        "--out_dir",
        default=None,
        help="where the runs and the report go (default: cache/demo-runs, "
        "cache/demo-smoke for --smoke; relative to the repository)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="how many seeds: "
        + ", ".join(f"{name} {n}" for name, n in PRESETS.items())
        + " (the times of both: docs/demo.md)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="train every row with this many seeds (--seed, --seed + 1, ...) and report mean and spread "
        "(default: the preset's)",
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="the first seed (default: %(default)s)")
    p.add_argument(
        "--validate",
        action="store_true",
        help="evaluate on the validation split (modules held out of training, not the test modules): "
        "where the demo's settings are chosen",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of every command (default: torch's count on this machine); the same count on the "
        "same machine gives the same numbers",
    )
    p.add_argument("--stage_I_steps", type=int, default=None, help="override the Stage I steps of the size")
    p.add_argument("--stage_II_steps", type=int, default=None, help="override the Stage II steps (both runs)")
    p.add_argument(
        "--stage_II_learning_rate", type=float, default=None, help="override the Stage II learning rate (both runs)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    changes = {
        k: v
        for k, v in (("stage_I_steps", args.stage_I_steps), ("stage_II_steps", args.stage_II_steps))
        if v is not None
    }
    if any(v < 1 for v in changes.values()):
        parser.error("step counts must be at least 1")
    if args.stage_II_learning_rate is not None:
        if not args.stage_II_learning_rate > 0:
            parser.error("--stage_II_learning_rate must be positive")
        changes["stage_II_learning_rate"] = args.stage_II_learning_rate
    if args.seeds is None:
        args.seeds = PRESETS[args.preset]
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    size = dataclasses.replace(SIZES[args.size], **changes)
    try:
        run_demo(
            size,
            fresh=args.fresh,
            out_dir=args.out_dir,
            seeds=tuple(range(args.seed, args.seed + args.seeds)),
            split="validation" if args.validate else "test",
            threads=args.threads,
        )
    except DemoError as e:
        print(f"run_demo.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "\nrun_demo.py: interrupted; finished steps are kept, the interrupted one is redone next time",
            file=sys.stderr,
        )
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
