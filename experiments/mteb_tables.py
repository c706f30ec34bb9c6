"""Print the paper's MTEB tables (Table 1 layout and per task) from mteb result folders.

    python experiments/mteb_tables.py results/anchor-1b results/baseline-1b \\
        --paper-model Llama-3.2-1B-Instruct --paper-row anchor [--subset 15] [--output tables.md]

Each folder is one run (any folder under which mteb wrote ``<TaskName>.json`` files, e.g. an mteb
cache's ``results/<model>/<revision>``). The tasks and the paper's numbers default to the files in this
repository's ``test_configs/mteb``. The logic lives in :mod:`llm2vec.evaluation.tables`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from llm2vec.evaluation.benchmark import BenchmarkError, load_benchmark
from llm2vec.evaluation.tables import TableError, load_paper_results, paper_reference, read_run, render_markdown

CONFIG_DIR = Path(__file__).resolve().parents[1] / "test_configs" / "mteb"
DEFAULT_TASKS_FILE = CONFIG_DIR / "tasks.json"
DEFAULT_PAPER_FILE = CONFIG_DIR / "paper_results.json"


def build_arg_parser() -> argparse.ArgumentParser:
    """The options; docs/evaluation.md ("Tables") says what each does."""
    parser = argparse.ArgumentParser(prog="mteb_tables.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("result_dirs", nargs="+", type=Path, metavar="RESULT_DIR", help="mteb results of one run")
    parser.add_argument("--paper-model", help="the paper's model to compare with, e.g. Llama-3.2-1B-Instruct")
    parser.add_argument("--paper-row", default="anchor", help="anchor, baseline, only_d2q or only_q2d")
    parser.add_argument("--subset", help="a task subset of the tasks file: 15 (Table 8) (default: all 56 tasks)")
    parser.add_argument("--tasks-file", type=Path, default=DEFAULT_TASKS_FILE, help="default: %(default)s")
    parser.add_argument("--paper-file", type=Path, default=DEFAULT_PAPER_FILE, help="default: %(default)s")
    parser.add_argument("--output", type=Path, help="also write the Markdown to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        benchmark = load_benchmark(args.tasks_file)
        if args.subset is not None:
            try:
                benchmark = benchmark.subset(args.subset)
            except BenchmarkError as err:
                raise TableError(f"--subset {args.subset!r}: {err}") from None
        paper = None
        if args.paper_model:
            paper = paper_reference(load_paper_results(args.paper_file), args.paper_model, args.paper_row, benchmark)
        runs = [read_run(folder, benchmark) for folder in args.result_dirs]
    except (TableError, BenchmarkError) as err:
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
