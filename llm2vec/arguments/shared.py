"""The fields both stages share: the model and how it embeds a text (:class:`ModelArguments`), the training data
(:class:`DataArguments`), and :class:`ConfigError`, the one-line error every check of a config raises."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..config_values import ConfigError
from ..dataset.hf import ROLES, check_column_map
from ..pooling import POOLING_MODES
from ..templates import TRAINING_SEPARATOR

STAGES = ("I", "II")
DATASETS = ("E5", "jsonl", "hf")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
MASTER_WEIGHTS = ("bf16", "fp32")
ATTENTION = ("flash_attention_2", "sdpa", "eager")
PACKING = ("auto", "true", "false")


def _choice(name: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r}: choose one of {', '.join(map(str, allowed))}")


@dataclass
class ModelArguments:
    """The model being trained and how it embeds a text (both stages)."""

    model_name_or_path: str = field(
        metadata={
            "help": "Hub id or local folder of the base model: a causal LM for Stage I; for Stage II a hub "
            "id (the Baseline) or a Stage I output folder."
        }
    )
    base_model_hub_id: str | None = field(
        default=None,
        metadata={
            "help": "The hub id the weights of model_name_or_path came from when that is a local folder (a download "
            "or conversion), e.g. HuggingFaceTB/SmolLM2-135M-Instruct; recorded in run_config.json and given as "
            "base_model in the model cards. Default: model_name_or_path when it is a hub id."
        },
    )
    pooling_mode: str = field(
        default="eos_token",
        metadata={
            "help": "How a text becomes one vector: eos_token (the paper's anchor), last_token, mean, weighted_mean.",
            "choices": POOLING_MODES,
        },
    )
    max_seq_length: int = field(
        default=512, metadata={"help": "Most tokens of one input, chat template, instruction and anchor included."}
    )
    template: str | None = field(
        default=None,
        metadata={
            "help": "Prompt template (model family) name: a registered family, chat_template for the one derived from "
            "the tokenizer's own chat template, or plain for a base model (its text, then its EOS as the anchor); "
            "default: detected from the model's config and tokenizer, derived from its chat template when no "
            "registered family matches it."
        },
    )
    attn_implementation: str = field(
        default="sdpa",
        metadata={
            "help": "flash_attention_2 (the paper's; needs the flash extra and a CUDA GPU), sdpa or eager.",
            "choices": ATTENTION,
        },
    )
    packing: str = field(
        default="auto",
        metadata={
            "help": "Packed decoder calls, without padding (llm2vec.packing; the same losses and embeddings): true, "
            "false, or auto (on with flash_attention_2, whose variable-length kernel skips the padding, for a family that "
            "declares packing exact, which the four shipped ones do; off otherwise, "
            "since sdpa and eager compute attention over the whole packed row, quadratic in its length; true "
            "pays on CPU for Stage I chunks of about 1k tokens, see docs/results/benchmarks.md).",
            "choices": PACKING,
        },
    )
    torch_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of the weights: auto (with bf16: as master_weights says; else float32), bfloat16, float16, "
            "float32. With bf16 an explicit value must agree with master_weights.",
            "choices": ("auto", *DTYPE_NAMES),
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Run the Python code that a model folder's config.json or tokenizer_config.json names in its "
            "auto_map (transformers' trust_remote_code). false: such a model is refused before anything loads "
            "(llm2vec.model_files); set true only for code you have read and trust."
        },
    )
    master_weights: str = field(
        default="bf16",
        metadata={
            "help": "Precision policy of bf16 training (bf16: true), the same under DDP and FSDP. bf16 (the authors'): "
            "pure bf16, the weights, their gradients and the AdamW states are bfloat16, so an update smaller "
            "than half a bf16 step of a weight is lost (docs/scaling.md gives the measured share); "
            "under FSDP the Trainer's mixed precision is then switched off, since accelerate would otherwise "
            "keep fp32 copies of the weights. fp32: float32 master weights and AdamW states, forward and "
            "backward under bf16 autocast (FSDP: its bf16 mixed-precision policy). Ignored without bf16.",
            "choices": MASTER_WEIGHTS,
        },
    )

    @property
    def use_packing(self) -> bool | str:
        """The ``packing`` argument of :class:`llm2vec.LLM2Vec`: ``True``/``False``, or for auto with
        flash_attention_2 ``"if_exact"`` (packed when the model family declares packing exact, else padded)."""
        if self.packing == "auto":
            return "if_exact" if self.attn_implementation == "flash_attention_2" else False
        return self.packing == "true"

    def __post_init__(self):
        _choice("pooling_mode", self.pooling_mode, POOLING_MODES)
        _choice("attn_implementation", self.attn_implementation, ATTENTION)
        if isinstance(self.packing, bool):  # a JSON true/false
            self.packing = str(self.packing).lower()
        _choice("packing", self.packing, PACKING)
        _choice("torch_dtype", self.torch_dtype, ("auto", *DTYPE_NAMES))
        _choice("master_weights", self.master_weights, MASTER_WEIGHTS)
        if self.max_seq_length < 8:
            raise ConfigError(f"max_seq_length={self.max_seq_length}: must be at least 8")


@dataclass
class DataArguments:
    """The training data (both stages)."""

    dataset_name: str = field(
        default="E5",
        metadata={
            "help": "E5 (the paper's data: one <source>.jsonl file per source), jsonl (your own files) or hf "
            "(Hugging Face datasets, memory-mapped: save_to_disk folders, parquet / arrow / JSON(-lines) files, "
            "dataset ids in the local cache).",
            "choices": DATASETS,
        },
    )
    dataset_file_path: str = field(
        default="",
        metadata={
            "help": "Required. E5: the folder of <source>.jsonl files; jsonl: a file, or files joined by ','; hf: "
            "datasets joined by ',', each a save_to_disk folder, a .parquet / .arrow / .json / .jsonl file or a "
            "dataset id in the local cache (owner/name or owner/name:config), one source each. The package has no "
            "default location; every shipped config names one."
        },
    )
    max_examples_per_source: int | None = field(
        default=None,
        metadata={
            "help": "E5 and hf: keep at most this many examples of each source (the first ones of its file or table)."
        },
    )
    e5_sources: list[str] | None = field(
        default=None, metadata={"help": "E5 sources to use, by file stem (default: all of the paper's Table 6)."}
    )
    default_instruction: str = field(
        default="",
        metadata={
            "help": "jsonl and hf: the query instruction of lines that have no 'instruction' field (hf: no "
            "instruction column, or null)."
        },
    )
    query_instructions: bool = field(
        default=True,
        metadata={
            "help": "Prepend each query's instruction (E5: its source's Table 6 instruction; jsonl and hf: the "
            "line's 'instruction' or default_instruction) in both stages, as the authors' loader does (true), or "
            "train on bare queries (false). Documents never get one; Stage I's 'text' reconstruction "
            "targets never include it."
        },
    )
    instruction_separator: str = field(
        default=TRAINING_SEPARATOR,
        metadata={
            "help": "What joins a query's instruction and its text in training: '; ' (the authors' E5 loader). "
            "Evaluation uses ': ' (the authors' evaluation; llm2vec.templates.EVALUATION_SEPARATOR). Keep a "
            "trailing space for sentencepiece tokenizers (Mistral): they start every text with one."
        },
    )

    column_map: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "hf: which column holds each field (roles: " + ", ".join(ROLES) + "), as a JSON object: "
            '{"query": "question", "positive": "answer"} for every dataset, {"<source>": {"query": "q"}} for one '
            "source (its file's stem, folder's name or id), a source's own entry over the shared one. Unmapped "
            "roles take the column of their own name; query also takes sentence-transformers' anchor. A "
            "mapped column that a dataset lacks is refused with its columns listed."
        },
    )
    dataset_split: str = field(
        default="train",
        metadata={"help": "hf: the split read from a DatasetDict save_to_disk folder or a dataset id."},
    )

    validation_file: str | None = field(
        default=None,
        metadata={
            "help": "Held-out pairs evaluated every eval_steps: a JSON-lines file of the training layout "
            "(query, positive[, negative][, instruction]; validated like the training data). Stage I logs the "
            "validation reconstruction loss and the anchor's information gain per direction "
            "(llm2vec.anchor_gain). Give this or validation_size, not both."
        },
    )
    validation_size: float = field(
        default=0,
        metadata={
            "help": "Hold out this many training examples (a whole number >= 1) or this fraction of them (0 < x < 1) "
            "as the validation pairs: carved with the seed before training, never trained on, the same slice on "
            "a resume and in every process. 0: none."
        },
    )

    retrieval_eval_dirs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Retrieval folders of the BEIR / NanoBEIR layout (corpus.jsonl, queries.jsonl, qrels.jsonl) scored "
            "at every evaluation (eval_steps, and eval_on_start) with the model being trained, as "
            "the mteb evaluation of a local retrieval folder (llm2vec.evaluation) scores them: each folder's nDCG@10, MRR@10 and "
            "Recall@100 are logged as eval_<folder name>_ndcg_at_10 etc., their means over the folders as "
            "eval_beir_mean_ndcg_at_10 etc. (llm2vec.retrieval). Read and checked at start-up; every query needs a "
            "relevant document. Folder names must differ."
        },
    )
    retrieval_eval_instruction: str | None = field(
        default=None,
        metadata={
            "help": "The query instruction of every folder of retrieval_eval_dirs that retrieval_eval_instructions "
            "does not name ('' for none); documents get none. Joined to the query by ': ', as at evaluation."
        },
    )
    retrieval_eval_instructions: dict[str, str] | None = field(
        default=None,
        metadata={
            "help": 'Query instructions by folder name, e.g. {"NanoNQ": "Given a question, retrieve Wikipedia '
            'passages that answer the question"}; a folder named by neither this nor retrieval_eval_instruction is '
            "refused."
        },
    )

    def __post_init__(self):
        _choice("dataset_name", self.dataset_name, DATASETS)
        if self.validation_size < 0 or (
            self.validation_size >= 1 and self.validation_size != int(self.validation_size)
        ):
            raise ConfigError(
                f"validation_size={self.validation_size}: must be 0 (none), a fraction in (0, 1) or a whole count"
            )
        if self.validation_file and self.validation_size:
            raise ConfigError("validation_file and validation_size are both set: give one source of validation pairs")
        if self.max_examples_per_source is not None and self.max_examples_per_source < 1:
            raise ConfigError(f"max_examples_per_source={self.max_examples_per_source}: must be positive")
        try:
            check_column_map(self.column_map)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.column_map and self.dataset_name != "hf":
            raise ConfigError(f"column_map is for dataset_name hf (this config reads {self.dataset_name}); drop it")
        if not self.dataset_split:
            raise ConfigError("dataset_split is empty: give the split to read, e.g. train")
        if not self.instruction_separator:
            raise ConfigError("instruction_separator is empty: give the string between instruction and text, e.g. '; '")
        self.retrieval_folders()  # the folders' names and instructions (the files are read at start-up)

    def retrieval_folders(self) -> list[tuple[str, str]]:
        """``(folder, query instruction)`` of each folder of ``retrieval_eval_dirs``; raises :class:`ConfigError` for
        two folders of one name, a folder named ``beir_mean`` (the means' name), a folder without an instruction and
        an instruction for a folder that is not listed."""
        dirs = list(self.retrieval_eval_dirs or [])
        instructions = self.retrieval_eval_instructions or {}
        if not isinstance(instructions, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in instructions.items()
        ):
            raise ConfigError(
                f"retrieval_eval_instructions={instructions!r:.80}: give a JSON object of folder name: instruction"
            )
        names = [os.path.basename(os.path.abspath(d)) for d in dirs]
        if instructions and not dirs:
            raise ConfigError("retrieval_eval_instructions is set but retrieval_eval_dirs is not: give the folders")
        for name, folder in zip(names, dirs):
            if names.count(name) > 1:
                twins = [d for d, n in zip(dirs, names) if n == name]
                raise ConfigError(
                    f"retrieval_eval_dirs: {twins} share the name {name!r}, which names their log keys; rename one"
                )
            if name == "beir_mean":
                raise ConfigError(f"retrieval_eval_dirs: {folder!r}: the name 'beir_mean' is the means'; rename it")
            if name not in instructions and self.retrieval_eval_instruction is None:
                raise ConfigError(
                    f"retrieval_eval_dirs: {folder!r} has no query instruction: set retrieval_eval_instruction (for "
                    f"every folder; '' for none) or retrieval_eval_instructions {{{name!r}: ...}}"
                )
        unknown = sorted(set(instructions) - set(names))
        if unknown:
            raise ConfigError(
                f"retrieval_eval_instructions names {unknown}, which retrieval_eval_dirs does not hold (its folders: "
                f"{names})"
            )
        return [(d, instructions.get(n, self.retrieval_eval_instruction)) for d, n in zip(dirs, names)]

    def collator_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`llm2vec.collator.TrainCollator` from the data settings."""
        return {"query_instructions": self.query_instructions, "instruction_separator": self.instruction_separator}
