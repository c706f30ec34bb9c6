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
    p = argparse.ArgumentParser(prog="export_sentence_transformers.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base_model_name_or_path",
        required=True,
        help="the trained model folder (Stage I output, a full model) or a hub id",
    )
    p.add_argument(
        "--peft_model_name_or_path",
        default=None,
        help="a LoRA adapter folder (Stage II output); merged into the exported weights",
    )
    p.add_argument("--output_dir", required=True, help="the sentence-transformers folder to write")
    p.add_argument(
        "--task_to_instructions_fp",
        default=None,
        help="JSON object task name -> instruction; each task named by --tasks becomes a prompt",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="the tasks of --task_to_instructions_fp to write prompts for (default: all of its entries)",
    )
    p.add_argument(
        "--query_instruction",
        default=None,
        help="instruction of the 'query' prompt that encode_query uses (default: the one instruction the run "
        "trained its queries with, read from its run_config.json; refused when there is not exactly one). "
        '--query_instruction "" writes an empty query prompt (encode_query then equals encode_document)',
    )
    p.add_argument("--pooling_mode", default=None, help="override the model's pooling (exportable: eos_token, mean)")
    p.add_argument(
        "--max_length",
        type=int,
        default=None,
        help="tokens per input, template and anchor included (default: the model's llm2vec_config.json, "
        "else 512); becomes max_seq_length",
    )
    p.add_argument(
        "--template",
        default=None,
        help="prompt template name, or chat_template: the one derived from the tokenizer's chat template (default: "
        "detected from the model)",
    )
    p.add_argument(
        "--no_normalize",
        dest="normalize",
        action="store_false",
        help="leave out the Normalize module (embeddings not scaled to unit length)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="dtype of the saved weights: bfloat16, float16, float32 (default: the base checkpoint's)",
    )
    p.add_argument(
        "--mteb_results",
        nargs="+",
        default=(),
        help="folders of mteb result files to show in the model card (the paper's Table 1 layout)",
    )
    p.add_argument(
        "--mteb_tasks_file",
        default=str(DEFAULT_TASKS_FILE),
        help="tasks file grouping --mteb_results into the paper's categories (default: %(default)s)",
    )
    p.add_argument(
        "--no_verify_embeddings",
        dest="verify_embeddings",
        action="store_false",
        help="skip the embedding comparison after saving (token ids are still compared)",
    )
    p.add_argument(
        "--named_prompts_only",
        action="store_true",
        help="write the text layout: only the exported prompts embed exactly, an ad-hoc prompt= does not (needed "
        "for mean pooling); default: any instruction passed as prompt= embeds as LLM2Vec.encode",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a previous export in --output_dir (only an export: a run's folder, other files or a folder "
        "above runs are refused)",
    )
    p.add_argument(
        "--accept_other_base",
        action="store_true",
        help="load --peft_model_name_or_path although its run_config.json records another base model (same "
        "shape, other weights; default: refused)",
    )
    p.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="run the Python code that the model folder's config.json or tokenizer_config.json names in its "
        "auto_map (default: such a model is refused)",
    )
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
        report = export_sentence_transformers(
            args.base_model_name_or_path,
            args.output_dir,
            args.peft_model_name_or_path,
            task_to_instructions_fp=args.task_to_instructions_fp,
            tasks=args.tasks,
            query_instruction=args.query_instruction,
            pooling_mode=args.pooling_mode,
            max_length=args.max_length,
            template=args.template,
            normalize=args.normalize,
            dtype=args.dtype,
            mteb_results=args.mteb_results,
            mteb_tasks_file=args.mteb_tasks_file,
            verify_embeddings=args.verify_embeddings,
            overwrite=args.overwrite,
            named_prompts_only=args.named_prompts_only,
            trust_remote_code=args.trust_remote_code,
            accept_other_base=args.accept_other_base,
        )
    except (ExportError, ValueError, OSError) as e:
        if isinstance(e, HFValidationError) or isinstance(e.__cause__, HFValidationError):
            print(f"{parser.prog}: error: {wrong_model_id(args, e)}", file=sys.stderr)
            return 2
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
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
