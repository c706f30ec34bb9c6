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
    add = p.add_argument
    # fmt: off
    add("--size", choices=sorted(SIZES), default="default",
        help="default: SmolLM2-135M-Instruct; smoke: tiny random model, 2 steps per stage (CI)")
    add("--smoke", action="store_const", const="smoke", dest="size", help="same as --size smoke")
    add("--fresh", action="store_true", help="redo every step, even those whose output exists")
    add("--out_dir", default=None, help="where the runs and the report go (default: cache/demo-runs, "
        "cache/demo-smoke for --smoke; relative to the repository)")
    add("--preset", choices=sorted(PRESETS), default="default", help="how many seeds: "
        + ", ".join(f"{name} {n}" for name, n in PRESETS.items()) + " (the times of both: docs/demo.md)")
    add("--seeds", type=_positive(int), default=None, help="train every row with this many seeds (--seed, "
        "--seed + 1, ...) and report mean and spread (default: the preset's)")
    add("--seed", type=int, default=DEFAULT_SEED, help="the first seed (default: %(default)s)")
    add("--validate", action="store_true", help="evaluate on the validation split (modules held out of training, "
        "not the test modules): where the demo's settings are chosen")
    add("--threads", type=_positive(int), default=None, help="CPU threads of every command (default: torch's count "
        "on this machine); the same count on the same machine gives the same numbers")
    add("--stage_I_steps", type=_positive(int), default=None, help="override the Stage I steps of the size")
    add("--stage_II_steps", type=_positive(int), default=None, help="override the Stage II steps (both runs)")
    add("--stage_II_learning_rate", type=_positive(float), default=None,
        help="override the Stage II learning rate (both runs)")
    # fmt: on
    return p


def _positive(kind):
    """An argparse type: a ``kind`` number above 0."""

    def parse(text: str):
        if not (value := kind(text)) > 0:
            raise argparse.ArgumentTypeError(f"{text}: must be above 0")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    changes = {k: getattr(args, k) for k in ("stage_I_steps", "stage_II_steps", "stage_II_learning_rate")}
    size = dataclasses.replace(SIZES[args.size], **{k: v for k, v in changes.items() if v is not None})
    seeds = args.seeds or PRESETS[args.preset]
    try:
        run_demo(size, fresh=args.fresh, out_dir=args.out_dir, seeds=tuple(range(args.seed, args.seed + seeds)),
                 split="validation" if args.validate else "test", threads=args.threads)  # fmt: skip
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
