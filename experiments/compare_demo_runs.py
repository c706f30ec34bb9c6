"""Two demo reports side by side, say the default command and the same at one CPU thread:

    python experiments/run_demo.py                                                # 2 threads on a 2-core machine
    python experiments/run_demo.py --threads 1 --out_dir cache/demo-threads1
    python experiments/compare_demo_runs.py cache/demo-runs cache/demo-threads1 --labels "2 threads" "1 thread"

Prints a Markdown table: per seed, each row's nDCG@10, Anchor - Baseline, Stage I only - Untrained, the anchor
gain, each Stage II run's end loss and first step below 0.7 x chance, at both, and their difference
(``experiments/demo/compare.py``); ``--out`` also writes it to a file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from demo.compare import comparison_table, read_results


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
