"""Run configuration: one argument dataclass per concern, validated where it is defined, parsed per stage.

A run is configured by one JSON file (``run_stage_I.py train_configs/stage_I/<model>.json``), by the same
fields as CLI flags (``--model_name_or_path ... --max_steps ...``), or by a JSON file followed by flags
that override it (``config.json --max_steps 2``). The fields of a stage are those of:

- :class:`ModelArguments` (both stages): the base model, pooling, lengths, template, attention, dtype;
- :class:`DataArguments` (both stages): the training data;
- :class:`StageIArguments` or :class:`StageIIArguments`: what only that stage has (the reconstruction
  loss; the contrastive loss and LoRA);
- ``transformers.TrainingArguments``: optimiser, schedule, batch, precision, saving, distribution (on
  transformers < 5.23 with the ``activation_checkpointing`` fields added, :mod:`llm2vec.compat`).

Every value is checked in its dataclass's ``__post_init__``; what depends on several classes or on the
machine (the global batch, FlashAttention) is checked once, in :meth:`RunConfig.validate`. A field that
does not belong to the stage (say ``alpha`` in a Stage II config) is an error naming the file and the
field. Allowed values are imported from the modules that define them, never copied. The repository's
field reference is generated from these classes (their ``help`` and ``choices`` metadata).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from transformers import HfArgumentParser

from .compat import TrainingArguments
from .config_values import Flag, ValueProblem, check_ranges, coerce_config
from .dataset.base import DataError, check_path_kind
from .io import JsonFileError, read_json_file
from .llm2vec import resolve_dtype
from .loss.reconstruction import RECONSTRUCTION_TARGETS
from .model_files import ModelFilesError, check_model_files
from .pooling import POOLING_MODES
from .templates import TRAINING_SEPARATOR

logger = logging.getLogger("llm2vec")

STAGES = ("I", "II")
DATASETS = ("E5", "jsonl")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
MASTER_WEIGHTS = ("bf16", "fp32")
ATTENTION = ("flash_attention_2", "sdpa", "eager")
PACKING = ("auto", "true", "false")


class ConfigError(ValueError):
    """A bad configuration: the message names the file or flag, the field, and what to do."""


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
            "help": "Prompt template (model family) name; default: detected from the model's config and tokenizer."
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
            "pays on CPU for Stage I chunks of about 1k tokens, see the README's benchmark).",
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
            "than half a bf16 step of a weight is lost (the README's precision section gives the measured share); "
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
            "help": "E5 (the paper's data: one <source>.jsonl file per source) or jsonl (your own files).",
            "choices": DATASETS,
        },
    )
    dataset_file_path: str = field(
        default="",
        metadata={
            "help": "Required. E5: the folder of <source>.jsonl files; jsonl: a file, or files joined by ','. "
            "The package has no default location; every shipped config names one."
        },
    )
    max_examples_per_source: int | None = field(
        default=None, metadata={"help": "Keep at most this many examples of each source (the first ones of its file)."}
    )
    e5_sources: list[str] | None = field(
        default=None, metadata={"help": "E5 sources to use, by file stem (default: all of the paper's Table 6)."}
    )
    default_instruction: str = field(
        default="", metadata={"help": "jsonl: the query instruction of lines that have no 'instruction' field."}
    )
    query_instructions: bool = field(
        default=True,
        metadata={
            "help": "Prepend each query's instruction (E5: its source's Table 6 instruction; jsonl: the line's "
            "'instruction' or default_instruction) in both stages, as the authors' loader does (true), or "
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
        if not self.instruction_separator:
            raise ConfigError("instruction_separator is empty: give the string between instruction and text, e.g. '; '")

    def collator_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`llm2vec.collator.TrainCollator` from the data settings."""
        return {"query_instructions": self.query_instructions, "instruction_separator": self.instruction_separator}


