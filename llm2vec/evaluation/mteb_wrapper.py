"""An mteb 2.x encoder around :class:`llm2vec.LLM2Vec`, with the paper's instruction routing.

mteb calls ``encode(inputs, *, task_metadata, hf_split, hf_subset, prompt_type, **encode_kwargs)`` with a
``DataLoader`` of batched inputs (dicts with a ``text`` list). This wrapper turns every text into an
``[instruction, text]`` pair and embeds the pairs with :meth:`LLM2Vec.encode`, so the family's template
function (the one training used) builds the prompt and appends the anchor token.

Instruction routing (paper, Appendix / Table 13; the LLM2Vec convention):

- an input that mteb marks as a *document* (``prompt_type == PromptType.document``: the corpus of
  retrieval and reranking tasks) gets **no** instruction;
- every other input gets the task's instruction: retrieval/reranking queries (``prompt_type == query``)
  and both sides of symmetric tasks (STS, clustering, classification, pair classification,
  summarization, bitext mining), for which mteb passes ``prompt_type=None``.

The instruction is looked up by the task's mteb name (``task_metadata.name``) in a
``task_to_instructions.json`` mapping. A task that is not in the mapping is an error that names the file
and the task (:class:`MissingInstructionError`), unless ``allow_missing_instructions=True``, in which case
the task is encoded without an instruction and a warning is logged once per task.

Text that reaches the model is mteb's own ``text`` field: for a retrieval corpus entry mteb 2.x has
already joined title and body as ``f"{title} {text}".strip()`` (``mteb._create_dataloaders._corpus_to_dict``);
for the queries of instruction-retrieval tasks it has appended the per-query instruction to the text.

Several GPUs: :meth:`LLM2VecMTEBEncoder.from_pretrained` with ``devices="auto"`` loads one replica per
visible CUDA device. ``encode`` then sorts the inputs by length, cuts them into contiguous chunks, and
worker threads (one per replica) take chunks from a shared queue; embeddings are written back to the
input positions. Threads share the process, so nothing is pickled, and PyTorch releases the GIL inside
its kernels. On CPU or one GPU there is a single replica and the plain ``LLM2Vec.encode`` path.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta
from mteb.types import PromptType

from ..llm2vec import LLM2Vec, default_device, resolve_dtype

logger = logging.getLogger(__name__)

DEFAULT_INSTRUCTIONS_FILE = "test_configs/mteb/task_to_instructions.json"


class MissingInstructionError(KeyError):
    """A task has no entry in the instructions mapping."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class InstructionsFileError(ValueError):
    """The instructions file is missing or not a JSON object of strings."""


