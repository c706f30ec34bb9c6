"""The geometry of the anchor embeddings of saved models on a BEIR folder (:mod:`llm2vec.geometry`), raw and centred,
with standard errors clustered by module.

    python experiments/research/anchor_geometry.py --model cache/models/SmolLM2-135M-Instruct \
        --model cache/long-run/stage_I --folder cache/package-data/eval --out cache/geometry.json

Each ``--model`` (a model folder, or ``BASE,ADAPTER`` for a LoRA adapter on its base) embeds the folder's queries
with ``--instruction`` and its documents without, as the retrieval evaluation does
(:func:`llm2vec.retrieval.embed_items`), and gives every measure of :func:`llm2vec.geometry.anchor_geometry`
against the whole corpus. The per-query measures (InfoNCE, accuracy@1, MRR) come with a standard error clustered by
module (:func:`demo.anchor_spread.clustered`): a query's module is that of its first relevant document, read from
the corpus's ``manifest.json`` (``--manifest``; default: beside the folder) under ``<folder name>_modules`` (the
demo corpora's layout). Without one, each query is its own cluster. The side measures are of the whole set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo.anchor_spread import clustered, module_of  # noqa: E402
from demo.settings import INSTRUCTION  # noqa: E402

PER_QUERY = ("infonce", "accuracy_at_1", "mrr")
ROWS = [
    (f"{m}_{side}", f"{title}, {sides}")
    for m, title in (("cosine", "mean pairwise cosine"), ("top_share", "top direction's share"),
                     ("effective_rank", "effective rank"))
    for side, sides in (("document", "documents"), ("query", "queries"))
] + [("infonce", "InfoNCE"), ("accuracy_at_1", "accuracy@1"), ("mrr", "MRR")]  # fmt: skip


def query_groups(folder, manifest: Path | None) -> tuple[list[str], str]:
    """Each query's cluster (its first relevant document's module, or the query itself) and what they are."""
    path = manifest or folder.path.parent / "manifest.json"
    key = f"{folder.name}_modules"
    modules = json.loads(path.read_text(encoding="utf-8")).get(key) if path.is_file() else None
    if modules is None:
        if manifest is not None:
            raise SystemExit(f"error: {manifest}: no {key!r} list; give the manifest of the corpus the folder is from")
        return list(folder.queries), "query"
    first = [next(d for d, g in folder.relevant[q].items() if g > 0) for q in folder.queries]
    return [module_of(d, modules) for d in first], "module"


def measure(spec: str, folder, groups: list[str], instruction: str, max_length: int, batch: int, scale: float):
    """Every measure of the model ``spec`` on ``folder``, with its per-query standard errors."""
    import torch

    from llm2vec import LLM2Vec
    from llm2vec.geometry import anchor_geometry, query_terms, variants
    from llm2vec.retrieval import embed_items

    base, _, adapter = spec.partition(",")
    if missing := [x for x in (base, adapter) if x and not Path(x).is_dir()]:
        raise SystemExit(f"error: --model {spec}: no folder {missing[0]}; give a saved model (or BASE,ADAPTER)")
    try:
        encoder = LLM2Vec.from_pretrained(base, adapter or None, merge_peft=True, max_length=max_length)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --model {spec}: cannot load it ({str(e).splitlines()[0]})") from None
    with torch.no_grad():
        q = embed_items(encoder, encoder, [(instruction, t) for t in folder.queries.values()], batch, encoder.device)
        d = embed_items(encoder, encoder, [("", folder.document_text(i)) for i in folder.corpus], batch, encoder.device)
    index = {doc: i for i, doc in enumerate(folder.corpus)}
    relevant = [[index[doc] for doc, g in folder.relevant[qid].items() if g > 0] for qid in folder.queries]
    values = anchor_geometry(q, d, relevant, scale)
    errors = {}
    for suffix, (qv, dv) in variants(q, d).items():
        terms = query_terms(qv, dv, relevant, scale)
        rows = [dict(zip(PER_QUERY, t)) for t in zip(*(terms[m].tolist() for m in PER_QUERY))]
        errors.update({f"geometry_{m}{suffix}": clustered(rows, groups, (m,), None)["se"] for m in PER_QUERY})
    return {"model": spec, "queries": len(q), "documents": len(d), "values": values, "errors": errors}


def table(result: dict) -> list[str]:
    v, e = result["values"], result["errors"]
    cell = lambda key: f"{v[key]:.4f}" + (f" ± {e[key]:.4f}" if key in e else "")  # noqa: E731
    lines = [f"`{result['model']}`: {result['queries']} queries, {result['documents']} documents; errors clustered "
             f"by {result['clustered']} ({result['clusters']} clusters)", "",
             "| measure | raw | centred |", "|---|---:|---:|"]  # fmt: skip
    lines += [f"| {title} | {cell('geometry_' + k)} | {cell('geometry_' + k + '_centred')} |" for k, title in ROWS]
    lines += [f"\nchance: InfoNCE {v['geometry_infonce_chance']:.4f} (ln N), "
              f"accuracy@1 {v['geometry_accuracy_at_1_chance']:.4f}", ""]  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="model folder or BASE,ADAPTER (repeatable)")
    parser.add_argument("--folder", type=Path, required=True, help="BEIR-layout folder (corpus, queries, qrels)")
    parser.add_argument("--instruction", default=INSTRUCTION, help="the queries' instruction (default: the demo's)")
    parser.add_argument("--manifest", type=Path, help="corpus manifest with <folder name>_modules (default: beside)")
    parser.add_argument("--max_length", type=int, default=64, help="tokens per text (the demo's 64)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--scale", type=float, default=20.0, help="InfoNCE scale 1 / tau (the paper's 20)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, help="JSON file of the results (written after each model)")
    args = parser.parse_args(argv)
    if args.max_length < 2 or args.batch < 1 or not args.scale > 0:
        parser.error("--max_length must be >= 2, --batch >= 1 and --scale > 0")
    import torch

    from llm2vec.beir import read_beir_folder

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        folder = read_beir_folder(args.folder)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --folder {args.folder}: {str(e).splitlines()[0]}") from None
    groups, kind = query_groups(folder, args.manifest)
    results = []
    for spec in args.model:
        result = measure(spec, folder, groups, args.instruction, args.max_length, args.batch, args.scale)
        results.append({**result, "folder": str(args.folder), "clusters": len(set(groups)), "clustered": kind})
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")
        print("\n".join(table(results[-1])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