@dataclass
class _StageArguments:
    stage: str = field(
        default="",
        metadata={"help": "The stage this config is for (I or II); the driver of the other stage refuses it."},
    )
    total_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Expected global batch = per_device_train_batch_size x processes x gradient_accumulation_steps; "
            "checked at start-up."
        },
    )
    stop_after_n_steps: int | None = field(
        default=None,
        metadata={
            "help": "End training after this many optimizer steps and save the final model there (the paper's "
            "step counts: 2000 in Stage I, 1000 in Stage II). The learning-rate schedule does not end "
            "here: it spans num_train_epochs over the data actually loaded (e.g. 3 epochs of E5, about "
            "8.8k steps at batch 512), as in the authors' runs, so the rate at the stop is still most of its "
            "peak; the run logs and saves (run_config.json, lr_schedule) the horizon and the rate at the "
            "stop. To decay the rate to zero at the stop instead, set max_steps to the same number (the "
            "schedule then ends at max_steps). Default: train to the end of the schedule."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace the run already in output_dir (its final model, completion marker and checkpoints are "
            "deleted once the start-up checks pass). Without it, a run refuses to start in a folder that holds "
            "a finished model or checkpoints; --resume_from_checkpoint true continues that run instead."
        },
    )
    accept_changed_inputs: bool = field(
        default=False,
        metadata={
            "help": "Resume although the data files, the base model (or adapter) or the batch geometry (per-device "
            "batch, processes, accumulation) differ from what the checkpoint was trained with. Without it such a "
            "resume is refused with what differs (each run records size, modification time and a hash of the first "
            "MiB of every input file in run_config.json); with it, run_config.json records the change and the "
            "step it happened at (resumed_with_changes)."
        },
    )
    num_threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads of torch (torch.set_num_threads) for this run. Float sums split among threads round "
            "differently, so bit-identical results on CPU need the same value in both runs; default: torch's "
            "own (OMP_NUM_THREADS, else the number of cores)."
        },
    )

    STAGE = ""

    def __post_init__(self):
        if not self.stage:
            self.stage = self.STAGE
        _choice("stage", self.stage, STAGES)
        if self.total_batch_size is not None and self.total_batch_size < 1:
            raise ConfigError(f"total_batch_size={self.total_batch_size}: must be positive")
        if self.stop_after_n_steps is not None and self.stop_after_n_steps < 1:
            raise ConfigError(f"stop_after_n_steps={self.stop_after_n_steps}: must be a positive number of steps")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads={self.num_threads}: must be positive (or leave it unset)")

    def collator_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`llm2vec.collator.TrainCollator` for this stage."""
        raise NotImplementedError

    def check(self, args: TrainingArguments, source: str) -> None:
        """Stage-specific start-up checks against the training arguments (may warn)."""


@dataclass
class StageIArguments(_StageArguments):
    """Stage I: bidirectional reconstruction (EBQ2D + EBD2Q), full-parameter."""

    STAGE = "I"
    require_negative = False  # Stage I trains on (query, positive) pairs; a class attribute, not a field
    alpha: float = field(
        default=0.2,
        metadata={"help": "L = alpha * L_Q2D + (1 - alpha) * L_D2Q (paper's Eq. 5: 0.2). 1 = OnlyQ2D, 0 = OnlyD2Q."},
    )
    reconstruction_targets: str = field(
        default="text",
        metadata={
            "help": "Tokens each direction predicts. text (the paper's Eq. 3-4): the counterpart's text tokens. all: "
            "every token of the counterpart's prompt but its anchor (BOS, chat header, a query's instruction and "
            "separator, the text, closing tokens before the anchor). In both, every target is visible to attention "
            "and the anchor sits at position 0 with the targets at 1..m. Neither is the authors' pass: theirs "
            "predicts every token not equal to the EOS id (BOS, header and instruction too) but reuses the encoder's "
            "instruction-skipping mask, which hides BOS, the header and a query's instruction from attention under "
            "FlashAttention, and passes no position ids, so the anchor stands before the left padding at a RoPE "
            "distance from the text that varies per row (docs/departures.md).",
            "choices": RECONSTRUCTION_TARGETS,
        },
    )
    token_budget: int = field(
        default=0,
        metadata={
            "help": "Most decoder positions of one forward/backward pass, padded (real ones with packing); 0: off, "
            "the whole per-device batch at once. The per-device batch is split into chunks of pairs, longest first "
            "and greedily under the budget, where a chunk costs its pairs times the summed widths of its four "
            "decoder calls (query and document encoding, q2d and d2q reconstruction), each padded to the chunk's "
            "longest row (packed: the sum of its pairs' real lengths); the chunks are back-propagated one by one, "
            "and all processes run as many chunks as the largest plan among them (llm2vec.chunked_steps). Exact: "
            "the same loss and gradient as without it (each pair's terms depend on that pair only, and all "
            "chunks divide by the step-wide token counts). It bounds activation memory and cuts padding; the "
            "padding fraction is logged either way."
        },
    )
    logit_chunk_rows: int = field(
        default=0,
        metadata={
            "help": "Compute the LM head's logits and cross-entropy this many target rows at a time, each block "
            "recomputed in backward, so at most one block of rows x vocabulary float32 logits exists at a "
            "time (0: all target rows at once). Exact up to float summation order. On CUDA with the liger "
            "extra installed, Liger's fused linear cross-entropy is used instead."
        },
    )

    reconstruction_input_dropout: float = field(
        default=0.0,
        metadata={
            "help": "An option, not the paper's (0): in training, replace this share of the reconstruction pass's "
            "teacher-forced target inputs by zero vectors (word dropout), so the decoder has to read the anchor "
            "(docs/demo.md: the sweep). The targets predicted stay the same; evaluation never drops."
        },
    )
    reconstruction_prefix: str = field(
        default="",
        metadata={
            "help": "An option, not the paper's (empty): a text whose tokens the reconstruction pass reads before the "
            "anchor, so the anchor is not at position 0 (a decoder's attention sink), e.g. '<|im_start|>'."
        },
    )

    stop_decoder_gradient: bool = field(
        default=False,
        metadata={
            "help": "An option, not the paper's (false): the reconstruction pass runs the decoder with its weights "
            "detached, so the reconstruction losses train only the encoding pass, through the anchor; the decoder "
            "cannot lower them by predicting the targets without it (docs/demo.md: the sweep). Not with FSDP."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.reconstruction_input_dropout < 1.0:
            raise ConfigError(
                f"reconstruction_input_dropout={self.reconstruction_input_dropout}: must be in [0, 1) (0: the paper)"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha={self.alpha}: must be in [0, 1]")
        _choice("reconstruction_targets", self.reconstruction_targets, RECONSTRUCTION_TARGETS)
        if self.token_budget < 0:
            raise ConfigError(f"token_budget={self.token_budget}: must be 0 (off) or a positive number of positions")
        if self.logit_chunk_rows < 0:
            raise ConfigError(f"logit_chunk_rows={self.logit_chunk_rows}: must be 0 (off) or a positive number of rows")

    def collator_options(self) -> dict[str, Any]:
        return {"reconstruction": self.reconstruction_targets}


@dataclass
class StageIIArguments(_StageArguments):
    """Stage II: LoRA contrastive fine-tuning (InfoNCE with in-batch and hard negatives)."""

    STAGE = "II"
    peft_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A LoRA adapter merged into the base model before the new adapters are added."}
    )
    loss_scale: float = field(
        default=20.0,
        metadata={"help": "InfoNCE scale = 1 / tau (paper: tau = 0.05, so 20; the authors' code defaults to 50)."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the authors' code: 2 x rank)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "Names of the linear modules that get LoRA adapters."},
    )
    require_negative: bool = field(
        default=True,
        metadata={
            "help": "Train with hard negatives, which every example must then have (true, the paper's), or with "
            "in-batch negatives only (false)."
        },
    )
    embedding_token_budget: int = field(
        default=0,
        metadata={
            "help": "Gradient cache (GradCache): 0 (off) embeds the per-device batch in one graph. A positive number "
            "is the most tokens of one chunk, padded (rows x longest row; real ones with packing): the batch's "
            "queries, positives and negatives are sorted by length and cut into such chunks, embedded once "
            "without a graph for the loss and its gradient with respect to the embeddings, then again one chunk "
            "at a time with a graph to back-propagate it (dropout replayed), so activation memory is that of one "
            "chunk (llm2vec.chunked_steps). Same loss and gradient as the plain step (without dropout, up to "
            "float rounding), for two forward passes instead of one (also for a batch that would fit one chunk: "
            "every process must run the same collectives, and all run as many chunks as the largest plan). Must be at least max_seq_length."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.loss_scale <= 0:
            raise ConfigError(f"loss_scale={self.loss_scale}: must be positive (it is 1 / temperature)")
        if self.lora_r < 1 or self.lora_alpha <= 0:
            raise ConfigError(f"lora_r={self.lora_r}, lora_alpha={self.lora_alpha}: must be positive")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"lora_dropout={self.lora_dropout}: must be in [0, 1)")
        if not self.lora_target_modules:
            raise ConfigError("lora_target_modules is empty: name the linear modules that get adapters")
        if self.embedding_token_budget < 0:
            raise ConfigError(
                f"embedding_token_budget={self.embedding_token_budget}: must be 0 (off) or a positive number of tokens"
            )

    def collator_options(self) -> dict[str, Any]:
        return {"with_negative": self.require_negative}

    def check(self, args: TrainingArguments, source: str) -> None:
        """Gradient accumulation splits the contrastive batch: negatives come from one micro-batch only."""
        if args.gradient_accumulation_steps <= 1:
            return
        micro = args.per_device_train_batch_size * args.world_size
        total = micro * args.gradient_accumulation_steps
        logger.warning(
            "gradient_accumulation_steps = %d: each optimizer step covers %d examples, but InfoNCE only sees the "
            "%d examples of one micro-batch (per_device_train_batch_size %d x %d process(es)), so each query has "
            "%d in-batch positives of other queries (plus hard negatives) as negatives instead of %d. "
            "Raise per_device_train_batch_size or the number of processes to keep the whole batch in one step "
            "(embedding_token_budget bounds the memory of a large per-device batch).",
            args.gradient_accumulation_steps,
            total,
            micro,
            args.per_device_train_batch_size,
            args.world_size,
            micro - 1,
            total - 1,
        )


STAGE_ARGUMENTS: dict[str, type[_StageArguments]] = {"I": StageIArguments, "II": StageIIArguments}


def argument_classes(stage: str) -> tuple[type, ...]:
    _choice("stage", stage, STAGES)
    return (ModelArguments, DataArguments, STAGE_ARGUMENTS[stage], TrainingArguments)


# Training defaults that differ from transformers' (set unless the config gives them).
TRAINING_DEFAULTS = {"remove_unused_columns": False, "report_to": "none", "ddp_find_unused_parameters": False}


@dataclass
class RunConfig:
    """A parsed and validated configuration of one stage."""

    model: ModelArguments
    data: DataArguments
    stage: StageIArguments | StageIIArguments
    training: TrainingArguments
    source: str  # the config file, or "command line"

    @property
    def global_batch_size(self) -> int:
        args = self.training
        return args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: with bf16 training, bfloat16 or float32 as ``master_weights`` says; else
        ``torch_dtype`` (``auto``: float32)."""
        name = self.model.torch_dtype
        if name == "auto":
            name = (
                ("bfloat16" if self.model.master_weights == "bf16" else "float32") if self.training.bf16 else "float32"
            )
        return resolve_dtype(name)

    @property
    def autocast(self) -> str:
        """What the Trainer's mixed precision does: ``bf16`` autocast, or ``off``."""
        return "off" if self.training.mixed_precision == "no" else self.training.mixed_precision

    def apply_precision_policy(self) -> None:
        """Check ``torch_dtype`` against ``master_weights`` and keep pure bf16 pure under FSDP.

        accelerate's FSDP casts trainable bf16 weights to float32 master copies whenever the Trainer's
        mixed precision is on; with ``master_weights = bf16`` that mixed precision is switched off, so the
        sharded weights, gradients and AdamW states stay bf16 as under DDP.
        """
        model, args = self.model, self.training
        if not args.bf16:
            return
        wanted = "bfloat16" if model.master_weights == "bf16" else "float32"
        if model.torch_dtype not in ("auto", wanted):
            raise ConfigError(
                f"{self.source}: torch_dtype {model.torch_dtype!r} contradicts master_weights "
                f"{model.master_weights!r} (bf16 training keeps {wanted} weights); drop torch_dtype or "
                "change master_weights"
            )
        if model.master_weights == "bf16" and args.fsdp:
            args.mixed_precision = "no"
            logger.info(
                "master_weights bf16 under FSDP: the Trainer's mixed precision is off, so FSDP keeps the "
                "bf16 weights (it would otherwise upcast them to float32 master weights)"
            )

    def validate(self) -> None:
        """The checks that involve several argument classes or the machine; raises :class:`ConfigError`."""
        try:  # before anything reads the model's config: transformers would offer to run its code
            check_model_files(
                self.model.model_name_or_path,
                getattr(self.stage, "peft_model_name_or_path", None),
                self.model.trust_remote_code,
            )
        except ModelFilesError as e:
            raise ConfigError(f"{self.source}: {e}") from None
        try:  # a folder where a file belongs, or the reverse (a missing path is reported by the loader)
            for path in self.data.dataset_file_path.split(",") if self.data.dataset_name == "jsonl" else []:
                check_path_kind(path, "jsonl")
            if self.data.dataset_name == "E5" and self.data.dataset_file_path:
                check_path_kind(self.data.dataset_file_path, "E5")
            if self.data.validation_file:
                check_path_kind(self.data.validation_file, "jsonl", "validation_file")
        except DataError as e:
            raise ConfigError(f"{self.source}: {e}") from None
        if self.model.attn_implementation == "flash_attention_2":
            if importlib.util.find_spec("flash_attn") is None:
                raise ConfigError(
                    f"{self.source}: attn_implementation 'flash_attention_2' needs the flash-attn package: "
                    'pip install -e \'.[flash]\' (CUDA GPUs only), or set "attn_implementation": "sdpa" '
                    "(or pass --attn_implementation sdpa)"
                )
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"{self.source}: attn_implementation 'flash_attention_2' needs a CUDA GPU; "
                    "pass --attn_implementation sdpa to run on CPU"
                )
        expected, args = self.stage.total_batch_size, self.training
        if args.fsdp and args.activation_checkpointing and (args.fsdp_config or {}).get("activation_checkpointing"):
            raise ConfigError(
                f"{self.source}: activation checkpointing is asked for twice, by activation_checkpointing and by "
                "fsdp_config's \"activation_checkpointing\"; the Trainer accepts only one. Keep FSDP's own (it "
                "avoids a redundant all-gather): pass --activation_checkpointing false"
            )
        if expected is not None and self.global_batch_size != expected:
            raise ConfigError(
                f"{self.source}: total_batch_size is {expected} but per_device_train_batch_size "
                f"{args.per_device_train_batch_size} x {args.world_size} process(es) x gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps} = {self.global_batch_size}. Launch with the intended number of "
                "processes (torchrun --nproc_per_node=N) or change per_device_train_batch_size / "
                "gradient_accumulation_steps."
            )
        budget = getattr(self.stage, "embedding_token_budget", 0)  # Stage II's gradient cache
        if 0 < budget < self.model.max_seq_length:
            raise ConfigError(
                f"{self.source}: embedding_token_budget {budget} is below max_seq_length "
                f"{self.model.max_seq_length}: one text alone could exceed it; give at least "
                f"{self.model.max_seq_length} (or 0 for no gradient cache)"
            )
        chunked = [f for f in ("token_budget", "embedding_token_budget") if getattr(self.stage, f, 0)]
        if args.deepspeed and chunked:
            field_name = chunked[0]
            raise ConfigError(
                f"{self.source}: {field_name} {getattr(self.stage, field_name)} cannot run under DeepSpeed: the chunked "
                "step back-propagates each chunk outside DeepSpeed's engine (its gradients would be divided by the "
                "accumulation steps twice and the optimizer stepped on every chunk of the last micro-batch); pass "
                f"--{field_name} 0, or train with FSDP (--fsdp true --fsdp_config train_configs/fsdp/fsdp2_full_shard.json)"
            )
        if getattr(self.stage, "stop_decoder_gradient", False) and args.fsdp:
            raise ConfigError(
                f"{self.source}: stop_decoder_gradient cannot run under FSDP (it calls the decoder with detached "
                "weights, which FSDP's sharded parameters do not allow); use DDP or drop the option"
            )
        if str(args.eval_strategy) not in ("no", "IntervalStrategy.NO") and not (
            self.data.validation_file or self.data.validation_size
        ):
            raise ConfigError(
                f"{self.source}: eval_strategy {args.eval_strategy.value!r} needs validation pairs: set "
                "validation_file or validation_size (or eval_strategy 'no')"
            )
        self.stage.check(args, self.source)

    def resolved(self) -> dict[str, Any]:
        """Every field of every argument class, JSON-serialisable, to save beside each checkpoint."""
        out: dict[str, Any] = {}
        for obj in (self.model, self.data, self.stage, self.training):
            values = obj.to_dict() if isinstance(obj, TrainingArguments) else asdict(obj)
            out.update({k: v for k, v in values.items() if not k.startswith("_")})
        out.update(
            config_file=self.source,
            world_size=self.training.world_size,
            precision={"weights": str(self.dtype).removeprefix("torch."), "autocast": self.autocast},
        )
        return json.loads(json.dumps(out, default=str))