def load_instructions(path: str | os.PathLike) -> dict[str, str]:
    """Read a ``task name -> instruction`` JSON object; clear errors for a missing or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise InstructionsFileError(
            f"instructions file {str(path)!r} not found; pass --task_to_instructions_fp pointing to a JSON object "
            f"that maps mteb task names to instructions (this repository ships {DEFAULT_INSTRUCTIONS_FILE})"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise InstructionsFileError(f"instructions file {str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise InstructionsFileError(
            f"instructions file {str(path)!r} must be a JSON object mapping task names to instruction strings"
        )
    return data


def _is_document(prompt_type: PromptType | str | None) -> bool:
    return prompt_type is not None and PromptType(prompt_type) == PromptType.document


def batch_texts(batch: Mapping[str, Any]) -> list[str]:
    """The texts of one mteb batch: its ``text`` field (mteb has joined a corpus entry's title and body)."""
    if "text" not in batch:
        raise ValueError(f"mteb batch without a 'text' field (fields: {sorted(batch)}); only text tasks are supported")
    return [str(t) for t in batch["text"]]


def _short_hash(obj: Any, n: int = 10) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def _path_or_id(name: str | None) -> str | None:
    """A local path made absolute (so the same folder always gives the same identity); a hub id unchanged."""
    if name is None:
        return None
    return os.path.abspath(name) if os.path.exists(name) else name


def default_model_name(base_model_name_or_path: str, peft_model_name_or_path: str | None = None) -> str:
    """``org/model`` for mteb's results folder: a hub id as it is, a local folder as ``parent/folder``.

    The adapter names the model when there is one (the base is recorded in the revision and in
    ``model_meta.json``).
    """
    label = peft_model_name_or_path or base_model_name_or_path
    if os.path.exists(label):
        parts = Path(os.path.abspath(label)).parts
        label = "/".join(parts[-2:]) if len(parts) >= 2 else "local/" + parts[-1]
    elif "/" not in label:
        label = "local/" + label
    return label


class LLM2VecMTEBEncoder(AbsEncoder):
    """mteb encoder (``EncoderProtocol``) over one or more :class:`LLM2Vec` replicas.

    Args:
        model: an ``LLM2Vec``, or a list of replicas of it (one per device) for multi-GPU encoding.
        instructions: ``task name -> instruction``, or the path of such a JSON file.
        model_name: the ``org/model`` name of the results folder (default: from the model's config path).
        revision: the revision folder (default: a hash of the settings that change the embeddings).
        allow_missing_instructions: encode tasks absent from ``instructions`` without an instruction
            (a warning) instead of raising :class:`MissingInstructionError`.
        batch_size: default batch size when mteb's ``encode_kwargs`` give none.
        identity: what defines this model's embeddings (base, adapter, pooling, dtype, ...); hashed into
            the default revision and recorded in ``model_meta.json`` (ModelMeta ``loader_kwargs``).
        chunk_size: inputs per work item of the multi-replica path (default ``4 * batch_size``).
    """

    def __init__(
        self,
        model: LLM2Vec | Sequence[LLM2Vec],
        instructions: Mapping[str, str] | str | os.PathLike,
        *,
        model_name: str | None = None,
        revision: str | None = None,
        allow_missing_instructions: bool = False,
        batch_size: int = 32,
        identity: Mapping[str, Any] | None = None,
        chunk_size: int | None = None,
    ):
        replicas = list(model) if isinstance(model, (list, tuple)) else [model]
        if not replicas:
            raise ValueError("at least one LLM2Vec replica is needed")
        self.replicas: list[LLM2Vec] = replicas
        self.model = replicas[0]
        if isinstance(instructions, (str, os.PathLike)):
            self.instructions_source = str(instructions)
            self.instructions = load_instructions(instructions)
        else:
            self.instructions_source = "the instructions mapping given to LLM2VecMTEBEncoder"
            self.instructions = dict(instructions)
        self.allow_missing_instructions = allow_missing_instructions
        self.batch_size = int(batch_size)
        self.chunk_size = chunk_size
        self._warned: set[str] = set()

        settings = dict(identity or {})
        settings.setdefault("pooling_mode", self.model.pooling_mode)
        settings.setdefault("max_length", self.model.max_length)
        settings.setdefault("template", self.model.template.name)
        settings.setdefault("dtype", str(next(self.model.model.parameters()).dtype).replace("torch.", ""))
        self.identity = settings
        if model_name is None:
            base = settings.get("base_model_name_or_path")
            model_name = default_model_name(base, settings.get("peft_model_name_or_path")) if base else "local/llm2vec"
        if revision is None:
            revision = _short_hash(settings)
        body = self.model.model
        config = getattr(body, "config", None)
        self.mteb_model_meta = ModelMeta(
            loader=None,
            loader_kwargs=settings,
            name=model_name,
            revision=revision,
            release_date=None,
            languages=None,
            n_parameters=sum(p.numel() for p in body.parameters()),
            memory_usage_mb=None,
            max_tokens=self.model.max_length,
            embed_dim=getattr(config, "hidden_size", None),
            license=None,
            open_weights=True,
            public_training_code=None,
            public_training_data=None,
            framework=["PyTorch", "LLM2Vec"],
            similarity_fn_name="cosine",
            use_instructions=True,
            training_datasets=None,
        )

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        base_model_name_or_path: str,
        peft_model_name_or_path: str | None = None,
        *,
        instructions: Mapping[str, str] | str | os.PathLike,
        devices: str | Sequence[str | torch.device] | None = "auto",
        dtype: str | torch.dtype | None = "auto",
        pooling_mode: str | None = None,
        max_length: int | None = None,
        template: str | None = None,
        attn_implementation: str | None = None,
        model_name: str | None = None,
        revision: str | None = None,
        allow_missing_instructions: bool = False,
        batch_size: int = 32,
    ) -> "LLM2VecMTEBEncoder":
        """Load the model (LoRA adapter merged) and wrap it.

        ``devices``: ``"auto"`` = every visible CUDA device (one replica each), else the CPU; a single device
        string (``"cuda:1"``, ``"cpu"``); or a list of devices (one replica per entry).
        """
        device_list = resolve_devices(devices)
        torch_dtype = resolve_dtype(dtype, device_list[0])
        # several replicas: load once on the CPU, then copy to each device
        load_device = device_list[0] if len(device_list) == 1 else torch.device("cpu")
        first = LLM2Vec.from_pretrained(
            base_model_name_or_path,
            peft_model_name_or_path=peft_model_name_or_path,
            merge_peft=True,
            pooling_mode=pooling_mode,
            max_length=max_length,
            template=template,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            device=load_device,
        )
        replicas = [first] if len(device_list) == 1 else replicate(first, device_list)
        identity = {
            "base_model_name_or_path": _path_or_id(base_model_name_or_path),
            "peft_model_name_or_path": _path_or_id(peft_model_name_or_path),
            "pooling_mode": first.pooling_mode,
            "max_length": first.max_length,
            "template": first.template.name,
            "dtype": str(torch_dtype).replace("torch.", ""),
        }
        return cls(replicas, instructions, model_name=model_name, revision=revision,
                   allow_missing_instructions=allow_missing_instructions, batch_size=batch_size, identity=identity)

    # ------------------------------------------------------------------ instructions

    def add_instruction(self, task_name: str, instruction: str) -> None:
        """Register (or replace) the instruction of one task, e.g. a local task absent from the file."""
        self.instructions[task_name] = instruction

    def missing_instructions(self, task_names: Iterable[str]) -> list[str]:
        return [name for name in task_names if name not in self.instructions]

    def task_instruction(self, task_name: str) -> str:
        if task_name in self.instructions:
            return self.instructions[task_name]
        if self.allow_missing_instructions:
            if task_name not in self._warned:
                logger.warning("task %r has no instruction in %s; encoding it without one", task_name,
                               self.instructions_source)
                self._warned.add(task_name)
            return ""
        raise MissingInstructionError(
            f"task {task_name!r} has no instruction in {self.instructions_source}; add it there "
            "(or pass allow_missing_instructions=True / --allow-missing-instructions to encode it without one)"
        )

    def instruction_for(self, task_metadata, prompt_type: PromptType | str | None) -> str:
        """The routing rule: documents get no instruction, everything else the task's instruction."""
        if _is_document(prompt_type):
            return ""
        return self.task_instruction(task_metadata.name)

    # ------------------------------------------------------------------ encoding

    def encode(
        self,
        inputs,
        *,
        task_metadata,
        hf_split: str,
        hf_subset: str,
        prompt_type: PromptType | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        """Embed every text of ``inputs`` (a DataLoader of mteb batches) as float32, in input order."""
        instruction = self.instruction_for(task_metadata, prompt_type)
        texts = [text for batch in inputs for text in batch_texts(batch)]
        items = [[instruction, text] for text in texts]
        batch_size = int(kwargs.get("batch_size") or self.batch_size)
        show = bool(kwargs.get("show_progress_bar", True))
        return self.encode_items(items, batch_size=batch_size, show_progress_bar=show)

    def encode_items(self, items: Sequence[Sequence[str]], batch_size: int | None = None,
                     show_progress_bar: bool = True) -> np.ndarray:
        """Embed ``[instruction, text]`` pairs (float32 numpy, input order) on one or all replicas."""
        batch_size = int(batch_size or self.batch_size)
        if len(self.replicas) == 1 or len(items) <= batch_size:
            out = self.model.encode(list(items), batch_size=batch_size, show_progress_bar=show_progress_bar,
                                    convert_to_numpy=True)
            return np.asarray(out, dtype=np.float32)
        return self._encode_parallel(items, batch_size, show_progress_bar)

    def _encode_parallel(self, items: Sequence[Sequence[str]], batch_size: int, show_progress_bar: bool) -> np.ndarray:
        # longest first (by characters: cheap, and LLM2Vec.encode re-sorts each chunk by tokens), in contiguous
        # chunks that idle replicas pull from a queue, so long and short chunks balance out across devices
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]) - len(items[i][1]))
        chunk = int(self.chunk_size or 4 * batch_size)
        work: queue.Queue = queue.Queue()
        for start in range(0, len(order), chunk):
            work.put(order[start : start + chunk])
        hidden = self.mteb_model_meta.embed_dim
        out = np.zeros((len(items), hidden), dtype=np.float32)
        errors: list[BaseException] = []
        bar = tqdm(total=len(items), desc=f"Encoding on {len(self.replicas)} devices", disable=not show_progress_bar)
        lock = threading.Lock()

        def worker(replica: LLM2Vec) -> None:
            device = replica.device
            guard = torch.cuda.device(device) if device.type == "cuda" else _NullContext()
            with guard:
                while not errors:
                    try:
                        indices = work.get_nowait()
                    except queue.Empty:
                        return
                    try:
                        emb = replica.encode([items[i] for i in indices], batch_size=batch_size,
                                             show_progress_bar=False, convert_to_numpy=True)
                    except BaseException as e:  # noqa: BLE001 -- re-raised in the calling thread
                        errors.append(e)
                        return
                    out[indices] = emb
                    with lock:
                        bar.update(len(indices))

        threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bar.close()
        if errors:
            raise errors[0]
        return out


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def resolve_devices(devices: str | torch.device | Sequence[str | torch.device] | None) -> list[torch.device]:
    """``"auto"``/None: every visible CUDA device, else ``[cpu]``; a string or device: that one; a list: those."""
    if devices is None or devices == "auto":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device(f"cuda:{i}") for i in range(n)] if n else [default_device()]
    if isinstance(devices, (str, torch.device)):
        return [torch.device(devices)]
    device_list = [torch.device(d) for d in devices]
    if not device_list:
        raise ValueError("devices: empty list")
    return device_list


