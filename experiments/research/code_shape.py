"""Lines per layer of a checkout: the method, its training, the support around them, the drivers and the tests.

    python experiments/research/code_shape.py [CHECKOUT]      # default: this checkout

Counts every line (``wc -l``) of the Python files git tracks. The layers:

- method: the losses, the encoder, both stage models, the collator, packing, pooling, the prompt templates and
  the chunked steps (what the paper defines);
- training: the training driver, the Trainer subclass, schedule, distributed set-up, data loading and the
  sentence-transformers Stage II path;
- support: every other module of ``llm2vec/`` (run folder, evaluation, export, arguments, model card, I/O, ...);
- ``llm2vec/run/`` is also given alone (it is part of support).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

METHOD = (
    "llm2vec/loss/", "llm2vec/llm2vec.py", "llm2vec/encode_inputs.py", "llm2vec/llm2vec_q2d_d2q.py",
    "llm2vec/llm2vec_contrastive.py", "llm2vec/collator.py", "llm2vec/packing.py", "llm2vec/pooling.py",
    "llm2vec/templates.py", "llm2vec/chat_turn.py", "llm2vec/chunked_steps.py",
)  # fmt: skip
TRAINING = (
    "llm2vec/training.py", "llm2vec/trainer.py", "llm2vec/schedule.py", "llm2vec/distributed.py",
    "llm2vec/compat.py", "llm2vec/devices.py", "llm2vec/dataset/", "llm2vec/metrics_file.py",
    "llm2vec/st_training.py",
)  # fmt: skip


def layer(path: str) -> str:
    if path.startswith(METHOD):
        return "method"
    if path.startswith(TRAINING):
        return "training"
    return "support" if path.startswith("llm2vec/") else path.split("/")[0]


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[2])
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True, check=True)
    lines: dict[str, int] = {}
    for path in listed.stdout.split():
        n = len((root / path).read_text(encoding="utf-8").splitlines())
        lines[layer(path)] = lines.get(layer(path), 0) + n
        if path.startswith("llm2vec/run/"):
            lines["llm2vec/run/"] = lines.get("llm2vec/run/", 0) + n
    for name in ("method", "training", "support", "llm2vec/run/", "experiments", "tests"):
        print(f"{name:14} {lines.get(name, 0):6}")
    print(f"support / method {lines['support'] / lines['method']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
