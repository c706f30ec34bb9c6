"""Loading training data: time and memory of ``dataset_name: hf`` against the JSON-lines loader, each variant in its
own process (:func:`benchmark.in_own_process`).

    python experiments/research/benchmark_data.py              # 2,000,000 pairs (about 4.5 GB in a temporary folder)
    python experiments/research/benchmark_data.py --rows 200000 --json

Writes ``--rows`` (query, positive) pairs of random words (a query of 6 to 16 words, a passage of 30 to 90,
``--passage_words``, as short E5 pairs are) once, as a JSON-lines file, a parquet file, an Arrow stream file and a
``save_to_disk`` folder (those the variants read; ``--work`` keeps them for the next run), then loads them with
global batches of ``--global_batch``:

- ``jsonl`` (the reference): :func:`llm2vec.dataset.load_jsonl`, every example a Python object;
- ``hf_jsonl_cold``: :func:`llm2vec.dataset.load_hf` on the same JSON-lines file, converted into an empty
  ``datasets`` cache first; ``hf_jsonl``: again, the conversion found in the cache;
- ``hf_parquet_cold``, ``hf_parquet``: the parquet file, likewise;
- ``hf_arrow``: the Arrow stream file, memory-mapped as it is;
- ``hf_disk``: the ``save_to_disk`` folder, memory-mapped as it is.

Each prints ``seconds`` (the load: reading, row checks, arrangement), ``peak_rss_mib`` (the process's peak
resident memory, ``VmHWM``), ``setup_rss_mib`` (after the imports, before the load), ``peak_anon_mib`` (the peak
of the resident memory that is the process's own, ``RssAnon``, sampled every 5 ms: resident pages of mapped
files left out, which the kernel drops when memory is short), ``setup_anon_mib``, ``anon_mib`` / ``file_mib``
(own and mapped-file resident memory after the load), and a digest of every 1000th arranged example (and the
count). Before any ratio is printed all variants must give the same digest, else the script exits with an error.
The table's ``load MiB`` is peak minus setup resident memory, ``own MiB`` the same of the own memory; the ratios
are against ``jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "experiments")]
from benchmark import in_own_process, peak_rss_mib, status_mib  # noqa: E402 - the worker runner of benchmark.py

VARIANTS = ("jsonl", "hf_jsonl_cold", "hf_jsonl", "hf_parquet_cold", "hf_parquet", "hf_arrow", "hf_disk")
REFERENCE = "jsonl"
BLOCK = 100_000


# ------------------------------------------------------------------------------------------------ data


FILES = {"jsonl": "pairs.jsonl", "parquet": "pairs.parquet", "arrow": "pairs.arrow", "disk": "disk/pairs"}
FORMATS = {v: v.removeprefix("hf_").removesuffix("_cold") for v in VARIANTS}  # what each variant reads


def write_data(work: Path, rows: int, formats: set[str], passage_words=(30, 90), seed: int = 0) -> None:
    """The same rows as ``pairs.jsonl``, ``pairs.parquet``, ``pairs.arrow`` and the ``save_to_disk`` folder
    ``disk/pairs`` (those of ``formats`` not written yet), block by block."""
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from llm2vec.testing import _CORPUS

    vocabulary = np.array(sorted(set(" ".join(_CORPUS).replace(".", "").replace(",", "").lower().split())))
    rng = np.random.default_rng(seed)
    schema = pa.schema([("query", pa.string()), ("positive", pa.string())])

    def text(low: int, high: int) -> str:
        return " ".join(vocabulary[rng.integers(0, len(vocabulary), rng.integers(low, high + 1))])

    work.mkdir(parents=True, exist_ok=True)
    wanted = {f for f in formats | ({"arrow"} if "disk" in formats else set()) if not (work / FILES[f]).exists()}
    if not wanted:
        return
    print(f"benchmark_data: writing {rows} pairs to {work} ({', '.join(sorted(wanted))})", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        lines = stack.enter_context(open(work / "pairs.jsonl", "w", encoding="utf-8")) if "jsonl" in wanted else None
        parquet = stack.enter_context(pq.ParquetWriter(work / "pairs.parquet", schema)) if "parquet" in wanted else None
        arrow = None
        if "arrow" in wanted:
            sink = stack.enter_context(pa.OSFile(str(work / "pairs.arrow"), "wb"))
            arrow = stack.enter_context(pa.ipc.new_stream(sink, schema))
        for start in range(0, rows, BLOCK):
            n = min(BLOCK, rows - start)
            queries = [f"{start + i} {text(5, 15)}" for i in range(n)]  # numbered: every query distinct
            passages = [text(*passage_words) for _ in range(n)]
            if lines is not None:
                lines.writelines(json.dumps({"query": q, "positive": p}) + "\n" for q, p in zip(queries, passages))
            table = pa.table({"query": queries, "positive": passages}, schema=schema)
            for writer in (parquet, arrow):
                if writer is not None:
                    writer.write_table(table)
    if "disk" in wanted:
        datasets.Dataset.from_file(str(work / FILES["arrow"])).save_to_disk(str(work / FILES["disk"]))


# ---------------------------------------------------------------------------------------------- worker


@contextlib.contextmanager
def anon_peak(interval: float = 0.005):
    """Yields a dict whose ``"peak"`` is, once the block has run, the peak of ``RssAnon`` (the process's own resident
    memory, mapped files left out) sampled every ``interval`` seconds by a thread (the kernel keeps a peak of the
    whole resident memory only)."""
    seen, stop = {"peak": 0.0}, threading.Event()

    def sample() -> None:
        while True:
            seen["peak"] = max(seen["peak"], status_mib().get("RssAnon", 0.0))
            if stop.wait(interval):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()
        seen["peak"] = max(seen["peak"], status_mib().get("RssAnon", 0.0))


def digest(dataset, every: int = 1000) -> str:
    """Of the count and every ``every``-th arranged example (query, positive, source)."""
    h = hashlib.sha256(str(len(dataset)).encode())
    for i in range(0, len(dataset), every):
        ex = dataset[i]
        h.update("\x00".join((ex.query, ex.positive, ex.source)).encode())
    return h.hexdigest()[:16]


def worker(args) -> None:
    import datasets  # noqa: F401 - imported before the setup measurement, as the loaders need it
    import pyarrow  # noqa: F401

    from llm2vec.dataset import load_hf, load_jsonl

    datasets.disable_progress_bars()
    work = Path(args.work)
    cache = work / "hf_cache"
    if args.variant.endswith("_cold"):
        shutil.rmtree(cache, ignore_errors=True)
    path = str(work / FILES[FORMATS[args.variant]])
    setup, setup_anon = status_mib()["VmRSS"], status_mib().get("RssAnon", 0.0)
    with anon_peak() as anon:
        start = time.perf_counter()
        if args.variant == "jsonl":
            dataset = load_jsonl([path], args.global_batch, seed=args.seed)
        else:
            dataset = load_hf([path], args.global_batch, seed=args.seed, cache_dir=str(cache))
        seconds = time.perf_counter() - start
    after = status_mib()
    mib = {"peak_rss_mib": peak_rss_mib(), "setup_rss_mib": setup, "setup_anon_mib": setup_anon}
    mib.update(peak_anon_mib=anon["peak"], anon_mib=after.get("RssAnon", 0.0), file_mib=after.get("RssFile", 0.0))
    record = {"variant": args.variant, "rows": args.rows, "examples": len(dataset), "seconds": round(seconds, 3)}
    print(json.dumps({**record, **{k: round(v, 1) for k, v in mib.items()}, "digest": digest(dataset)}))


# ---------------------------------------------------------------------------------------------- driver


def run_worker(args, variant: str) -> dict:
    job = {**vars(args), "variant": variant}
    return in_own_process(__file__, job, f"benchmark_data: {variant}", {"variant": variant})


def check_and_print(records: list[dict], as_json: bool) -> None:
    done = [r for r in records if "failed" not in r]
    if len({(r["digest"], r["examples"]) for r in done}) > 1:
        raise SystemExit(
            "benchmark_data: the variants disagree on the arranged examples: "
            + ", ".join(f"{r['variant']} {r['examples']} {r['digest']}" for r in done)
        )
    if as_json:
        for r in records:
            print(json.dumps(r))
        return
    ref = next((r for r in done if r["variant"] == REFERENCE), None)

    def grown(r: dict) -> tuple[float, float]:  # (peak resident, peak own) growth over the setup
        return r["peak_rss_mib"] - r["setup_rss_mib"], r["peak_anon_mib"] - r["setup_anon_mib"]

    print(
        f"{'variant':16} {'rows':>9} {'seconds':>8} {'peak MiB':>9} {'load MiB':>9} {'own MiB':>8} {'file MiB':>9} "
        f"{'time ratio':>10} {'load ratio':>10} {'own ratio':>9}"
    )
    for r in records:
        if "failed" in r:
            print(f"{r['variant']:16} {r['failed']}")
            continue
        load, own = grown(r)
        ratios = ["-"] * 3
        if ref:
            ratios = [
                f"{x / y:.{d}f}" for x, y, d in zip((r["seconds"], load, own), (ref["seconds"], *grown(ref)), (2, 3, 3))
            ]
        print(
            f"{r['variant']:16} {r['rows']:>9} {r['seconds']:>8.2f} {r['peak_rss_mib']:>9.0f} {load:>9.0f} {own:>8.0f} "
            f"{r['file_mib']:>9.0f} {ratios[0]:>10} {ratios[1]:>10} {ratios[2]:>9}"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="pairs written and loaded (default: %(default)s)")
    p.add_argument("--global_batch", type=int, default=512, help="the arrangement's global batch (the paper's)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--passage_words", type=int, nargs=2, default=(30, 90), help="fewest and most words of a passage (%(default)s)"
    )
    p.add_argument("--only", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="variants to run")
    p.add_argument("--work", type=Path, default=None, help="folder for the data (default: a temporary one, deleted)")
    p.add_argument("--json", action="store_true", help="one JSON object per variant instead of the table")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a variant's settings as JSON: run it here
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(argparse.Namespace(**json.loads(args.worker)))
        return 0
    with contextlib.ExitStack() as stack:
        if args.work is None:
            args.work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="benchmark_data-")))
        order = [v for v in VARIANTS if v in args.only]
        write_data(args.work, args.rows, {FORMATS[v] for v in order}, args.passage_words)
        records = [run_worker(args, variant) for variant in order]
    check_and_print(records, args.json)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
