"""Run the stage drivers one after another in this process, optionally stopping hard at a chosen point.

The kill-and-resume tests (tests/test_reliability.py) launch this alone or under torch.distributed.run:

    python tests/_drivers.py SPEC.json

SPEC is ``{"flag_dir": FOLDER, "runs": [{"stage": "I", "argv": [...], "pause": {"at": AT, "step": N}}, ...]}``.
Each run calls ``main(argv)`` of ``experiments/run_stage_<stage>.py``. With ``pause``, every process stops at
the chosen point, writes ``FOLDER/rank<r>.pid`` and sleeps; the test then SIGKILLs it, as a crash would:

- ``after_checkpoint``: checkpoint-N is complete and step N + 1 has been trained (not saved);
- ``during_save``: checkpoint-N is being written: its weights are on disk, its optimizer state is not.

The helpers the tests share to start runs live here too: :func:`tiny_run_flags` (the flags of a tiny CPU run),
:func:`launcher` (this interpreter, or ``torch.distributed.run`` over N local processes on a free port) and
:func:`subprocess_env` (offline, one thread per process, the checkout importable) , :func:`lock_held_elsewhere`
(another process holding a folder's run lock) and :func:`assert_same_weights` (two saved models, bit for bit).
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What every tiny CPU training run of the tests shares (tests/test_fsdp.py, test_stage_I.py, ...): the fixture data
# of llm2vec.testing.write_tiny_e5, no warm-up, batches of 4, a fixed seed, a loss line per step, no reporting.
TINY_RUN = {
    "e5_sources": '["nq","fever"]',
    "warmup_steps": 0,
    "per_device_train_batch_size": 4,
    "use_cpu": "true",
    "seed": 7,
    "logging_steps": 1,
    "report_to": "none",
    "dataloader_num_workers": 0,
}


def tiny_run_flags(model, data, out, **fields) -> list[str]:
    """``--field value`` flags of a tiny CPU run of ``model`` on the E5-layout folder ``data`` into ``out``:
    :data:`TINY_RUN` overridden by ``fields`` (a field given ``None`` is left out)."""
    args = {"model_name_or_path": model, "output_dir": out, "dataset_file_path": data, **TINY_RUN, **fields}
    return [item for key, value in args.items() if value is not None for item in (f"--{key}", str(value))]


def unfinished_copy(reference: Path, dest: Path) -> Path:
    """A finished 4-step run ``reference`` as a kill after checkpoint-4 would leave it: checkpoints 2 and 4 only."""
    import shutil

    dest.mkdir(parents=True)
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(reference / name, dest / name)
    return dest


def one_line(err: str, prefix: str = "error") -> str:
    """The one line of ``err`` holding ``<prefix>:``, with no traceback anywhere."""
    lines = [line for line in err.splitlines() if f"{prefix}:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def free_port() -> int:
    """A TCP port of this machine that nothing listens on now (for a torchrun rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(nproc: int = 1) -> list[str]:
    """The command prefix that starts a script: this interpreter alone, or torchrun over ``nproc`` local processes."""
    if nproc == 1:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
    ]


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a run the tests start: offline, one thread per process, the checkout importable."""
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return dict(
        os.environ,
        PYTHONPATH=pythonpath,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        **extra,
    )


def saved_weights(folder) -> dict:
    """The tensors a run saved in ``folder``: its adapter when it holds one, else its full model."""
    from safetensors.torch import load_file

    folder = Path(folder)
    name = "adapter_model.safetensors" if (folder / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(folder / name)


def assert_same_weights(folder, reference) -> None:
    """The models saved in ``folder`` and ``reference`` hold the same tensors, bit for bit."""
    import torch

    a, b = saved_weights(folder), saved_weights(reference)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max difference {(a[k] - b[k]).abs().max().item():.3g}"


@contextmanager
def lock_held_elsewhere(folder: Path) -> Iterator[int]:
    """Another process holds ``folder``'s run lock (:func:`llm2vec.run.lock.hold`) while the block runs; yields its
    pid. It is killed afterwards, as a crash would end it: its lock file stays behind, stale."""
    code = textwrap.dedent(
        f"""
        import time
        from llm2vec.run import lock
        with lock.hold({str(folder)!r}):
            print("locked", flush=True)
            time.sleep(120)
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def stop_here(flag_dir: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    tmp = Path(flag_dir) / f".rank{rank}.tmp"
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, Path(flag_dir) / f"rank{rank}.pid")
    time.sleep(300)  # the test kills this process long before; never resume on its own
    os._exit(3)


def install_pause(at: str, step: int, flag_dir: str) -> None:
    from transformers import TrainerCallback

    from llm2vec.trainer import LLM2VecTrainer

    if at == "after_checkpoint":

        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step + 1:
                    stop_here(flag_dir)

        init = LLM2VecTrainer.__init__

        def init_with_stop(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.add_callback(Stop())

        LLM2VecTrainer.__init__ = init_with_stop
    elif at == "during_save":
        save = LLM2VecTrainer._save_optimizer_and_scheduler

        def save_then_stop(self, output_dir):
            if self.state.global_step == step:
                stop_here(flag_dir)
            save(self, output_dir)

        LLM2VecTrainer._save_optimizer_and_scheduler = save_then_stop
    else:
        raise ValueError(f"pause at {at!r}: after_checkpoint or during_save")


def main(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    for run in spec["runs"]:
        if run.get("pause"):
            install_pause(run["pause"]["at"], run["pause"]["step"], spec["flag_dir"])
        driver = runpy.run_path(str(ROOT / "experiments" / f"run_stage_{run['stage']}.py"))
        code = driver["main"](run["argv"])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
