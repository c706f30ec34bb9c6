"""The fields a run config may give, one argument class per concern (both stages' model and data, each stage's own;
:func:`argument_classes` adds transformers' ``TrainingArguments``): a field is its line, its choices (a ``Literal``
type) and the docstring under it (its help); its range is in :data:`llm2vec.config_values.RANGES`."""

from __future__ import annotations

import ast
import inspect
import logging
import os
import textwrap
import typing
from dataclasses import MISSING, Field, dataclass, field
from typing import Any, Literal

from ..compat import TrainingArguments
from ..config_values import ConfigError, check_fields
from ..dataset.hf import check_column_map
from ..loss.reconstruction import RECONSTRUCTION_TARGETS
from ..pooling import POOLING_MODES
from ..templates import TRAINING_SEPARATOR

logger = logging.getLogger("llm2vec")

STAGES = ("I", "II")
DATASETS = ("E5", "jsonl", "hf")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
MASTER_WEIGHTS = ("bf16", "fp32")
ATTENTION = ("flash_attention_2", "sdpa", "eager")
PACKING = ("auto", "true", "false")
TRAINERS = ("llm2vec", "sentence_transformers")  # who trains Stage II: this project's trainer or sentence-transformers'


class Arguments:
    """A dataclass whose fields' help is the docstring under each and choices its ``Literal`` (metadata); a list
    default is copied. Made, each field is among its choices and in its range, or :class:`ConfigError`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        except (OSError, TypeError):  # no source to read (a class typed into a console): fields without help
            body = []
        docs = {
            a.target.id: d.value.value
            for a, d in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(d, ast.Expr) and isinstance(d.value, ast.Constant)
        }
        hints = typing.get_type_hints(cls)
        for name in cls.__dict__.get("__annotations__", {}):
            choices = typing.get_args(hints[name]) if typing.get_origin(hints[name]) is Literal else ()
            metadata = {"help": " ".join(str(docs.get(name, "")).split()), **({"choices": choices} if choices else {})}
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
    """Hub id or folder of the base model: a causal LM for Stage I; a hub id or a Stage I output folder for Stage II."""
    base_model_hub_id: str | None = None
    """Hub id of a local model_name_or_path's weights, for run_config.json and model cards (default: its own)."""
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
    """The weights' dtype; auto: float32, or with bf16 as master_weights says (an explicit value must agree)."""
    trust_remote_code: bool = False
    """Run the code a model folder's config names in its auto_map (false: the model is refused); only code you trust."""
    master_weights: Literal[MASTER_WEIGHTS] = "bf16"
    """bf16 training's precision (DDP, FSDP; docs/scaling.md): bf16 (the authors'), bfloat16 weights, gradients and
    AdamW states; fp32, float32 master weights and AdamW states under bf16 autocast. Ignored without bf16."""

    @property
    def use_packing(self) -> bool | str:
        """:class:`llm2vec.LLM2Vec`'s ``packing``: ``True``, ``False`` or ``"if_exact"`` (auto, flash_attention_2)."""
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
    """E5 (the paper's: a <source>.jsonl per source), jsonl (your files) or hf (Hugging Face datasets; docs/data.md)."""
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
    """Prepend each query's instruction (E5: its source's Table 6 one; jsonl, hf: the line's or default_instruction),
    as the authors do (true), or train on bare queries. Never on documents nor in Stage I's text targets."""
    instruction_separator: str = TRAINING_SEPARATOR
    """Joins a query's instruction and text in training: '; ' (the authors'; evaluation: ': '); keep the final space."""
    column_map: dict[str, Any] | None = None
    """hf: the column of each role (query, positive, negative, instruction), for every dataset ({"query":
    "question"}) or by source ({"nq": {"query": "q"}}); unmapped roles keep their name (docs/data.md)."""
    dataset_split: str = "train"
    """hf: the split read from a DatasetDict save_to_disk folder or a dataset id."""
    validation_file: str | None = None
    """Held-out pairs (a JSON-lines file of the training layout) evaluated every eval_steps; Stage I logs their
    reconstruction loss and the anchor's information gain (llm2vec.anchor_gain). Not with validation_size."""
    validation_size: float = 0
    """Hold out this many training examples (>= 1) or this share (< 1) as validation pairs, untrained; 0: none."""
    retrieval_eval_dirs: list[str] | None = None
    """BEIR-layout retrieval folders (corpus, queries, qrels .jsonl) scored at each evaluation: nDCG@10, MRR@10 and
    Recall@100 logged as eval_<folder name>_ndcg_at_10 etc., their means as eval_beir_mean_* (llm2vec.retrieval)."""
    retrieval_eval_instruction: str | None = None
    """The query instruction of the retrieval folders that retrieval_eval_instructions does not name ('' for none)."""
    retrieval_eval_instructions: dict[str, str] | None = None
    """Query instructions by retrieval folder name, e.g. {"NanoNQ": "Given a question, retrieve Wikipedia passages"}."""

    def __post_init__(self):
        super().__post_init__()
        if self.validation_size >= 1 and self.validation_size != int(self.validation_size):
            raise ConfigError(f"validation_size={self.validation_size}: must be a fraction in (0, 1) or a count")
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
        """``(folder, query instruction)`` of each ``retrieval_eval_dirs`` folder, or :class:`ConfigError`."""
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