def _parse_flags(argv: list[str]) -> dict[str, Flag]:
    """``--key value...`` to ``{key: Flag(values)}``; the strings are read as each field's type later
    (:func:`llm2vec.config_values.coerce_config`)."""
    out: dict[str, Flag] = {}
    i = 0
    while i < len(argv):
        key = argv[i]
        if not key.startswith("--") or len(key) == 2:
            raise ConfigError(f"command line: expected --field, got {key!r} (a JSON config must come first)")
        values = []
        i += 1
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        name = key[2:]
        if "=" in name:  # --field=value
            name, value = name.split("=", 1)
            values.insert(0, value)
        if name in out:
            raise ConfigError(f"command line: --{name} is given twice; give it once")
        out[name] = Flag(tuple(values))
    return out


def load_config(argv: list[str]) -> tuple[dict[str, Any], str]:
    """The merged raw config: a JSON file (if the first argument is one) overridden by flags."""
    source = "command line"
    config: dict[str, Any] = {}
    if argv and argv[0].endswith(".json"):
        source = argv[0]
        try:
            config = read_json_file(source, "config file")
        except JsonFileError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(config, dict):
            raise ConfigError(f"{source}: the config must be a JSON object of field: value")
        argv = argv[1:]
    config.update(_parse_flags(argv))
    return config, source


