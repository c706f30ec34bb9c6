"""The fields both stages share: the model and how it embeds a text (:class:`ModelArguments`) and the training data
(:class:`DataArguments`), on :class:`Arguments`: a field is declared by its line, its choices (a ``Literal`` type) and
the docstring under it (its help); its range is in :data:`llm2vec.config_values.RANGES`."""

from __future__ import annotations

import ast
import inspect
import os
import typing
from dataclasses import MISSING, Field, dataclass, field
from typing import Any, Literal

from ..config_values import ConfigError, check_fields
from ..dataset.hf import check_column_map
from ..pooling import POOLING_MODES
from ..templates import TRAINING_SEPARATOR

STAGES = ("I", "II")
DATASETS = ("E5", "jsonl", "hf")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
MASTER_WEIGHTS = ("bf16", "fp32")
ATTENTION = ("flash_attention_2", "sdpa", "eager")
PACKING = ("auto", "true", "false")


class Arguments:
    """An argument class (a dataclass): each field's help is the docstring under it and its choices are those of its
    ``Literal`` type (the metadata that ``--help``, the checks and docs/configuration.md read); a list default is
    copied for each instance. Made, each field is among its choices and within its range, or :class:`ConfigError`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        hints, body = typing.get_type_hints(cls), ast.parse(inspect.getsource(cls)).body[0].body
        for line, doc in zip(body, body[1:]):
            if isinstance(line, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                name, hint = line.target.id, hints[line.target.id]
                choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
                metadata = {"help": " ".join(doc.value.value.split()), **({"choices": choices} if choices else {})}
                default = getattr(cls, name, MISSING)
                if isinstance(default, list):
                    setattr(cls, name, field(default_factory=lambda d=default: list(d), metadata=metadata))
                elif not isinstance(default, Field):
                    setattr(cls, name, field(default=default, metadata=metadata))

    def __post_init__(self):
        check_fields(self)


@dataclass
class ModelArguments(Arguments):
    """The model being trained and how it embeds a text (both stages)."""

    model_name_or_path: str
    """Hub id or local folder of the base model: a causal LM for Stage I; for Stage II a hub id (the Baseline) or a
    Stage I output folder."""
    base_model_hub_id: str | None = None
    """The hub id a local model_name_or_path came from (e.g. HuggingFaceTB/SmolLM2-135M-Instruct), recorded in
    run_config.json and the model cards; default: model_name_or_path when it is a hub id."""
    pooling_mode: Literal[POOLING_MODES] = "eos_token"
    """How a text becomes one vector: eos_token (the paper's anchor), last_token, mean, weighted_mean."""
    max_seq_length: int = 512
    """Most tokens of one input, chat template, instruction and anchor included."""
    template: str | None = None
    """Prompt template (model family): a registered family, chat_template (derived from the tokenizer's chat template)
    or plain (a base model: its text, then its EOS as the anchor); default: detected from the model."""
    attn_implementation: Literal[ATTENTION] = "sdpa"
    """flash_attention_2 (the paper's; needs the flash extra and a CUDA GPU), sdpa or eager."""
    packing: Literal[PACKING] = "auto"
    """Packed decoder calls without padding, with the same losses and embeddings (docs/scaling.md): true, false, or
    auto: on with flash_attention_2 for a family that declares packing exact (the shipped ones do), else off."""
    torch_dtype: Literal[("auto", *DTYPE_NAMES)] = "auto"
    """dtype of the weights; auto: with bf16 as master_weights says, else float32. With bf16 an explicit value must
    agree with master_weights."""
    trust_remote_code: bool = False
    """Run the Python code that a model folder's config names in its auto_map; false: such a model is refused before
    anything loads. Set true only for code you have read and trust."""
    master_weights: Literal[MASTER_WEIGHTS] = "bf16"
    """Precision of bf16 training, under DDP and FSDP alike (docs/scaling.md): bf16 (the authors'), weights, gradients
    and AdamW states in bfloat16 (under FSDP the Trainer's mixed precision is switched off); fp32, float32 master
    weights and AdamW states under bf16 autocast. Ignored without bf16."""

    @property
    def use_packing(self) -> bool | str:
        """The ``packing`` argument of :class:`llm2vec.LLM2Vec`: ``True``/``False``, or for auto with
        flash_attention_2 ``"if_exact"`` (packed when the model family declares packing exact, else padded)."""
        if self.packing == "auto":
            return "if_exact" if self.attn_implementation == "flash_attention_2" else False
        return self.packing == "true"

    def __post_init__(self):
        self.packing = str(self.packing).lower() if isinstance(self.packing, bool) else self.packing  # JSON true
        super().__post_init__()


@dataclass
class DataArguments(Arguments):
    """The training data (both stages)."""

    dataset_name: Literal[DATASETS] = "E5"
    """E5 (the paper's data: one <source>.jsonl file per source), jsonl (your own files) or hf (Hugging Face datasets,
    memory-mapped; docs/data.md)."""
    dataset_file_path: str = ""
    """Required. E5: the folder of <source>.jsonl files; jsonl: files joined by ','; hf: save_to_disk folders, .parquet
    / .arrow / .json(l) files or cached dataset ids (owner/name[:config]) joined by ',', one source each."""
    max_examples_per_source: int | None = None
    """E5 and hf: keep at most this many examples of each source (its first ones)."""
    e5_sources: list[str] | None = None
    """E5 sources to use, by file stem (default: all of the paper's Table 6)."""
    default_instruction: str = ""
    """jsonl and hf: the query instruction of lines (rows) that give none."""
    query_instructions: bool = True
    """Prepend each query's instruction (E5: its source's Table 6 one; jsonl and hf: the line's or default_instruction)
    in both stages, as the authors do (true), or train on bare queries (false). Never on documents nor in Stage I's text
    targets."""
    instruction_separator: str = TRAINING_SEPARATOR
    """What joins a query's instruction and its text in training: '; ' (the authors' loader; evaluation uses ': '). Keep
    a trailing space for sentencepiece tokenizers (Mistral)."""
    column_map: dict[str, Any] | None = None
    """hf: the column of each role (query, positive, negative, instruction) as a JSON object, for every dataset
    ({"query": "question"}) or by source ({"nq": {"query": "q"}}); an unmapped role takes the column of its name
    (docs/data.md)."""
    dataset_split: str = "train"
    """hf: the split read from a DatasetDict save_to_disk folder or a dataset id."""
    validation_file: str | None = None
    """Held-out pairs (a JSON-lines file of the training layout) evaluated every eval_steps; Stage I logs their
    reconstruction loss and the anchor's information gain (llm2vec.anchor_gain). Not with validation_size."""
    validation_size: float = 0
    """Hold out this many training examples (a whole number) or this fraction of them (0 < x < 1) as validation pairs:
    carved with the seed, never trained on, the same on a resume. 0: none."""
    retrieval_eval_dirs: list[str] | None = None
    """BEIR-layout retrieval folders (corpus, queries and qrels .jsonl) scored at every evaluation: each one's nDCG@10,
    MRR@10 and Recall@100 logged as eval_<folder name>_ndcg_at_10 etc., their means as eval_beir_mean_ndcg_at_10 etc.
    (llm2vec.retrieval)."""
    retrieval_eval_instruction: str | None = None
    """The query instruction of the retrieval folders that retrieval_eval_instructions does not name ('' for none)."""
    retrieval_eval_instructions: dict[str, str] | None = None
    """Query instructions by retrieval folder name, e.g. {"NanoNQ": "Given a question, retrieve Wikipedia passages that
    answer the question"}."""

    def __post_init__(self):
        super().__post_init__()
        if self.validation_size >= 1 and self.validation_size != int(self.validation_size):
            raise ConfigError(
                f"validation_size={self.validation_size}: must be 0, a fraction in (0, 1) or a whole count"
            )
        if self.validation_file and self.validation_size:
            raise ConfigError("validation_file and validation_size are both set: give one source of validation pairs")
        try:
            check_column_map(self.column_map)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.column_map and self.dataset_name != "hf":
            raise ConfigError(f"column_map is for dataset_name hf (this config reads {self.dataset_name}); drop it")
        for name, what in (("dataset_split", "the split to read, e.g. train"), ("instruction_separator", "e.g. '; '")):
            if not getattr(self, name):
                raise ConfigError(f"{name} is empty: give {what}")
        self.retrieval_folders()  # the folders' names and instructions (the files are read at start-up)

    def retrieval_folders(self) -> list[tuple[str, str]]:
        """``(folder, query instruction)`` of each folder of ``retrieval_eval_dirs``; :class:`ConfigError` for two
        folders of one name (their log keys'), one named ``beir_mean`` (the means'), one without an instruction, or an
        instruction for a folder not listed."""
        dirs, instructions = list(self.retrieval_eval_dirs or []), self.retrieval_eval_instructions or {}
        names, default = [os.path.basename(os.path.abspath(d)) for d in dirs], self.retrieval_eval_instruction
        if not isinstance(instructions, dict) or not all(isinstance(x, str) for kv in instructions.items() for x in kv):
            raise ConfigError(
                f"retrieval_eval_instructions={instructions!r:.80}: give a JSON object of folder: instruction"
            )
        problems = []
        for folder, name in zip(dirs, names):
            if names.count(name) > 1:
                twins = [d for d, n in zip(dirs, names) if n == name]
                problems.append(f"{twins} share the name {name!r}, which names their log keys; rename one")
            if name == "beir_mean":
                problems.append(f"{folder!r}: the name 'beir_mean' is the means'; rename it")
            if name not in instructions and default is None:
                problems.append(
                    f"{folder!r} has no query instruction: set retrieval_eval_instruction (for every folder; '' for "
                    f"none) or retrieval_eval_instructions {{{name!r}: ...}}"
                )
        if unknown := sorted(set(instructions) - set(names)):
            problems.append(f"retrieval_eval_instructions names {unknown}, which retrieval_eval_dirs does not hold")
        if problems:
            raise ConfigError(f"retrieval_eval_dirs: {problems[0]}")
        return [(d, instructions.get(n, default)) for d, n in zip(dirs, names)]

    def collator_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`llm2vec.collator.TrainCollator` from the data settings."""
        return {"query_instructions": self.query_instructions, "instruction_separator": self.instruction_separator}
