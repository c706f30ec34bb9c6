"""Print the paper's MTEB tables (Table 1 layout and per task) from mteb result folders.

    python experiments/mteb_tables.py results/anchor-1b results/baseline-1b \\
        --paper-model Llama-3.2-1B-Instruct --paper-row anchor [--subset 15] [--output tables.md]

Each folder is one run (any folder under which mteb wrote ``<TaskName>.json`` files, e.g. an mteb
cache's ``results/<model>/<revision>``). The logic lives in :mod:`llm2vec.evaluation.tables`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from llm2vec.evaluation.tables import (  # noqa: E402
    TableError,
    load_benchmark,
    paper_reference,
    read_run,
    render_markdown,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result_dirs", nargs="+", type=Path, metavar="RESULT_DIR",
                        help="folder with mteb result files of one run (searched recursively)")
    parser.add_argument("--paper-model", default=None,
                        help="paper model to compare with, e.g. Llama-3.2-1B-Instruct, Qwen2.5-1.5B-Instruct, "
                             "Llama-3.2-3B-Instruct, Mistral-7B, Llama-3.1-8B-Instruct (default: no comparison)")
    parser.add_argument("--paper-row", default="anchor",
                        help="row of the paper for that model: anchor or baseline (Table 1); only_d2q or only_q2d "
                             "(Table 3, Llama-3.2-1B-Instruct) (default: anchor)")
    parser.add_argument("--subset", default=None,
                        help="restrict to a task subset of test_configs/mteb/tasks.json: 15 = the ablation subset "
                             "of Table 8 (default: all 56 tasks)")
    parser.add_argument("--output", type=Path, default=None, help="also write the Markdown to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        benchmark = load_benchmark(args.subset)
        paper = paper_reference(args.paper_model, args.paper_row, benchmark) if args.paper_model else None
        runs = [read_run(folder, benchmark) for folder in args.result_dirs]
    except TableError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    markdown = render_markdown(runs, benchmark, paper)
    print(markdown)
    if args.output is not None:
        try:
            args.output.write_text(markdown, encoding="utf-8")
        except OSError as err:
            print(f"error: {args.output}: cannot write ({err.strerror}); choose a writable path", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