def parse_config(stage: str, argv: list[str]) -> RunConfig:
    """Parse a config for ``stage`` (``"I"`` or ``"II"``); field values checked, nothing run-time yet."""
    config, source = load_config(argv)
    if isinstance(config.get("stage"), Flag):
        config["stage"] = " ".join(config["stage"].values)
    given_stage = config.get("stage", stage)
    if given_stage != stage:
        raise ConfigError(
            f"{source}: this config is for stage {given_stage!r} (field 'stage'); use run_stage_{given_stage}.py"
            if given_stage in STAGES
            else f"{source}: stage={given_stage!r}: choose one of {', '.join(STAGES)}"
        )
    classes = argument_classes(stage)
    known = {f.name for cls in classes for f in fields(cls)}
    unknown = sorted(set(config) - known)
    if unknown:
        other = next(s for s in STAGES if s != stage)
        belongs = [k for k in unknown if k in {f.name for f in fields(STAGE_ARGUMENTS[other])}]
        hint = f" ({', '.join(belongs)}: Stage {other} only)" if belongs else ""
        raise ConfigError(
            f"{source}: unknown field(s) for Stage {stage}: {unknown}{hint}. "
            f"`run_stage_{stage}.py --help` lists the fields."
        )
    if "model_name_or_path" not in config or "output_dir" not in config:
        raise ConfigError(f"{source}: 'model_name_or_path' and 'output_dir' are required")
    try:
        config = coerce_config(config, classes)
        check_ranges(config)
    except ValueProblem as e:
        raise ConfigError(f"{source}: {e}") from None
    for key, value in TRAINING_DEFAULTS.items():
        config.setdefault(key, value)
    if config.get("validation_file") or config.get("validation_size"):
        config.setdefault("eval_strategy", "steps")  # held-out pairs are evaluated every eval_steps
    if config.get("activation_checkpointing"):
        config.setdefault("activation_checkpointing_kwargs", {"use_reentrant": False})
    try:
        model, data, stage_args, training = HfArgumentParser(classes).parse_dict(config, allow_extra_keys=False)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: {e}") from None
    config = RunConfig(model, data, stage_args, training, source)
    config.apply_precision_policy()
    return config


def help_text(stage: str) -> str:
    """The ``--help`` of a stage's driver: every field with its help and default."""
    parser = HfArgumentParser(argument_classes(stage))
    parser.prog = f"run_stage_{stage}.py"
    parser.usage = f"run_stage_{stage}.py CONFIG.json [--field value ...]  |  run_stage_{stage}.py --field value ..."
    return parser.format_help()
