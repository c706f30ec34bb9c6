"""The long CPU run: Stage I on the package docstring corpus, with the anchor measures every 40 steps.

    python experiments/demo/long_run.py [--steps 640] [--threads 2]     # starts, or resumes, the run
    python experiments/demo/long_run.py --table                          # the curve so far, as Markdown
    python experiments/demo/long_run.py --seed 43 --out cache/long-run-seed43   # a second run, another seed
    python experiments/demo/long_run.py --keep_checkpoints    # every checkpoint kept (about 1.6 GB each), for curves

It runs the demo's Stage I config (``train_configs/demo/SmolLM2_135m_q2d_d2q.json``: SmolLM2-135M-Instruct, the
paper's reconstruction, alpha 0.2, lr 4e-5, 8 pairs of at most 64 tokens per step) on the train split of
:mod:`demo.package_data` for ``--steps`` steps (warm-up 15 %, as the paper's 300 of 2000), and evaluates, at step 0
and every 40 steps, 64 fixed pairs of the corpus's validation split (modules never trained on) in batches of 8: the
validation reconstruction loss, the anchor gain, the gain over the first 4 target tokens and the rank accuracy
among 8 anchors (:mod:`llm2vec.anchor_gain`). It checkpoints every 40 steps (the newest kept; every one with
``--keep_checkpoints``, for curves of any measure; a run with several kept goes on keeping them) and, started again
after an interruption, resumes from the newest complete checkpoint with the run's own ``--resume_from_checkpoint``,
on the inputs it started with (``cache/long-run/data/``): the corpus is not built again once they are written (a
resume, or a start again after a run cut before its first checkpoint), since the environment may have changed
since (a package installed: the build would change) and a resume refuses changed inputs.
Everything lives in ``cache/long-run/``; the measurements are in its ``stage_I/trainer_state.json`` (and in each
checkpoint's) and ``--table`` prints them.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo.package_data import build_package_dataset  # noqa: E402
from demo.settings import PACKAGE_DATA_DIR, SMOLLM2_DIR, STAGE_I_CONFIG, STAGE_I_SCRIPT, VALIDATION_SOURCE  # noqa: E402
from demo.smollm2 import materialise_smollm2  # noqa: E402
from demo.stages import (  # noqa: E402
    child_env,
    curve_from_log,
    curve_table,
    geometry_table,
    stage_command,
    stage_flags,
    write_train_file,
    write_validation_file,
)
from demo.stdlib_data import TRAIN_FILE  # noqa: E402
from llm2vec.run.folder import RunFolder  # noqa: E402

OUT = REPO / "cache" / "long-run"
EVERY = 40
EVAL_BATCH = 8


def write_inputs(data: Path, folder: Path) -> tuple[Path, Path]:
    """The train pairs with the query instruction, and the demo's 64 fixed validation pairs of the corpus's
    validation split (:mod:`demo.stages`), as JSON-lines files.

    A file whose bytes are already there is left as it is: a resume compares the data file's fingerprint (its
    modification time included) with the checkpoint's, and rewriting the same bytes would refuse every resume."""
    folder.mkdir(parents=True, exist_ok=True)
    names = tuple(p.name for p in input_files(folder))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        fresh = Path(tmp)
        write_train_file(data / TRAIN_FILE, fresh / names[0])
        write_validation_file(data / "val", fresh)
        for name in names:
            if not ((folder / name).is_file() and filecmp.cmp(fresh / name, folder / name, shallow=False)):
                os.replace(fresh / name, folder / name)
    return input_files(folder)


def input_files(folder: Path) -> tuple[Path, Path]:
    """Where :func:`write_inputs` puts the train pairs and the validation pairs."""
    return folder / "packages.jsonl", folder / f"{VALIDATION_SOURCE}.jsonl"