def replicate(model: LLM2Vec, devices: Sequence[torch.device]) -> list[LLM2Vec]:
    """One copy of ``model`` on each device (the original object becomes the last replica)."""
    replicas = [copy.deepcopy(model).to(d) for d in devices[:-1]]
    replicas.append(model.to(devices[-1]))
    for r in replicas:
        r.eval()
    return replicas


# ====================================================================================================
# Command line: experiments/mteb_eval_custom.py is a thin shell around main()
# ====================================================================================================

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TASKS_FILE = REPO_ROOT / "test_configs" / "mteb" / "tasks.json"
FULL_SET = "mteb56"


class UsageError(ValueError):
    """Bad command-line input; the message names the field or file and what to do."""


def task_sets(tasks_fp: str | os.PathLike = DEFAULT_TASKS_FILE) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """Named task lists from ``tasks.json`` (``mteb56``: all tasks; ``subset<N>``: its ``subsets[N]``) and
    the per-task entries (split, hf_subset, subtasks)."""
    path = Path(tasks_fp)
    if not path.is_file():
        raise UsageError(f"tasks file {str(path)!r} not found (--tasks_fp); it defines --task_set and each task's split")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        entries = dict(config["tasks"])
        sets = {FULL_SET: list(entries)}
        for key, subset in config.get("subsets", {}).items():
            sets[key if key.startswith("subset") else f"subset{key}"] = list(subset["tasks"])
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"tasks file {str(path)!r} is malformed ({type(e).__name__}: {e}); expected "
                         '{"tasks": {name: {...}}, "subsets": {"15": {"tasks": [...]}}}') from None
    return sets, entries


