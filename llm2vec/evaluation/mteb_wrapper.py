"""An mteb 2.x encoder around :class:`llm2vec.LLM2Vec`, with the paper's instruction routing."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ModelMeta, ScoringFunction
from mteb.types import PromptType

from ..devices import resolve_dtype
from ..fingerprints import model_content
from ..io import short_hash
from ..keywords import strict_booleans
from ..llm2vec import LLM2Vec, read_llm2vec_config
from .paths import check_name, model_folder_name, read_input_json, results_folder
from .replicas import encode_on_replicas, replicate, resolve_devices
from .result_keys import computed_from, why_not_reused, write_record

logger = logging.getLogger(__name__)


class MissingInstructionError(LookupError):
    """A task has no entry in the instructions mapping and no instruction of its own."""


class InstructionsFileError(ValueError):
    """The instructions file is missing or not a JSON object of strings."""


def load_instructions(path: str | os.PathLike) -> dict[str, str]:
    """Read a ``task name -> instruction`` JSON object (strictly: :func:`~llm2vec.evaluation.paths.read_input_json`)."""
    holds = "it must be a JSON object that maps mteb task names to instructions"
    data = read_input_json(path, "instructions file", holds, InstructionsFileError)
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise InstructionsFileError(
            f"instructions file {str(path)!r} must be a JSON object mapping task names to instruction strings"
        )
    return data


def task_own_instruction(task_metadata) -> str | None:
    """The instruction a task carries itself: its metadata's ``prompt`` string or ``"query"`` entry; else None."""
    prompt = getattr(task_metadata, "prompt", None)
    if isinstance(prompt, Mapping):
        prompt = prompt.get(PromptType.query.value)
    return prompt.strip() if isinstance(prompt, str) else None


def path_or_id(name: str | os.PathLike | None) -> str | None:
    """A local path made absolute (so the same folder always gives the same identity); a hub id unchanged."""
    if name is None:
        return None
    return os.path.abspath(name) if os.path.exists(name) else os.fspath(name)


def default_model_name(base_model_name_or_path: str, peft_model_name_or_path: str | None = None) -> str:
    """``org/model`` for mteb's results folder (the adapter's if any): a hub id as it is, a folder ``parent/folder``."""
    label = peft_model_name_or_path or base_model_name_or_path
    if os.path.exists(label):
        parts = Path(os.path.abspath(label)).parts
        label = "/".join(parts[-2:]) if len(parts) >= 2 else "local/" + parts[-1]
    elif "/" not in label:
        label = "local/" + label
    return label


def model_meta(**fields: Any) -> ModelMeta:
    """mteb's ``ModelMeta`` of an :class:`LLM2VecMTEBEncoder` (loaded by :func:`load_encoder`) with ``fields``."""
    shared = dict(
        loader=load_encoder,
        open_weights=True,
        framework=["PyTorch", "LLM2Vec"],
        similarity_fn_name=ScoringFunction.COSINE,
        use_instructions=True,
    )
    return ModelMeta.create_empty(overwrites={**shared, **fields})


