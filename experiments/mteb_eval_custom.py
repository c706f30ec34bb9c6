"""Evaluate an LLM2Vec / Anchor Embedding model on MTEB (mteb 2.x): tasks, a task set, or a local folder.

    python experiments/mteb_eval_custom.py --base_model_name_or_path <base> \\
        --peft_model_name_or_path <adapter> --task_name <TASK> \\
        --task_to_instructions_fp test_configs/mteb/task_to_instructions.json --output_dir <dir>

``--help`` lists the options. The defaults of ``--tasks_fp`` and ``--task_to_instructions_fp`` are the files
in this repository's ``test_configs/mteb``. Inputs are checked before the model is loaded (the files, every
name that becomes a folder or file name, that the results folder can be read and written, and that the model
runs no code of its folder unless ``--trust_remote_code``, and that ``--local_task_name`` is no task mteb knows);
bad input is one ``error:`` line and exit status 2; a task that fails during evaluation gives exit status 1. A
stored result is reused only when it was computed from the same task content, instruction, model files and
settings (:mod:`llm2vec.evaluation.result_keys`); otherwise the task is computed again.
The library code is :mod:`llm2vec.evaluation`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "test_configs" / "mteb"
DEFAULT_TASKS_FILE = CONFIG_DIR / "tasks.json"
DEFAULT_INSTRUCTIONS_FILE = CONFIG_DIR / "task_to_instructions.json"
PROG = "mteb_eval_custom.py"
ENCODER_OPTIONS = (  # passed on as they are to LLM2VecMTEBEncoder.from_pretrained
    "dtype", "pooling_mode", "max_length", "template", "attn_implementation", "doc_max_length", "model_name",
    "revision", "allow_missing_instructions", "batch_size", "trust_remote_code", "accept_other_base",
)  # fmt: skip


class UsageError(ValueError):
    """Bad command-line input; the message names the option or file and what to do."""


def build_arg_parser() -> argparse.ArgumentParser:
    """The options; docs/evaluation.md says what each does."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--base_model_name_or_path", required=True, help="base model (hub id or folder)")
    p.add_argument("--peft_model_name_or_path", help="LoRA adapter folder (merged before encoding)")
    p.add_argument("--task_name", nargs="+", default=[], help="mteb task name(s); several names or comma-separated")
    p.add_argument("--task_set", help="a named task list of --tasks_fp: mteb56 (all 56) or subset15 (Table 8)")
    p.add_argument("--tasks_fp", default=str(DEFAULT_TASKS_FILE), help="tasks file (default: %(default)s)")
    instructions = "JSON object: task -> instruction (default: %(default)s)"
    p.add_argument("--task_to_instructions_fp", default=str(DEFAULT_INSTRUCTIONS_FILE), help=instructions)
    allow = ("--allow-missing-instructions", "--allow_missing_instructions")
    p.add_argument(*allow, dest="allow_missing_instructions", action="store_true", help="encode those without one")
    p.add_argument("--local_retrieval_dir", help="a BEIR-style folder to evaluate as a retrieval task")
    p.add_argument("--local_task_name", default="StdlibDocRetrieval", help="its task name; no mteb task's")
    p.add_argument("--local_instruction", help="its query instruction (default: its entry in the instructions file)")
    p.add_argument("--output_dir", default="mteb_results", help="mteb result cache (results/<model>/<revision>/)")
    p.add_argument("--overwrite", action="store_true", help="recompute tasks whose results already exist")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument(
        "--dtype", default="auto", help="auto (bf16 on a GPU with it, else fp32), bfloat16, float16, float32"
    )
    p.add_argument("--max_length", type=int, help="tokens per input (default: the model's config, else 512)")
    p.add_argument("--doc_max_length", type=int, help="cut every text to this many tokens first (the authors: 400)")
    p.add_argument("--pooling_mode", help="eos_token (the paper's), last_token, mean, weighted_mean")
    p.add_argument("--template", help="prompt template name, or chat_template (default: detected)")
    p.add_argument("--attn_implementation", help="e.g. flash_attention_2, sdpa")
    p.add_argument("--device", default="auto", help="auto (every GPU, else CPU), a device, or a comma-separated list")
    p.add_argument("--model_name", help="org/name of the results folder (default: from the model path)")
    p.add_argument("--revision", help="revision folder (default: a hash of the model settings)")
    p.add_argument("--trust_remote_code", action="store_true", help="run the code the model folder names")
    p.add_argument("--accept_other_base", action="store_true", help="an adapter trained on another base")
    return p


def check_output(args: argparse.Namespace) -> None:
    """Every name that becomes a path component is a plain name, the local task's name is no mteb task's, and the
    results folder can be read and written: all before the model loads (:mod:`llm2vec.evaluation.paths`)."""
    from llm2vec.evaluation.local_task import TaskNameError, check_local_task_name
    from llm2vec.evaluation.paths import PathNameError, check_name, check_output_folder, model_folder_name

    try:
        if args.local_retrieval_dir is not None:
            check_name(args.local_task_name, "--local_task_name")
            check_local_task_name(args.local_task_name, "--local_task_name")
        if args.revision is not None:
            check_name(args.revision, "--revision")
        results = Path(args.output_dir) / "results"
        if args.model_name is not None:
            results = results / model_folder_name(args.model_name, "--model_name")
            if args.revision is not None:
                results = results / args.revision
        check_output_folder(results, f"--output_dir {args.output_dir}")
    except (PathNameError, TaskNameError) as e:
        raise UsageError(str(e)) from None


