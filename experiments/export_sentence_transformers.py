"""Export a trained model as a sentence-transformers folder with the same embeddings as LLM2Vec.encode.

    python experiments/export_sentence_transformers.py \\
        --base_model_name_or_path output/stage_I/MetaLlama3.2_1b_q2d_d2q \\
        --peft_model_name_or_path output/stage_II/MetaLlama3.2_1b_stage1_2000steps_stage2 \\
        --task_to_instructions_fp test_configs/mteb/task_to_instructions.json \\
        --query_instruction "Given a web search query, retrieve relevant passages that answer the query" \\
        --output_dir output/st/MetaLlama3.2_1b

Then ``SentenceTransformer("output/st/MetaLlama3.2_1b")`` loads it (no custom code), and ``encode_query`` uses
the query instruction. Without ``--query_instruction`` the export reads the one instruction the run trained its
queries with from its ``run_config.json``, and refuses when there is no such single instruction (E5's many, none).
The logic, the layout of the folder and what cannot be exported are in :mod:`llm2vec.export`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from huggingface_hub.errors import HFValidationError

from llm2vec.export import ExportError, export_sentence_transformers
from llm2vec.io import missing_local_path

WHAT_TO_PASS = {
    "base_model_name_or_path": "the folder of a trained model (a Stage I output folder, or the base model of "
    "--peft_model_name_or_path) or a hub id such as meta-llama/Llama-3.2-1B-Instruct",
    "peft_model_name_or_path": "the folder of a Stage II adapter (it holds adapter_config.json) or a hub id",
}

DEFAULT_TASKS_FILE = Path(__file__).resolve().parents[1] / "test_configs" / "mteb" / "tasks.json"


def build_parser() -> argparse.ArgumentParser:
    """The options; docs/export.md says what each does."""
    p = argparse.ArgumentParser(prog="export_sentence_transformers.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--base_model_name_or_path", required=True, help="the trained model folder, or a hub id")
    p.add_argument("--peft_model_name_or_path", help="a LoRA adapter folder (Stage II output), merged in")
    p.add_argument("--output_dir", required=True, help="the sentence-transformers folder to write")
    p.add_argument("--task_to_instructions_fp", help="JSON object task name -> instruction: prompts to write")
    p.add_argument("--tasks", nargs="+", help="the tasks of --task_to_instructions_fp to write (default: all)")
    p.add_argument("--query_instruction", help="the query prompt's instruction (default: the run's; '' = none)")
    p.add_argument("--pooling_mode", help="override the model's pooling (exportable: eos_token, mean)")
    p.add_argument("--max_length", type=int, help="tokens per input (default: the model's, else 512)")
    p.add_argument(
        "--template", help="prompt template name, chat_template or plain (default: the source's, else detected)"
    )
    p.add_argument("--no_normalize", dest="normalize", action="store_false", help="no Normalize module")
    p.add_argument("--dtype", help="bfloat16, float16, float32 (default: the base checkpoint's)")
    p.add_argument("--mteb_results", nargs="+", default=(), help="mteb result folders to show in the model card")
    p.add_argument("--mteb_tasks_file", default=str(DEFAULT_TASKS_FILE), help="their tasks (default: %(default)s)")
    p.add_argument("--no_verify_embeddings", dest="verify_embeddings", action="store_false", help="skip the check")
    p.add_argument("--named_prompts_only", action="store_true", help="the text layout (needed for mean pooling)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous export in --output_dir")
    p.add_argument("--accept_other_base", action="store_true", help="an adapter trained on another base")
    p.add_argument("--trust_remote_code", action="store_true", help="run the code the model folder names")
    return p


def wrong_model_id(args: argparse.Namespace, error: Exception) -> str:
    """One line for Hugging Face's "Repo id must ..." (a value that is neither a folder here nor a hub id): the
    flag whose value it names, and what to pass."""
    named = [f for f in WHAT_TO_PASS if getattr(args, f) and repr(getattr(args, f)) in str(error)]
    flag = named[0] if named else "base_model_name_or_path"
    return (
        f"--{flag} {getattr(args, flag)!r} is neither a folder here nor a hub id (namespace/name); "
        f"pass {WHAT_TO_PASS[flag]}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("base_model_name_or_path", "peft_model_name_or_path"):
        value = getattr(args, flag)
        if value and missing_local_path(value):
            print(
                f"{parser.prog}: error: --{flag} {value!r}: no such folder; pass {WHAT_TO_PASS[flag]}", file=sys.stderr
            )
            return 2
    try:
        report = export_sentence_transformers(**vars(args))  # the options are the function's arguments
    except (ExportError, ValueError, OSError) as e:
        wrong_id = isinstance(e, HFValidationError) or isinstance(e.__cause__, HFValidationError)
        print(f"{parser.prog}: error: {wrong_model_id(args, e) if wrong_id else e}", file=sys.stderr)
        return 2
    query = report["query_instruction"]
    print(
        f"wrote {report['output_dir']}: {len(report['prompts'])} prompts ({report['layout']} layout; query prompt "
        + (f"{query!r}, {report['query_instruction_source']}" if query else "EMPTY: encode_query = encode_document")
        + "), "
        f"pooling {report['pooling']}, "
        f"max_seq_length {report['max_seq_length']}, weights {report['dtype']}; checked {report['texts']} probe "
        f"texts: same token ids for every prompt"
        + (f", embedding cosine >= {report['min_cosine']:.7f}" if report.get("embeddings_checked") else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