class LLM2VecMTEBEncoder(AbsEncoder):
    """mteb encoder over one :class:`LLM2Vec` or a list of replicas (one per device); ``instructions``: ``task name ->
    instruction`` or such a JSON file; ``model_name``, ``revision``: the results folders (default: from the model's
    path; a hash of ``identity``, what defines the embeddings); ``allow_missing_instructions``: encode a task with
    no instruction without one instead of raising; ``chunk_size``: inputs per work item (``4 * batch_size``)."""

    @strict_booleans
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
            loadable_instructions: str | dict[str, str] = os.path.abspath(instructions)
        else:
            self.instructions_source = "the instructions mapping given to LLM2VecMTEBEncoder"
            self.instructions = dict(instructions)
            loadable_instructions = dict(self.instructions)
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
        base, peft = settings.get("base_model_name_or_path"), settings.get("peft_model_name_or_path")
        # None: a model in memory, known by no folder; its stored results are never served again
        self.model_files = {"base": model_content(base), "adapter": model_content(peft)} if base else None
        if model_name is None:
            model_name = default_model_name(base, peft) if base else "local/llm2vec"
        revision = revision if revision is not None else short_hash(settings, n=10)
        model_folder_name(model_name, "model_name")  # both become folder names of the results cache
        check_name(revision, "revision")
        body = self.model.model
        config = getattr(body, "config", None)
        self.mteb_model_meta = model_meta(
            loader_kwargs={**settings, "instructions": loadable_instructions},
            name=model_name,
            revision=revision,
            n_parameters=sum(p.numel() for p in body.parameters()),
            max_tokens=self.model.max_length,
            embed_dim=getattr(config, "hidden_size", None),
        )

    @classmethod
    @strict_booleans
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
        doc_max_length: int | None = None,
        model_name: str | None = None,
        revision: str | None = None,
        allow_missing_instructions: bool = False,
        batch_size: int = 32,
        trust_remote_code: bool = False,
        accept_other_base: bool = False,
    ) -> LLM2VecMTEBEncoder:
        """Load the model (adapter merged; :meth:`LLM2Vec.from_pretrained`) on ``devices`` (one replica each;
        :func:`~llm2vec.evaluation.replicas.resolve_devices`) and wrap it; ``doc_max_length`` enters the identity
        only when set."""
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
            doc_max_length=doc_max_length,
            device=load_device,
            trust_remote_code=trust_remote_code,
            accept_other_base=accept_other_base,
        )
        replicas = [first] if len(device_list) == 1 else replicate(first, device_list)
        identity = {  # pooling_mode, max_length and template: the loaded model's (__init__)
            "base_model_name_or_path": path_or_id(base_model_name_or_path),
            "peft_model_name_or_path": path_or_id(peft_model_name_or_path),
            "dtype": str(torch_dtype).replace("torch.", ""),
        }
        if doc_max_length is not None:  # absent when unset, so earlier result folders keep their revision
            identity["doc_max_length"] = int(doc_max_length)
        return cls(
            replicas,
            instructions,
            model_name=model_name,
            revision=revision,
            allow_missing_instructions=allow_missing_instructions,
            batch_size=batch_size,
            identity=identity,
        )

    def add_instruction(self, task_name: str, instruction: str) -> None:
        """Register (or replace) the instruction of one task."""
        self.instructions[task_name] = instruction

    def resolve_instruction(self, task_name: str, task_metadata=None) -> str | None:
        """What :meth:`task_instruction` gives, without its log lines; None where it raises."""
        if task_name in self.instructions:
            return self.instructions[task_name]
        own = task_own_instruction(task_metadata)
        return own if own is not None else "" if self.allow_missing_instructions else None

    def task_instruction(self, task_name: str, task_metadata=None) -> str:
        """The instruction of a task's queries (both sides of a symmetric task): the mapping's entry, else the
        task's own (:func:`task_own_instruction`), else :class:`MissingInstructionError`."""
        instruction = self.resolve_instruction(task_name, task_metadata)
        if instruction is not None and task_name not in self.instructions and task_name not in self._warned:
            self._warned.add(task_name)
            if task_own_instruction(task_metadata) is not None:
                logger.info(
                    "task %r: not in %s; using its own instruction %r", task_name, self.instructions_source, instruction
                )
            else:
                logger.warning(
                    "task %r has no instruction in %s; encoding it without one", task_name, self.instructions_source
                )
        if instruction is not None:
            return instruction
        raise MissingInstructionError(
            f"task {task_name!r} has no instruction in {self.instructions_source} and none of its own (its "
            f"metadata's query prompt); add it there, pass instructions={{{task_name!r}: '<instruction>'}} (to "
            "LLM2VecMTEBEncoder, or to mteb.get_model), call add_instruction, give a local task "
            "instruction=..., or set allow_missing_instructions=True to encode it without one"
        )

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
        """Embed every text of ``inputs`` (a DataLoader of mteb batches) as float32, in input order; documents get
        no instruction, everything else the task's (the paper's routing)."""
        document = prompt_type is not None and PromptType(prompt_type) == PromptType.document
        instruction = "" if document else self.task_instruction(task_metadata.name, task_metadata)
        items = []
        for batch in inputs:  # mteb has joined a corpus entry's title and body into its text
            if "text" not in batch:
                fields = sorted(batch)
                raise ValueError(f"mteb batch without a 'text' field (fields: {fields}); only text tasks are supported")
            items += [[instruction, str(text)] for text in batch["text"]]
        batch_size = int(kwargs.get("batch_size") or self.batch_size)
        show = bool(kwargs.get("show_progress_bar", True))
        return self.encode_items(items, batch_size=batch_size, show_progress_bar=show)

    @strict_booleans
    def encode_items(
        self, items: Sequence[Sequence[str]], batch_size: int | None = None, show_progress_bar: bool = True
    ) -> np.ndarray:
        """Embed ``[instruction, text]`` pairs (float32 numpy, input order) on one or all replicas."""
        batch_size = int(batch_size or self.batch_size)
        if len(self.replicas) == 1 or len(items) <= batch_size:
            out = self.model.encode(
                list(items), batch_size=batch_size, show_progress_bar=show_progress_bar, convert_to_numpy=True
            )
            return np.asarray(out, dtype=np.float32)
        return encode_on_replicas(
            self.replicas, items, batch_size=batch_size, chunk_size=self.chunk_size, show_progress_bar=show_progress_bar
        )

    def results_folder(self, output_dir: str | os.PathLike) -> Path:
        """Where :func:`evaluate` with ``output_dir`` writes this model's ``<Task>.json`` files."""
        meta = self.mteb_model_meta
        return results_folder(output_dir, meta.name, meta.revision)


