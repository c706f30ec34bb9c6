"""What every demo driver (:mod:`demo.pipeline`, :mod:`demo.scale`, :mod:`demo.long_run`) runs Stage I and II
with: the train and validation files it writes, the stage command line and the environment of the child.

A resume compares its inputs with the checkpoint's, so the bytes these write and the command lines they build are
held fixed by tests (``tests/test_long_run.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from llm2vec.io import iter_jsonl, write_jsonl

from .settings import (
    ANCHOR_CONFIG,
    BASELINE_CONFIG,
    INSTRUCTION,
    REPO_ROOT,
    VALIDATION_PAIRS,
    VALIDATION_SOURCE,
    warmup_steps,
)


def write_train_file(source: Path, path: Path) -> int:
    """The train pairs of the JSON-lines file ``source``, each with the query instruction, as ``path``; returns
    how many."""
    rows = [{"instruction": INSTRUCTION, **row} for _, row in iter_jsonl(source) if row is not None]
    return write_jsonl(path, rows)


def validation_rows(split: Path, count: int = VALIDATION_PAIRS, with_ids: bool = False) -> list[dict[str, str]]:
    """``count`` (query, relevant document) pairs of the retrieval split in ``split`` (BEIR layout), a fixed random
    subset (the qrels in file order, shuffled with seed 0: a larger ``count`` keeps the smaller one's pairs first),
    with the query instruction, in the training layout. The one choice of validation pairs of the demo, the long
    run, :mod:`demo.scale` and :mod:`demo.anchor_spread`; fewer when the split holds fewer.
    ``with_ids``: each row also names its document (``id``, the corpus id: the object's dotted name)."""
    corpus = {r["_id"]: r["text"] for _, r in iter_jsonl(split / "corpus.jsonl") if r is not None}
    queries = {r["_id"]: r["text"] for _, r in iter_jsonl(split / "queries.jsonl") if r is not None}
    rows = [
        {"query": queries[r["query-id"]], "positive": corpus[r["corpus-id"]], "instruction": INSTRUCTION}
        | ({"id": r["corpus-id"]} if with_ids else {})
        for _, r in iter_jsonl(split / "qrels.jsonl")
        if r is not None
    ]
    random.Random(0).shuffle(rows)
    return rows[:count]


def write_validation_file(split: Path, folder: Path, count: int = VALIDATION_PAIRS) -> int:
    """:func:`validation_rows` as ``<folder>/validation.jsonl``; returns how many pairs."""
    return write_jsonl(folder / f"{VALIDATION_SOURCE}.jsonl", validation_rows(split, count))


def stage_flags(
    stage: str, model, train, output, steps: int, save: dict, batch: dict | None = None, evaluation=None
) -> dict[str, Any]:
    """A Stage ``stage`` run from ``model`` on ``train`` into ``output`` for ``steps`` steps (warm-up: the paper's
    share); ``save`` its checkpointing flags, ``batch`` its batch geometry (default: the config's); ``evaluation``,
    ``(validation file, every, batch)``: the validation file's pairs evaluated at step 0 and every ``every`` steps.
    The order of the flags is that of the command line."""
    validation, every, eval_batch = evaluation or (None, None, None)
    flags = {"model_name_or_path": model, "dataset_file_path": train, "validation_file": validation}
    flags.update(output_dir=output, max_steps=steps, warmup_steps=warmup_steps(stage, steps), **(batch or {}))
    if evaluation:
        flags.update(eval_strategy="steps", eval_steps=every, eval_on_start=True, per_device_eval_batch_size=eval_batch)
    return {k: v for k, v in flags.items() if v is not None} | save | {"logging_steps": 1, "report_to": "none"}


def arms(base, stage_I) -> list[tuple[str, Path, Any]]:
    """Stage II's arms, (name, config, start): Anchor from the Stage I model, the Baseline from the original one."""
    return [("anchor", ANCHOR_CONFIG, stage_I), ("baseline", BASELINE_CONFIG, base)]


def stage_command(script: Path | str, config: Path | str, flags: dict[str, Any], launcher=None) -> list[str]:
    """``python script config --field value ...`` (``launcher`` in place of ``python``): a path or a string as it
    is, any other value as JSON (``true``, ``640``, ``4e-05``)."""
    command = [*(launcher or [sys.executable]), str(script), str(config)]
    for field, value in flags.items():
        command += [f"--{field}", str(value) if isinstance(value, (str, Path)) else json.dumps(value)]
    return command


def parser(doc: str) -> argparse.ArgumentParser:
    """A driver's parser, described by the first paragraph of its module docstring."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


class StageError(RuntimeError):
    """Bad input or a failed command of a demo driver; the message names what and what to do."""


def quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./=:,@+" for c in arg) else json.dumps(arg)


def run_command(cmd: list[str], threads: int | None = None, log: Path | None = None, poll=None, every: float = 5.0):
    """Run ``cmd`` from the repository root in :func:`child_env`, its output to this terminal or into the file
    ``log``, calling ``poll()`` every ``every`` seconds while it runs; returns its peak resident memory in MiB.
    A failure raises :class:`StageError` (with the end of ``log``); if this process is stopped, so is the child
    (after up to 30 s: a Ctrl-C reaches it too)."""
    print("  $ " + " ".join(quote(c) for c in cmd), flush=True)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "w")) if log else None
        child = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=child_env(threads), stdout=out, stderr=out and subprocess.STDOUT
        )
        try:
            while not (done := os.wait4(child.pid, os.WNOHANG if poll else 0))[0]:
                time.sleep(every)
                poll()
        except BaseException:
            with contextlib.suppress(Exception):
                child.wait(timeout=30 if poll is None else 0)
            if child.poll() is None:
                child.kill()
            raise
    code = os.waitstatus_to_exitcode(done[1])
    if code != 0:
        tail = "".join(Path(log).read_text(errors="replace").splitlines(keepends=True)[-20:]) if log else ""
        raise StageError(f"command failed with exit code {code}: {' '.join(quote(c) for c in cmd)}\n{tail}".rstrip())
    return done[2].ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)


def child_env(threads: int | None = None) -> dict[str, str]:
    """This environment, offline, with this checkout's ``llm2vec`` first on the import path and, when
    ``threads`` is given, that many CPU threads for torch (a fixed count keeps CPU results reproducible)."""
    env = dict(os.environ)
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(name, "1")  # everything is local; never reach for the hub
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def read_state(run: Path) -> dict[str, Any]:
    """The ``trainer_state.json`` of the finished training run ``run``."""
    if not (state := run / "trainer_state.json").is_file():
        raise StageError(f"{state}: missing; the run did not finish")
    return json.loads(state.read_text(encoding="utf-8"))


def metrics_entries(path: Path) -> list[dict[str, Any]]:
    """The entries a running or finished run has written to its ``metrics_file`` ``path`` so far (none if it is not
    there yet; a last line still being written is left for the next read)."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


TIMINGS = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")  # differ between equal evaluations


def curve_from_log(entries: list[dict], global_batch: int) -> tuple[list[dict[str, float]], list[tuple[dict, dict]]]:
    """The Stage I evaluations among a run's log entries (``log_history`` of its ``trainer_state.json``, or the
    lines of its ``metrics_file``): one row per step (step, pairs seen, every measure without its ``eval_``
    prefix), and the repeats. A resumed run evaluates its first step again (``eval_on_start``); the first
    evaluation is the step's row and each repeat is returned beside it, as ``(row, repeat)``, so that a caller can
    say whether the resume restored the model."""
    rows: dict[int, dict[str, float]] = {}
    repeats = []
    for h in entries:
        if "eval_anchor_gain_d2q" not in h:
            continue
        step = int(h["step"])
        row = {"step": step, "pairs_seen": step * global_batch}
        row.update({k[len("eval_") :]: float(v) for k, v in h.items() if k.startswith("eval_") and k not in TIMINGS})
        if step in rows:
            repeats.append((rows[step], row))
        else:
            rows[step] = row
    return list(rows.values()), repeats


def markdown_table(header: list[str], rows, left: int = 1) -> list[str]:
    """The one Markdown table of the demo's reports: the first ``left`` columns left-aligned, the rest right."""
    line = lambda cells: "|" + "".join(f" {c} |" if str(c) else " |" for c in cells)  # noqa: E731
    return [line(header), "|" + "---|" * left + "---:|" * (len(header) - left), *map(line, rows)]


GEOMETRY = ("cosine_document", "cosine_query", "top_share_document", "top_share_query", "accuracy_at_1",
            "accuracy_at_1_centred", "mrr", "mrr_centred", "infonce", "infonce_centred")  # fmt: skip


def geometry_table(rows: list[dict[str, float]], thousands: str = "") -> list[str]:
    """The anchors' geometry (:mod:`llm2vec.geometry`) at each evaluation of the curve that logged it, as Markdown
    lines with the chance values under it; none when no evaluation did."""
    rows = [r for r in rows if "geometry_cosine_document" in r]
    if not rows:
        return []
    header = "step|pairs seen|cos docs|cos queries|top share docs|top share queries|acc@1|acc@1 centred|MRR|"
    lines = markdown_table((header + "MRR centred|InfoNCE|InfoNCE centred").split("|"), (
        [r["step"], f"{r['pairs_seen']:{thousands}}", *(f"{r['geometry_' + k]:.3f}" for k in GEOMETRY)]
        for r in rows), left=0)  # fmt: skip
    chance = f"InfoNCE {rows[0]['geometry_infonce_chance']:.3f} (ln N), accuracy@1 "
    return [
        *lines,
        "",
        f"chance: {chance}{rows[0]['geometry_accuracy_at_1_chance']:.3f}; centred: each side less its mean",
    ]


def curve_table(rows: list[dict[str, float]], thousands: str = "") -> list[str]:
    """The curve as Markdown lines; ``thousands`` groups the pairs seen (``","``) or not (``""``)."""
    header = "step|pairs seen|loss q2d|loss d2q|gain q2d|gain d2q|gain@4 q2d|gain@4 d2q|rank acc q2d|rank acc d2q"
    return markdown_table(header.split("|"), (
        [r["step"], f"{r['pairs_seen']:{thousands}}", f"{r['loss_q2d']:.3f}", f"{r['loss_d2q']:.3f}",
         *(f"{r[f'{m}_{d}']:+.3f}" for m in ("anchor_gain", "anchor_gain_first4") for d in ("q2d", "d2q")),
         f"{r['rank_accuracy_q2d']:.3f}", f"{r['rank_accuracy_d2q']:.3f}"] for r in rows), left=0)  # fmt: skip