@dataclass
class _StageArguments(Arguments):
    stage: Literal[STAGES] = ""
    """The stage this config is for (I or II); the driver of the other stage refuses it."""
    total_batch_size: int | None = None
    """Expected global batch (per-device batch x processes x gradient accumulation), checked at start-up."""
    stop_after_n_steps: int | None = None
    """End training after this many optimizer steps and save the final model (the paper: 2000 in Stage I, 1000 in
    II); the schedule still spans num_train_epochs, as the authors' (lr_schedule); max_steps ends it there."""
    stop_after_minutes: float | None = None
    """End training at the first step ending this many minutes after the start (for a wall-clock limit); save there."""
    metrics_file: str | None = None
    """Append each logged entry to this JSON-lines file as logged (a killed run keeps its curve); not in output_dir."""
    overwrite_output_dir: bool = False
    """Replace the run in output_dir (its files and checkpoints only); without it, refused (docs/run_safety.md)."""
    accept_changed_inputs: bool = False
    """Resume although the checkpoint's settings (but those of logging, saving, evaluation, launch), data, base
    model, adapter or batch geometry changed, recording each change (resumed_with_changes); else refused."""
    num_threads: int | None = None
    """CPU threads of torch (1 to 1024; bit-identical CPU results need the same); default: torch's own."""

    STAGE = ""

    def __post_init__(self):
        self.stage = self.stage or self.STAGE
        super().__post_init__()

    def check(self, args: TrainingArguments) -> None:
        """Stage-specific start-up checks against the training arguments (may warn)."""