def load_encoder(
    model_name: str, revision: str | None = None, device: str | None = None, **kwargs: Any
) -> LLM2VecMTEBEncoder:
    """mteb's loader: the encoder of ``base_model_name_or_path`` (default ``model_name``) and
    ``peft_model_name_or_path``; ``instructions`` default to the task prompts of its ``llm2vec_config.json``."""
    base = kwargs.pop("base_model_name_or_path", None) or model_name
    peft = kwargs.pop("peft_model_name_or_path", None)
    instructions = kwargs.pop("instructions", None)
    if instructions is None:
        instructions = {**prompt_instructions(base), **prompt_instructions(peft)}
    devices = kwargs.pop("devices", "auto") if device is None else device
    kwargs.pop("devices", None)
    return LLM2VecMTEBEncoder.from_pretrained(
        base, peft, instructions=instructions, devices=devices, model_name=model_name, revision=revision, **kwargs
    )


def prompt_instructions(folder: str | None) -> dict[str, str]:
    """``task -> instruction`` of the task prompts (not ``document``, ``query``, ``<task>-document``) of a folder."""
    prompts = read_llm2vec_config(folder).get("prompts") or {}
    return {k: v for k, v in prompts.items() if k not in ("document", "query") and not k.endswith("-document")}


@strict_booleans
def evaluate(
    encoder: LLM2VecMTEBEncoder,
    tasks: Sequence,
    output_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    batch_size: int | None = None,
    show_progress_bar: bool = True,
    raise_error: bool = False,
):
    """``mteb.evaluate`` of each task with the results cache in ``output_dir``: a stored result is served only when
    it records the key of what would be computed now (:mod:`llm2vec.evaluation.result_keys`), else computed again
    with a warning saying why. Returns mteb's ``ModelResult`` (``task_results`` in the order of ``tasks``)."""
    import mteb
    from mteb.results import ModelResult
    from mteb.results.task_result import TaskError

    cache = mteb.ResultCache(cache_path=output_dir)
    batch_size = int(batch_size or encoder.batch_size)
    meta = encoder.mteb_model_meta
    task_results, exceptions = [], []
    for task in tasks:
        # an aggregate task (its score the mean of its sub-tasks') is served only when its sub-tasks' files are too
        parts = [task, *getattr(task.metadata, "tasks", [])]
        records = {part.metadata.name: computed_from(encoder, part, batch_size) for part in parts}
        paths = {name: cache.get_task_result_path(name, meta) for name in records}
        stale = None
        for name, record in records.items():
            why = None if overwrite else why_not_reused(paths[name], record)
            if why:
                stale = stale or (paths[name], why)
                logger.warning("%s: the stored result %s is not reused, %s; computing it again", name, paths[name], why)
        result = mteb.evaluate(
            encoder,
            [task],
            cache=cache,
            overwrite_strategy="always" if overwrite or stale else "only-missing",
            encode_kwargs={"batch_size": batch_size, "show_progress_bar": show_progress_bar},
            co2_tracker=False,
            raise_error=raise_error,
            show_progress_bar=show_progress_bar,
        )
        if result.task_results:
            for name, record in records.items():
                if paths[name].exists():
                    write_record(paths[name], record)
        task_results += result.task_results
        for error in result.exceptions or []:
            if stale:
                error = TaskError(
                    task_name=error.task_name,
                    exception=f"the stored result {stale[0]} is not reused ({stale[1]}), and computing it failed: "
                    f"{error.exception}",
                )
            exceptions.append(error)
    return ModelResult(
        model_name=meta.name, model_revision=meta.revision, task_results=task_results, exceptions=exceptions
    )