def select_tasks(args: argparse.Namespace, instructions: Mapping[str, str]) -> list:
    """The mteb task objects that ``args`` ask for (restricted to the paper's splits), the local task last.

    Checks that every task has an instruction: in ``instructions``, or the local task's own.
    """
    from llm2vec.evaluation.benchmark import BenchmarkError, UnknownTaskError, load_benchmark, mteb_tasks
    from llm2vec.evaluation.local_task import local_retrieval_task

    try:
        benchmark = load_benchmark(args.tasks_fp)
    except BenchmarkError as e:
        raise UsageError(f"--tasks_fp: {e}") from None
    sets = {benchmark.name: [t.name for t in benchmark.tasks]}
    sets.update({f"subset{key}": list(names) for key, names in benchmark.subsets.items()})
    names = given = [name.strip() for raw in args.task_name for name in raw.split(",") if name.strip()]
    if args.task_set is not None:
        if args.task_set not in sets:
            raise UsageError(
                f"--task_set {args.task_set!r}: unknown; choose one of {sorted(sets)} (from {args.tasks_fp})"
            )
        names = given + sets[args.task_set]
    if not names and args.local_retrieval_dir is None:
        raise UsageError("no task: give --task_name, --task_set or --local_retrieval_dir")
    try:
        tasks = mteb_tasks(benchmark.expand(names), benchmark)
    except UnknownTaskError as e:
        if e.name not in given:  # listed in the tasks file
            raise UsageError(f"--tasks_fp {args.tasks_fp}: {e}") from None
        raise UsageError(
            f"--task_name {e}; use mteb 2.x task names as in {args.tasks_fp}, or --task_set {' / '.join(sorted(sets))}"
        ) from None

    covered = set(instructions)
    if args.local_retrieval_dir is not None:
        try:
            local = local_retrieval_task(args.local_retrieval_dir, name=args.local_task_name)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(f"--local_retrieval_dir: {e}") from None
        if args.local_instruction is not None:  # kept on the task, where the encoder reads it
            local.instruction = args.local_instruction
            covered.add(local.metadata.name)
        tasks.append(local)

    missing = [t.metadata.name for t in tasks if t.metadata.name not in covered]
    if missing and not args.allow_missing_instructions:
        raise UsageError(
            f"no instruction for {missing} in {args.task_to_instructions_fp}; add them there"
            + (" (or give --local_instruction)" if args.local_retrieval_dir else "")
            + ", or pass --allow-missing-instructions to encode them without one"
        )
    return tasks


def run(args: argparse.Namespace) -> int:
    """Check the inputs (before loading the model), evaluate, print main scores. Returns the exit code."""
    import torch

    from llm2vec.evaluation.mteb_wrapper import InstructionsFileError, LLM2VecMTEBEncoder, evaluate, load_instructions
    from llm2vec.evaluation.paths import PathNameError
    from llm2vec.evaluation.replicas import resolve_devices
    from llm2vec.model_files import ModelFilesError, check_model_files

    if args.batch_size < 1:
        raise UsageError(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.doc_max_length is not None and args.doc_max_length < 1:
        raise UsageError(f"--doc_max_length must be >= 1 (tokens), got {args.doc_max_length}; leave it out for no cap")
    check_output(args)
    try:
        instructions = load_instructions(args.task_to_instructions_fp)
    except InstructionsFileError as e:
        raise UsageError(f"--task_to_instructions_fp: {e}") from None
    tasks = select_tasks(args, instructions)
    devices = [d.strip() for d in args.device.split(",")] if "," in args.device else args.device
    try:
        device_list = resolve_devices(devices)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--device {args.device!r}: {e}") from None
    if any(d.type == "cuda" for d in device_list) and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device!r}: no CUDA device is visible; use --device cpu or auto")
    try:
        check_model_files(
            args.base_model_name_or_path, args.peft_model_name_or_path, args.trust_remote_code, args.accept_other_base
        )
    except ModelFilesError as e:
        raise UsageError(str(e)) from None

    try:
        encoder = LLM2VecMTEBEncoder.from_pretrained(
            args.base_model_name_or_path,
            args.peft_model_name_or_path,
            instructions=args.task_to_instructions_fp,
            devices=device_list,
            **{name: getattr(args, name) for name in ENCODER_OPTIONS},
        )
    except (PathNameError, ModelFilesError) as e:  # a model name from a path that is no plain name
        raise UsageError(str(e)) from None
    except OSError as e:  # transformers / peft: no such folder or hub id, or no weights in it
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(
            f"cannot load the model {args.base_model_name_or_path!r}"
            + (f" with adapter {args.peft_model_name_or_path!r}" if args.peft_model_name_or_path else "")
            + f": {first_line}"
        ) from None
    results = evaluate(encoder, tasks, args.output_dir, overwrite=args.overwrite, batch_size=args.batch_size)
    for tr in results.task_results:
        print(f"{tr.task_name}\t{tr.get_score():.4f}")
    for err in results.exceptions:
        print(f"FAILED {err.task_name}: {err.exception}")
    print(f"results: {encoder.results_folder(args.output_dir)}")
    return 1 if results.exceptions else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
