"""The fields of one stage: :class:`StageIArguments` and :class:`StageIIArguments` on :class:`_StageArguments`;
:func:`argument_classes` gives a stage's four argument classes, transformers' ``TrainingArguments`` last."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..compat import TrainingArguments
from ..config_values import MAX_PARALLEL
from ..loss.reconstruction import RECONSTRUCTION_TARGETS
from .shared import STAGES, ConfigError, DataArguments, ModelArguments, _choice

logger = logging.getLogger("llm2vec")

TRAINERS = ("llm2vec", "sentence_transformers")
"""Who trains Stage II (``trainer``): this project's trainer (the paper's path) or sentence-transformers'."""


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
    stop_after_minutes: float | None = field(
        default=None,
        metadata={
            "help": "End training at the first optimizer step that ends this many minutes (wall clock) after the run "
            "started, model loading included; evaluate there when an evaluation is configured and save the final "
            "model, as stop_after_n_steps does. For a job with a wall-clock limit. The learning-rate schedule is "
            "not shortened; trainer_state.json's log records the step and the minutes (stopped_by). Default: no "
            "time limit."
        },
    )
    metrics_file: str | None = field(
        default=None,
        metadata={
            "help": "Append every logged entry (training loss, learning rate, evaluation measures, with its step) "
            "to this JSON-lines file as it is logged, so that a run killed at any point leaves its curve "
            "(trainer_state.json is written only with each checkpoint and the final model). Not inside "
            "output_dir, whose files are the run's saves. Default: none."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Replace the run already in output_dir: once the start-up checks pass, the files it recorded as its "
            "own (its completion marker lists them) and its checkpoints are deleted, nothing else. Without it, a "
            "run refuses to start in a folder that holds a finished model, checkpoints or other files; "
            "--resume_from_checkpoint true continues that run instead. Never: an output_dir that is, lies inside or "
            "contains an input or another run's folder, or that holds a file of yours the run would write over "
            "(say a README.md)."
        },
    )
    accept_changed_inputs: bool = field(
        default=False,
        metadata={
            "help": "Resume although what the checkpoint was trained with changed: a training setting (say alpha or "
            "max_seq_length; not the fields that only say how the run is logged, saved, evaluated or launched, "
            "llm2vec.run.plan.RESUME_FREE_FIELDS), the data files, the base model (or adapter) or the batch "
            "geometry (per-device batch, processes, accumulation). Without it such a resume is refused with what "
            "differs (each run records its settings and the size, modification time and a hash of the first MiB "
            "of every input file in run_config.json); with it, run_config.json records each change, its values "
            "before and after and the step from which it holds (resumed_with_changes), and so does the model card."
        },
    )
    num_threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads of torch (torch.set_num_threads) for this run, 1 to 1024. Float sums split among threads round "
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
        if self.stop_after_minutes is not None and not 0 < self.stop_after_minutes < float("inf"):
            raise ConfigError(f"stop_after_minutes={self.stop_after_minutes}: must be a positive number of minutes")
        if self.num_threads is not None and not 1 <= self.num_threads <= MAX_PARALLEL:
            raise ConfigError(f"num_threads={self.num_threads}: must be from 1 to {MAX_PARALLEL} (or leave it unset)")

    def collator_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`llm2vec.collator.TrainCollator` for this stage."""
        raise NotImplementedError

    def check(self, args: TrainingArguments, source: str) -> None:
        """Stage-specific start-up checks against the training arguments (may warn)."""

    def check_metrics_file(self, output_dir: str, source: str) -> None:
        """``metrics_file`` lies outside ``output_dir`` (whose files are the run's saves, or the user's)."""
        if self.metrics_file is None:
            return
        out, path = os.path.realpath(output_dir), os.path.realpath(self.metrics_file)
        if os.path.commonpath([out, path]) == out:
            raise ConfigError(
                f"{source}: metrics_file {self.metrics_file} is inside output_dir {output_dir}; give a path outside "
                "it (for example beside it)"
            )


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
    accept_other_base: bool = field(
        default=False,
        metadata={
            "help": "Merge peft_model_name_or_path although its run_config.json records another base model than "
            "model_name_or_path (same shape, other weights: llm2vec.model_files.check_adapter); without it such an "
            "adapter is refused before anything loads. With it, a warning."
        },
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

    trainer: str = field(
        default="llm2vec",
        metadata={
            "help": "Who trains Stage II. llm2vec (the paper's path): this project's trainer and InfoNCE. "
            "sentence_transformers: sentence-transformers' SentenceTransformerTrainer and the loss named by loss, on "
            "this project's model (its export's tokenization and anchor pooling), data, LoRA and run folder; the "
            "saves are a Stage II run's (llm2vec.st_training, docs/training.md).",
            "choices": TRAINERS,
        },
    )
    loss: str = field(
        default="CachedMultipleNegativesRankingLoss",
        metadata={
            "help": "trainer sentence_transformers: the name of a loss of sentence_transformers.sentence_transformer."
            "losses (e.g. CachedMultipleNegativesRankingLoss, CachedGISTEmbedLoss, MatryoshkaLoss). Its scale "
            "defaults to loss_scale."
        },
    )
    loss_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "trainer sentence_transformers: the loss's arguments as a JSON object, e.g. "
            '{"mini_batch_size": 32}; a wrapping loss (MatryoshkaLoss) names the wrapped one: {"loss": '
            '"CachedMultipleNegativesRankingLoss", "loss_kwargs": {...}, "matryoshka_dims": [2048, 512]}; a GIST '
            "loss's guide is a model folder, or the model itself when absent."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        _choice("trainer", self.trainer, TRAINERS)
        if self.trainer != "sentence_transformers":
            defaults = (
                ("loss", self.loss, "CachedMultipleNegativesRankingLoss"),
                ("loss_kwargs", self.loss_kwargs, None),
            )
            for name, value, default in defaults:
                if value not in (default, {}):
                    raise ConfigError(
                        f"{name} is read only with trainer sentence_transformers (this config: trainer {self.trainer}); "
                        "drop it or set trainer sentence_transformers"
                    )
        elif self.loss_kwargs is not None and not isinstance(self.loss_kwargs, dict):
            raise ConfigError(f"loss_kwargs={self.loss_kwargs!r}: give a JSON object of the loss's arguments")
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
            f"gradient_accumulation_steps = {args.gradient_accumulation_steps}: each optimizer step covers {total} "
            f"examples, but InfoNCE only sees the {micro} examples of one micro-batch (per_device_train_batch_size "
            f"{args.per_device_train_batch_size} x {args.world_size} process(es)), so each query has {micro - 1} "
            f"in-batch positives of other queries (plus hard negatives) as negatives instead of {total - 1}. Raise "
            "per_device_train_batch_size or the number of processes to keep the whole batch in one step "
            "(embedding_token_budget bounds the memory of a large per-device batch)."
        )


STAGE_ARGUMENTS: dict[str, type[_StageArguments]] = {"I": StageIArguments, "II": StageIIArguments}


def argument_classes(stage: str) -> tuple[type, ...]:
    _choice("stage", stage, STAGES)
    return (ModelArguments, DataArguments, STAGE_ARGUMENTS[stage], TrainingArguments)
