"""What the demo runs and where: the repository's paths, the two sizes, the retrieval task.

Every default path is resolved from this file's place in the repository (``experiments/demo/``), so the
demo runs the same from any working folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from . import package_data, smollm2, stdlib_data

REPO_ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO_ROOT / "experiments"
CONFIG_DIR = REPO_ROOT / "train_configs" / "demo"
STAGE_I_CONFIG = CONFIG_DIR / "SmolLM2_135m_q2d_d2q.json"
ANCHOR_CONFIG = CONFIG_DIR / "SmolLM2_135m_q2d_d2q_stage2.json"
BASELINE_CONFIG = CONFIG_DIR / "SmolLM2_135m_baseline_stage2.json"
STAGE_I_SCRIPT = EXPERIMENTS / "run_stage_I.py"
STAGE_II_SCRIPT = EXPERIMENTS / "run_stage_II.py"
EVAL_SCRIPT = EXPERIMENTS / "mteb_eval_custom.py"
SMOLLM2_SCRIPT = EXPERIMENTS / "demo" / "smollm2.py"
SMOLLM2_DIR = REPO_ROOT / smollm2.DEFAULT_TARGET  # the converted model, kept apart from the demo's runs
DATA_DIR = REPO_ROOT / stdlib_data.DEFAULT_OUT_DIR  # the full-size dataset; the smoke size keeps its own copy
PACKAGE_DATA_DIR = REPO_ROOT / package_data.DEFAULT_OUT_DIR  # the larger corpus of demo.scale and demo.long_run

TRAIN_SOURCE = "stdlib"  # the jsonl loader names a source by its file stem
TASK_NAME = "StdlibDocRetrieval"
INSTRUCTION = "Given the first sentence of a Python docstring, retrieve the documentation of that object"

DEFAULT_SEED = 42  # the first seed; --seeds N runs DEFAULT_SEED, DEFAULT_SEED + 1, ...
# how many seeds each --preset runs: the plain command fits the 40-minute bound on 2 CPU cores, "full" (the
# three seeds the evidence in docs/demo.md reports) does not (both measured: docs/demo.md)
PRESETS = {"default": 2, "full": 3}
DEFAULT_SEEDS = PRESETS["default"]

# the rows of the paper's Table 10, by the name of their evaluation step (eval_<row>)
TABLE_10_ROWS = {
    "untrained": "Untrained (no training)",
    "stage_I": "Stage I only",
    "baseline": "Stage II only (Baseline)",
    "anchor": "Stage I + II (Anchor)",
}


# Stage I's evaluation on the validation split's pairs (query, relevant document): at the start and every
# STAGE_I_EVAL["eval_steps"] steps, the validation reconstruction loss and the anchor's information gain
# (llm2vec.anchor_gain), logged into the run's trainer_state.json and shown per seed by the report
VALIDATION_SOURCE = "validation"  # the file stem, hence the source name, of the validation pairs
VALIDATION_PAIRS = 64  # a fixed random subset of the validation split's 204 pairs (a Stage I evaluation: ~20 s)
STAGE_I_EVAL = {"eval_steps": 5, "eval_on_start": True, "per_device_eval_batch_size": 16}
# Stage II's evaluation on the same pairs: validation InfoNCE and retrieval (nDCG@10 ...), drawn beside the loss
STAGE_II_EVAL = {"eval_steps": 10, "eval_on_start": True, "per_device_eval_batch_size": 32}

# warm-up as a share of the run, as in the paper's configs: 300 of 2000 Stage I steps, 300 of 1000 Stage II steps
WARMUP_SHARE = {"I": 0.15, "II": 0.3}


def warmup_steps(stage: str, steps: int) -> int:
    """The warm-up of a run of ``steps`` steps of Stage ``stage``, the paper's share (:data:`WARMUP_SHARE`)."""
    return round(WARMUP_SHARE[stage] * steps)


@dataclasses.dataclass(frozen=True)
class DemoSize:
    """How big a demo run is. ``None`` keeps the value of the ``train_configs/demo`` config."""

    name: str
    out_dir: str  # relative to the repository root
    tiny_model: bool  # a tiny random model instead of SmolLM2
    max_train: int | None = None  # train pairs kept from the dataset (None: all)
    max_eval_queries: int = 300
    stage_I_steps: int | None = None
    stage_II_steps: int | None = None
    stage_II_learning_rate: float | None = None  # both Stage II runs (the sweep of docs/results/demo_evidence.md)
    batch_size: int | None = None  # Stage I pairs / Stage II triples per step (both stages)
    max_seq_length: int | None = None
    eval_batch_size: int = 32

    def training_overrides(self, stage: str) -> dict[str, Any]:
        """The config fields this size changes for Stage ``stage`` ("I" or "II"): steps (warm-up follows),
        batch, length."""
        out: dict[str, Any] = {}
        steps = self.stage_I_steps if stage == "I" else self.stage_II_steps
        if steps is not None:
            out.update(max_steps=steps, warmup_steps=warmup_steps(stage, steps))
        if self.batch_size is not None:
            out.update(
                per_device_train_batch_size=self.batch_size,
                total_batch_size=self.batch_size,
                gradient_accumulation_steps=1,
            )
        if self.max_seq_length is not None:
            out["max_seq_length"] = self.max_seq_length
        if stage == "II" and self.stage_II_learning_rate is not None:
            out["learning_rate"] = self.stage_II_learning_rate
        return out


SIZES = {
    "default": DemoSize("default", "cache/demo-runs", tiny_model=False),
    "smoke": DemoSize(
        "smoke",
        "cache/demo-smoke",
        tiny_model=True,
        max_train=32,
        max_eval_queries=20,
        stage_I_steps=2,
        stage_II_steps=2,
        batch_size=4,
        max_seq_length=64,
        eval_batch_size=64,
    ),
}


def rel(path: str | Path) -> str:
    """``path`` relative to the repository root when inside it (commands and messages stay short)."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)