@dataclass
class StageIArguments(_StageArguments):
    """Stage I: bidirectional reconstruction (EBQ2D + EBD2Q), full-parameter."""

    STAGE = "I"
    require_negative = False  # Stage I trains on (query, positive) pairs; a class attribute, not a field
    alpha: float = 0.2
    """L = alpha * L_Q2D + (1 - alpha) * L_D2Q (paper's Eq. 5: 0.2). 1 = OnlyQ2D, 0 = OnlyD2Q."""
    reconstruction_targets: Literal[RECONSTRUCTION_TARGETS] = "text"
    """Tokens each direction predicts. text (the paper's Eq. 3-4): the counterpart's text tokens. all: every token of
    the counterpart's prompt but its anchor (BOS, chat header, a query's instruction and separator, the text, closing
    tokens before the anchor). In both, every target is visible to attention and the anchor sits at position 0 with the
    targets at 1..m. Neither is the authors' pass: theirs predicts every token not equal to the EOS id (BOS, header and
    instruction too) but reuses the encoder's instruction-skipping mask, which hides BOS, the header and a query's
    instruction from attention under FlashAttention, and passes no position ids, so the anchor stands before the left
    padding at a RoPE distance from the text that varies per row (docs/departures.md)."""
    token_budget: int = 0
    """Most decoder positions of a pass (0: off): the batch goes in chunks, same loss and gradient (docs/scaling.md)."""
    logit_chunk_rows: int = 0
    """LM-head logits and loss this many target rows at a time, recomputed in backward (0: all; on CUDA: Liger's)."""
    reconstruction_input_dropout: float = 0.0
    """Not the paper's (0): zero this share of the reconstruction pass's teacher-forced inputs (docs/demo.md)."""
    reconstruction_prefix: str = ""
    """Not the paper's (empty): a text the reconstruction pass reads before the anchor, moving it off position 0."""
    stop_decoder_gradient: bool = False
    """Not the paper's: reconstruct with detached decoder weights, training only through the anchor; not with FSDP."""

    def collator_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`llm2vec.collator.TrainCollator` for this stage."""
        return {"reconstruction": self.reconstruction_targets}


@dataclass
class StageIIArguments(_StageArguments):
    """Stage II: LoRA contrastive fine-tuning (InfoNCE with in-batch and hard negatives)."""

    STAGE = "II"
    peft_model_name_or_path: str | None = None
    """A LoRA adapter merged into the base model before the new adapters are added."""
    accept_other_base: bool = False
    """Merge peft_model_name_or_path though its run config names another base (same shape): warned, not refused."""
    loss_scale: float = 20.0
    """InfoNCE scale = 1 / tau (paper: tau = 0.05, so 20; the authors' code defaults to 50)."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA alpha (the authors' code: 2 x rank)."""
    lora_dropout: float = 0.05
    """LoRA dropout."""
    lora_target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names of the linear modules that get LoRA adapters."""
    require_negative: bool = True
    """Train with hard negatives, which every example must have (true, the paper's), or with in-batch ones only."""
    embedding_token_budget: int = 0
    """Gradient cache (0: off): most tokens of a chunk, >= max_seq_length; same loss and gradient (docs/scaling.md)."""
    trainer: Literal[TRAINERS] = "llm2vec"
    """Who trains Stage II: llm2vec (the paper's path) or sentence_transformers (with its loss; docs/training.md)."""
    loss: str = "CachedMultipleNegativesRankingLoss"
    """trainer sentence_transformers: a sentence_transformers.sentence_transformer.losses loss (scale: loss_scale)."""
    loss_kwargs: dict[str, Any] | None = None
    """trainer sentence_transformers: the loss's arguments as a JSON object, e.g. {"mini_batch_size": 32}; a wrapping
    loss names the one it wraps: {"loss": ..., "loss_kwargs": {...}, "matryoshka_dims": [...]}."""

    def __post_init__(self):
        super().__post_init__()
        if self.trainer != "sentence_transformers":
            for name, default in (("loss", "CachedMultipleNegativesRankingLoss"), ("loss_kwargs", None)):
                if getattr(self, name) not in (default, {}):
                    raise ConfigError(
                        f"{name} is read only with trainer sentence_transformers (this config: trainer "
                        f"{self.trainer}); drop it or set trainer sentence_transformers"
                    )
        elif self.loss_kwargs is not None and not isinstance(self.loss_kwargs, dict):
            raise ConfigError(f"loss_kwargs={self.loss_kwargs!r}: give a JSON object of the loss's arguments")
        if not self.lora_target_modules:
            raise ConfigError("lora_target_modules is empty: name the linear modules that get adapters")

    def collator_options(self) -> dict[str, Any]:
        return {"with_negative": self.require_negative}

    def check(self, args: TrainingArguments) -> None:
        """Gradient accumulation splits the contrastive batch: negatives come from one micro-batch only."""
        micro, steps = args.per_device_train_batch_size * args.world_size, args.gradient_accumulation_steps
        if steps > 1:
            logger.warning(
                f"gradient_accumulation_steps = {steps}: each optimizer step covers {micro * steps} examples, but "
                f"InfoNCE sees the {micro} examples of one micro-batch (per_device_train_batch_size "
                f"{args.per_device_train_batch_size} x {args.world_size} process(es)) as each query's in-batch "
                "negatives; raise per_device_train_batch_size or the processes instead (embedding_token_budget bounds "
                "the memory of a large per-device batch)."
            )


STAGE_ARGUMENTS: dict[str, type[_StageArguments]] = {"I": StageIArguments, "II": StageIIArguments}


def argument_classes(stage: str) -> tuple[type, ...]:
    if stage not in STAGES:
        raise ConfigError(f"stage={stage!r}: choose one of {', '.join(STAGES)}")
    return (ModelArguments, DataArguments, STAGE_ARGUMENTS[stage], TrainingArguments)
