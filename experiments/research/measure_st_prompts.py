"""Measure how an ad-hoc sentence-transformers ``prompt=`` embeds, against ``LLM2Vec.encode([[instruction, text]])``.

    python experiments/research/measure_st_prompts.py --model cache/models/SmolLM2-135M-Instruct --output_dir /tmp/st-prompts

Exports the model twice (the chat layout, the default, and the text layout of ``named_prompts_only``), encodes a
few queries with an instruction that is no exported prompt, passed as a new user would (``prompt=instruction``
and ``prompt=instruction + ": "``), and prints, per layout and per form, the cosine to LLM2Vec's embedding and the
largest absolute difference. Numbers in docs/export.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from llm2vec import LLM2Vec
from llm2vec.export import export_sentence_transformers

INSTRUCTION = "Given a one-line summary of a command, retrieve its manual page"
QUERIES = ("list the files in a directory", "copy a file to another place", "show the running processes")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a model folder LLM2Vec loads (e.g. the converted SmolLM2)")
    p.add_argument("--output_dir", required=True, help="where the two exports are written (replaced)")
    p.add_argument("--max_length", type=int, default=512)
    args = p.parse_args(argv)
    from sentence_transformers import SentenceTransformer

    reference = LLM2Vec.from_pretrained(args.model, device="cpu", max_length=args.max_length)
    want = reference.encode(
        [[INSTRUCTION, q] for q in QUERIES], convert_to_tensor=True, normalize_embeddings=True, show_progress_bar=False
    )
    for layout, named_only in (("chat", False), ("text", True)):
        folder = Path(args.output_dir) / layout
        export_sentence_transformers(
            args.model,
            folder,
            max_length=args.max_length,
            overwrite=True,
            named_prompts_only=named_only,
            device="cpu",
            query_instruction=INSTRUCTION,
        )
        model = SentenceTransformer(str(folder), device="cpu", local_files_only=True, trust_remote_code=False)
        for form, prompt in (("prompt=instruction", INSTRUCTION), ('prompt=instruction + ": "', INSTRUCTION + ": ")):
            got = model.encode(list(QUERIES), prompt=prompt, convert_to_tensor=True, show_progress_bar=False)
            cosine = torch.nn.functional.cosine_similarity(got.float(), want, dim=-1)
            print(
                f"{layout} layout, {form}: cosine {', '.join(f'{c:.4f}' for c in cosine.tolist())}; "
                f"max |difference| {(got.float() - want).abs().max().item():.2e}"
            )
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