def newest_state(run: Path) -> Path | None:
    """The run's log: its final ``trainer_state.json``, else its newest checkpoint's (complete or not)."""
    checkpoints = RunFolder.inspect(run).checkpoints
    for state in (run / "trainer_state.json", *(c.path / "trainer_state.json" for c in reversed(checkpoints))):
        if state.is_file():
            return state
    return None


def config_batch() -> int:
    """The pairs per optimizer step of the Stage I config the run trains with (``total_batch_size``)."""
    return int(json.loads(STAGE_I_CONFIG.read_text(encoding="utf-8"))["total_batch_size"])


def table(rows: list[dict[str, float]], repeats: list[tuple[dict, dict]]) -> str:
    """The curve (:func:`demo.stages.curve_from_log` of the run's log) as Markdown, with a line per step evaluated
    again after a resume: the same numbers (the resume restored the model), or the measure that differs most."""
    lines = curve_table(rows)
    if rows:
        lines.append(f"\nrank accuracy at chance: {rows[0]['rank_chance']:.3f} (1 / {EVAL_BATCH})")
    if geometry := geometry_table(rows):
        lines += ["", "The anchors' geometry on the same pairs (queries against their documents):", "", *geometry]
    for first, again in repeats:
        said = f"step {first['step']} evaluated again when the run resumed from it:"
        if first == again:
            lines.append(f"\n{said} the same numbers")
        else:
            worst = max(first.keys() | again.keys(), key=lambda k: abs(first.get(k, 0) - again.get(k, 0)))
            lines.append(
                f"\n{said} DIFFERENT numbers ({worst} {first.get(worst)} -> {again.get(worst)}); "
                "the resume did not restore the model"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=640)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--seed", type=int, default=None, help="the run's seed (data order, dropout); default the config's"
    )
    parser.add_argument("--out", type=Path, default=None, help="the run's folder (default cache/long-run)")
    parser.add_argument("--table", action="store_true", help="print the measurements so far and exit")
    parser.add_argument(
        "--keep_checkpoints", action="store_true", help="keep every checkpoint (default: the newest only)"
    )
    parser.add_argument(
        "--accept_changed_inputs",
        action="store_true",
        help="resume although the checkpoint's record of its inputs differs (the run records what changed)",
    )
    args = parser.parse_args(argv)
    out = args.out or OUT
    run = out / "stage_I"
    if args.table:
        state = newest_state(run)
        if state is None:
            print(f"{run}: nothing logged yet")
        else:
            print(table(*curve_from_log(json.loads(state.read_text(encoding="utf-8"))["log_history"], config_batch())))
        return 0
    model = materialise_smollm2(SMOLLM2_DIR)
    checkpoints = RunFolder.inspect(run).checkpoints
    resume = bool(checkpoints)  # the run picks its newest complete one, or says why not
    keep = args.keep_checkpoints or len(checkpoints) > 1  # a resume never deletes the checkpoints a run kept
    train, validation = input_files(out / "data")
    if train.is_file() and validation.is_file():  # the run's inputs, also for a start after one cut before step 40
        print(f"[long-run] training on the inputs in {train.parent}", flush=True)
    else:
        build_package_dataset(PACKAGE_DATA_DIR)
        train, validation = write_inputs(PACKAGE_DATA_DIR, out / "data")
    save = {"save_strategy": "steps", "save_steps": EVERY} | ({} if keep else {"save_total_limit": 1})
    flags = stage_flags("I", model, train, run, args.steps, save, evaluation=(validation, EVERY, EVAL_BATCH))
    if args.seed is not None:
        flags["seed"] = args.seed
    if resume:
        flags["resume_from_checkpoint"] = "true"
        if args.accept_changed_inputs:
            flags["accept_changed_inputs"] = "true"
    command = stage_command(STAGE_I_SCRIPT, STAGE_I_CONFIG, flags)
    print("[long-run] " + " ".join(command), flush=True)
    # child_env: this checkout's llm2vec first on the path (not whichever checkout pip installed), offline
    return subprocess.call(command, env=child_env(args.threads), cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
