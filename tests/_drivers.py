"""Run the stage drivers one after another in this process, optionally stopping hard at a chosen point.

The kill-and-resume tests (tests/test_resume.py) launch this alone or under torch.distributed.run:

    python tests/_drivers.py SPEC.json

SPEC is ``{"flag_dir": FOLDER, "runs": [{"stage": "I", "argv": [...], "pause": {"at": AT, "step": N}}, ...]}``.
Each run calls ``main(argv)`` of ``experiments/run_stage_<stage>.py``. With ``pause``, every process stops at
the chosen point, writes ``FOLDER/rank<r>.pid`` and sleeps; the test then SIGKILLs it, as a crash would:

- ``after_checkpoint``: checkpoint-N is complete and step N + 1 has been trained (not saved);
- ``during_save``: checkpoint-N is being written: its weights are on disk, its optimizer state is not.

The helpers the tests share to start runs live here too: :func:`tiny_run_flags` (the flags of a tiny CPU run),
:func:`nq_run_flags` (those of the drivers' end-to-end runs on one source), :func:`eval_argv` (an evaluation's),
:func:`run_flags` and :func:`six_step_flags` (the two run lengths of the run-folder, checkpoint and resume tests),
:func:`launcher` (this interpreter, or ``torch.distributed.run`` over N local processes on a free port),
:func:`subprocess_env` (offline, one thread per process, the checkout importable), :func:`lock_held_elsewhere`
(another process holding a folder's run lock), :func:`assert_same_weights` (two saved models, bit for bit), the
file listings compared before and after a refusal (:func:`files`, :func:`tree`, :func:`snapshot`) and a BEIR-layout
retrieval folder (:func:`write_beir`, with :data:`DOCUMENTS` a small corpus of distinct subjects).
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
# of _tiny_data.write_tiny_e5, no warm-up, batches of 4, a fixed seed, a loss line per step, no reporting.
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


def as_flags(**fields) -> list[str]:
    """``--field value`` for each of ``fields`` in the order given; a field given ``None`` is left out."""
    return [item for key, value in fields.items() if value is not None for item in (f"--{key}", str(value))]


def tiny_run_flags(model, data, out, **fields) -> list[str]:
    """``--field value`` flags of a tiny CPU run of ``model`` on the E5-layout folder ``data`` into ``out``:
    :data:`TINY_RUN` overridden by ``fields`` (a field given ``None`` is left out)."""
    return as_flags(**{"model_name_or_path": model, "output_dir": out, "dataset_file_path": data, **TINY_RUN, **fields})


def nq_run_flags(data, max_seq_length, **fields) -> list[str]:
    """``--field value`` flags of a CPU run on the ``nq`` file of the E5-layout folder ``data``, texts cut at
    ``max_seq_length`` tokens, a loss line per step, then ``fields``; the caller adds the model and output folder."""
    common = {"e5_sources": '["nq"]', "use_cpu": "true", "max_seq_length": max_seq_length, "logging_steps": 1}
    return as_flags(**{"dataset_file_path": data, **common, **fields})


RESUME = ["--resume_from_checkpoint", "true"]
OVERWRITE = ["--overwrite_output_dir", "true"]


def run_flags(assets, out, stage="I", **fields) -> list[str]:
    """A 4-step run of ``assets`` (model folder, E5 data folder) into ``out``, saving checkpoints 2 and 4."""
    model, data = assets
    settings = dict(learning_rate=1e-3, max_steps=4, save_steps=2, num_threads=1, disable_tqdm="true")
    settings.update(max_seq_length=64)
    if stage == "II":
        settings.update(stage="II", lora_r=4, lora_alpha=8)
    settings.update(fields)
    return tiny_run_flags(model, data, out, **settings)


def quick(assets, out, stage="I", **fields) -> list[str]:
    """A 2-step run that saves no checkpoint."""
    return run_flags(assets, out, stage, max_steps=2, save_strategy="no", **fields)


def six_step_flags(assets, out, stage="I", **overrides) -> list[str]:
    """A 6-step run saving every 2 steps; Stage II has LoRA dropout (0.05), so its RNG state matters."""
    model, data = assets
    fields = {"learning_rate": 1e-3, "max_steps": 6, "save_steps": 2, "num_threads": 1, "disable_tqdm": "true"}
    if stage == "II":
        fields.update(stage="II", learning_rate=1e-2, lora_r=4, lora_alpha=8)
    return tiny_run_flags(model, data, out, **{"max_seq_length": 96, **fields, **overrides})


def export_argv(model, out, *extra) -> list[str]:
    """The flags of a quick sentence-transformers export of ``model`` into ``out`` (no embedding check)."""
    return [
        *("--base_model_name_or_path", str(model), "--output_dir", str(out)),
        *("--max_length", "64", "--query_instruction", "", "--no_verify_embeddings", *extra),
    ]


def eval_argv(model, data, out, *extra, instruction="") -> list[str]:
    """The flags of an evaluation of ``model`` into ``out`` on CPU with batches of 2, then ``extra``; with ``data``
    (a BEIR-layout folder; None: none), on that folder as a local retrieval task with ``instruction``."""
    local = ["--local_retrieval_dir", str(data), "--local_instruction", instruction] if data is not None else []
    device = ["--device", "cpu", "--batch_size", "2"]
    return ["--base_model_name_or_path", str(model), *local, "--output_dir", str(out), *device, *extra]


def files(folder) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for a folder): what a test compares before and after."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(Path(root).rglob("*"))}


def snapshot(folder) -> dict[str, tuple]:
    """Every file under ``folder`` (hidden ones too) with its size, modification time and SHA-256."""
    import hashlib

    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).digest())
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }


def marker(folder) -> dict:
    """The completion marker of a finished run in ``folder``."""
    from llm2vec.run.folder import COMPLETE_MARKER

    return json.loads((Path(folder) / COMPLETE_MARKER).read_text())


def write_beir(folder: Path, corpus, queries, qrels) -> Path:
    """corpus / queries: ``[(id, text)]``; qrels: ``[(query id, corpus id, score)]``, written as given."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = {
        "corpus.jsonl": [{"_id": i, "title": "", "text": t} for i, t in corpus],
        "queries.jsonl": [{"_id": i, "text": t} for i, t in queries],
        "qrels.jsonl": [{"query-id": q, "corpus-id": d, "score": s} for q, d, s in qrels],
    }
    for name, records in rows.items():
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


TEXTS = ["Return the length of a list.", "Open a file for reading.", "Sort items in place.", "Join path parts."]
GOOD = {
    "corpus": [(f"d{i}", t) for i, t in enumerate(TEXTS)],
    "queries": [(f"q{i}", t) for i, t in enumerate(TEXTS)],
    "qrels": [(f"q{i}", f"d{i}", 1) for i in range(len(TEXTS))],
}
# six one-line documents on distinct subjects: the corpus of the local retrieval tasks that evaluations score
DOCUMENTS = [
    "Return the number of items in a container.",
    "Open a file and read its lines.",
    "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings are vectors that capture meaning.",
    "Large language models are trained on text.",
]


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


def one_line_error(capsys) -> str:
    """The one ``error:`` line on stderr (progress bars of weight loading aside), with no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
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