def expand_task_names(names: Sequence[str], entries: Mapping[str, dict]) -> list[str]:
    """Split comma-separated names; a task with ``subtasks`` in tasks.json (CQADupstackRetrieval) becomes them."""
    out: list[str] = []
    for raw in names:
        for name in (n.strip() for n in raw.split(",")):
            if not name:
                continue
            for sub in entries.get(name, {}).get("subtasks", [name]):
                if sub not in out:
                    out.append(sub)
    return out


def get_mteb_tasks(names: Sequence[str], entries: Mapping[str, dict]) -> list:
    """mteb task objects, restricted to the split and hf_subset that tasks.json gives (the paper's English
    subsets of multilingual tasks); a task tasks.json does not list keeps mteb's own splits and subsets."""
    import mteb

    tasks = []
    for name in names:
        try:
            task = mteb.get_task(name)
        except KeyError as e:
            hint = str(e).strip("\"'").removeprefix("KeyError: ")
            raise UsageError(
                f"--task_name {name!r}: not an mteb {mteb.__version__} task ({hint}); use mteb 2.x task names "
                "as in test_configs/mteb/tasks.json, or --task_set mteb56 / subset15"
            ) from None
        parent = next((p for p, e in entries.items() if name in e.get("subtasks", ())), None)
        entry = entries.get(name) or entries.get(parent) or {}
        if "hf_subset" in entry and entry["hf_subset"] in task.hf_subsets:
            task = task.filter_languages(None, hf_subsets=[entry["hf_subset"]])
        if "split" in entry:
            task = task.filter_eval_splits([entry["split"]])
        tasks.append(task)
    return tasks


