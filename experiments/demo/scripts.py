"""The repository's scripts as the demo runs them: their command lines, and reading what they wrote.

The demo runs ``experiments/run_stage_I.py``, ``experiments/run_stage_II.py`` (``SCRIPT CONFIG.json --field
value ...``) and ``experiments/mteb_eval_custom.py`` exactly as a user would, so it exercises their command
lines too. On a CUDA machine the training runs in bf16 where the GPU supports it, and with more than one GPU
it is launched with ``torchrun`` (the per-device batch is the config's batch divided by the number of GPUs
when it divides, so the global batch stays the same); evaluation uses every visible GPU.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from .settings import EVAL_SCRIPT, INSTRUCTION, TASK_NAME, rel
from .steps import DemoError


@dataclasses.dataclass(frozen=True)
class Hardware:
    gpus: int
    bf16: bool
    threads: int | None = None  # CPU threads of every command (None: torch's default in each)

    @classmethod
    def detect(cls, threads: int | None = None) -> Hardware:
        import torch

        threads = threads or torch.get_num_threads()
        if not torch.cuda.is_available():
            return cls(gpus=0, bf16=False, threads=threads)
        return cls(gpus=torch.cuda.device_count(), bf16=bool(torch.cuda.is_bf16_supported()), threads=threads)

    def describe(self) -> str:
        if not self.gpus:
            return f"CPU ({self.threads} threads), float32"
        return f"{self.gpus} CUDA GPU(s), {'bf16' if self.bf16 else 'float32'}"


def training_command(script: Path, config: Path, overrides: dict[str, Any], hardware: Hardware) -> list[str]:
    """The driver command: ``python script config --field value ...`` (``torchrun`` on several GPUs).

    Only the fields whose wanted value differs from the config's are passed as flags.
    """
    cfg = json.loads(Path(config).read_text())
    wanted = dict(overrides)
    launcher = [sys.executable]
    if hardware.gpus:
        if hardware.bf16:
            wanted["bf16"] = True
        batch = int(wanted.get("per_device_train_batch_size", cfg["per_device_train_batch_size"]))
        total = int(wanted.get("total_batch_size", cfg.get("total_batch_size") or batch))
        if hardware.gpus > 1 and total % hardware.gpus == 0:
            launcher = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={hardware.gpus}",
            ]
            wanted["per_device_train_batch_size"] = total // hardware.gpus
            wanted["total_batch_size"] = total
    flags: list[str] = []
    for field, value in wanted.items():
        if field in cfg and cfg[field] == value:
            continue
        flags += [f"--{field}", value if isinstance(value, str) else json.dumps(value)]
    return [*launcher, rel(script), rel(config), *flags]


def training_summary(folder: Path) -> dict[str, Any]:
    """Steps and final loss of a finished training run, from the ``trainer_state.json`` the drivers save."""
    state = folder / "trainer_state.json"
    if not state.is_file():
        raise DemoError(f"{folder}: no trainer_state.json; the training run did not finish")
    history = json.loads(state.read_text())["log_history"]
    losses = [h for h in history if "loss" in h and "step" in h]
    return {"steps": max((h["step"] for h in losses), default=0), "final_loss": losses[-1]["loss"] if losses else None}


def eval_command(
    base: Path,
    adapter: Path | None,
    eval_dir: Path,
    output_dir: Path,
    model_name: str,
    batch_size: int,
    max_length: int,
) -> list[str]:
    """``mteb_eval_custom.py`` on the local retrieval task in ``eval_dir``, the query instruction on queries."""
    cmd = [sys.executable, rel(EVAL_SCRIPT), "--base_model_name_or_path", rel(base)]
    if adapter is not None:
        cmd += ["--peft_model_name_or_path", rel(adapter)]
    return cmd + [
        "--local_retrieval_dir",
        rel(eval_dir),
        "--local_task_name",
        TASK_NAME,
        "--local_instruction",
        INSTRUCTION,
        "--output_dir",
        rel(output_dir),
        "--batch_size",
        str(batch_size),
        "--max_length",
        str(max_length),
        "--model_name",
        model_name,
        "--revision",
        "demo",
    ]


def read_scores(results_dir: Path) -> dict[str, float]:
    """The retrieval metrics of the local task from an mteb results folder (the test split, default subset)."""
    found = sorted(Path(results_dir).rglob(f"{TASK_NAME}.json"))
    if not found:
        raise DemoError(f"no {TASK_NAME}.json under {results_dir}")
    data = json.loads(found[-1].read_text())
    split = data["scores"]["test"]
    entry = next((s for s in split if s.get("hf_subset") == "default"), split[0])
    return {k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