def build_arg_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="mteb_eval_custom.py",
        description="Evaluate an LLM2Vec / Anchor Embedding model on MTEB tasks (mteb 2.x) with per-task instructions.",
    )
    p.add_argument("--base_model_name_or_path", required=True, help="base model (hub id or folder)")
    p.add_argument("--peft_model_name_or_path", default=None, help="LoRA adapter folder (merged before encoding)")
    p.add_argument("--task_name", nargs="+", default=[], help="mteb task name(s); several names or comma-separated")
    p.add_argument("--task_set", default=None, help="a named task list of --tasks_fp: mteb56 (all 56) or subset15 (Table 8)")
    p.add_argument("--tasks_fp", default=str(DEFAULT_TASKS_FILE), help="tasks.json: task sets, split and subset per task")
    p.add_argument("--task_to_instructions_fp", default=str(REPO_ROOT / DEFAULT_INSTRUCTIONS_FILE),
                   help="JSON object: mteb task name -> instruction")
    p.add_argument("--allow-missing-instructions", "--allow_missing_instructions", dest="allow_missing_instructions",
                   action="store_true", help="encode tasks absent from the instructions file without instruction (warns)")
    p.add_argument("--local_retrieval_dir", default=None,
                   help="a BEIR-style folder (corpus.jsonl, queries.jsonl, qrels.jsonl) to evaluate as a retrieval task")
    p.add_argument("--local_task_name", default="StdlibDocRetrieval", help="task name of --local_retrieval_dir")
    p.add_argument("--local_instruction", default=None,
                   help="query instruction of the local task (default: its entry in the instructions file)")
    p.add_argument("--output_dir", default="mteb_results",
                   help="mteb result cache; results go to <output_dir>/results/<model>/<revision>/<Task>.json")
    p.add_argument("--overwrite", action="store_true", help="recompute tasks whose results already exist")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU that has it, else fp32), bfloat16, float16, float32")
    p.add_argument("--max_length", type=int, default=None, help="tokens per input (default: the model's config, else 512)")
    p.add_argument("--pooling_mode", default=None, help="eos_token (the paper's), last_token, mean, weighted_mean")
    p.add_argument("--template", default=None, help="prompt template name (default: detected from the model)")
    p.add_argument("--attn_implementation", default=None, help="e.g. flash_attention_2, sdpa")
    p.add_argument("--device", default="auto",
                   help="auto (all visible GPUs, one replica each, else CPU), a device (cuda:1, cpu) or a comma-separated list")
    p.add_argument("--model_name", default=None, help="org/name of the results folder (default: from the model path)")
    p.add_argument("--revision", default=None, help="revision folder (default: a hash of the model settings)")
    return p


def run(args) -> int:
    """Check the inputs (before loading the model), evaluate, print main scores. Returns the exit code."""
    import mteb

    from .local_task import local_retrieval_task

    if args.batch_size < 1:
        raise UsageError(f"--batch_size must be >= 1, got {args.batch_size}")
    try:
        instructions = load_instructions(args.task_to_instructions_fp)
    except InstructionsFileError as e:
        raise UsageError(str(e)) from None
    sets, entries = task_sets(args.tasks_fp)
    names = list(args.task_name)
    if args.task_set is not None:
        if args.task_set not in sets:
            raise UsageError(f"--task_set {args.task_set!r}: unknown; choose one of {sorted(sets)} (from {args.tasks_fp})")
        names += sets[args.task_set]
    names = expand_task_names(names, entries)
    if not names and args.local_retrieval_dir is None:
        raise UsageError("no task: give --task_name, --task_set or --local_retrieval_dir")
    tasks = get_mteb_tasks(names, entries)

    if args.local_retrieval_dir is not None:
        try:
            local = local_retrieval_task(args.local_retrieval_dir, name=args.local_task_name)
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(f"--local_retrieval_dir: {e}") from None
        local.instruction = args.local_instruction if args.local_instruction is not None else instructions.get(local.metadata.name)
        if local.instruction is not None:
            instructions[local.metadata.name] = local.instruction
        tasks.append(local)

    missing = [t.metadata.name for t in tasks if t.metadata.name not in instructions]
    if missing and not args.allow_missing_instructions:
        raise UsageError(
            f"no instruction for {missing} in {args.task_to_instructions_fp}; add them there"
            + (" (or give --local_instruction)" if args.local_retrieval_dir else "")
            + ", or pass --allow-missing-instructions to encode them without one"
        )
    try:
        devices = [d.strip() for d in args.device.split(",")] if "," in args.device else args.device
        device_list = resolve_devices(devices)
    except RuntimeError as e:
        raise UsageError(f"--device {args.device!r}: {e}") from None
    if any(d.type == "cuda" for d in device_list) and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device!r}: no CUDA device is visible; use --device cpu or auto")

    encoder = LLM2VecMTEBEncoder.from_pretrained(
        args.base_model_name_or_path,
        args.peft_model_name_or_path,
        instructions=instructions,
        devices=devices,
        dtype=args.dtype,
        pooling_mode=args.pooling_mode,
        max_length=args.max_length,
        template=args.template,
        attn_implementation=args.attn_implementation,
        model_name=args.model_name,
        revision=args.revision,
        allow_missing_instructions=args.allow_missing_instructions,
        batch_size=args.batch_size,
    )
    encoder.instructions_source = args.task_to_instructions_fp
    results = evaluate(encoder, tasks, args.output_dir, overwrite=args.overwrite, batch_size=args.batch_size)
    meta = encoder.mteb_model_meta
    folder = Path(args.output_dir) / "results" / meta.model_name_as_path() / meta.revision
    for tr in results.task_results:
        print(f"{tr.task_name}\t{tr.get_score():.4f}")
    for err in results.exceptions:
        print(f"FAILED {err.task_name}: {err.exception}")
    print(f"results: {folder}")
    return 1 if results.exceptions else 0


def evaluate(encoder: LLM2VecMTEBEncoder, tasks, output_dir: str | os.PathLike, *, overwrite: bool = False,
             batch_size: int | None = None, show_progress_bar: bool = True, raise_error: bool = False):
    """``mteb.evaluate`` with the results cache in ``output_dir``: existing task results are loaded, not
    recomputed (mteb's ``only-missing``), unless ``overwrite`` (mteb's ``always``)."""
    import mteb

    return mteb.evaluate(
        encoder,
        tasks,
        cache=mteb.ResultCache(cache_path=output_dir),
        overwrite_strategy="always" if overwrite else "only-missing",
        encode_kwargs={"batch_size": int(batch_size or encoder.batch_size), "show_progress_bar": show_progress_bar},
        co2_tracker=False,
        raise_error=raise_error,
        show_progress_bar=show_progress_bar,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (UsageError, MissingInstructionError) as e:
        import sys

        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
