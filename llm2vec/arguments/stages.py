"""The fields of one stage: :class:`StageIArguments` and :class:`StageIIArguments` on :class:`_StageArguments`;
:func:`argument_classes` gives a stage's four argument classes, transformers' ``TrainingArguments`` last."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from ..compat import TrainingArguments
from ..config_values import ConfigError
from ..loss.reconstruction import RECONSTRUCTION_TARGETS
from .shared import STAGES, Arguments, DataArguments, ModelArguments

logger = logging.getLogger("llm2vec")

TRAINERS = ("llm2vec", "sentence_transformers")  # who trains Stage II: this project's trainer or sentence-transformers'


@dataclass
class _StageArguments(Arguments):
    stage: Literal[STAGES] = ""
    """The stage this config is for (I or II); the driver of the other stage refuses it."""
    total_batch_size: int | None = None
    """Expected global batch (per-device batch x processes x gradient accumulation), checked at start-up."""
    stop_after_n_steps: int | None = None
    """End training after this many optimizer steps and save the final model there (the paper: 2000 in Stage I, 1000 in
    Stage II). The schedule still spans num_train_epochs, as in the authors' runs, so the rate at the stop is most of
    its peak (run_config.json's lr_schedule); max_steps ends the schedule there instead."""
    stop_after_minutes: float | None = None
    """End training at the first optimizer step that ends this many minutes after the run started (a job with a
    wall-clock limit), evaluating and saving the final model there; the log records the stop (stopped_by)."""
    metrics_file: str | None = None
    """Append every logged entry (losses, learning rate, evaluations) to this JSON-lines file as it is logged, so that a
    killed run leaves its curve. Not inside output_dir."""
    overwrite_output_dir: bool = False
    """Replace the run in output_dir (its own files and checkpoints, nothing else) once the start-up checks pass;
    without it a folder that holds a run or other files is refused (docs/run_safety.md)."""
    accept_changed_inputs: bool = False
    """Resume although the checkpoint's settings (but those of logging, saving, evaluation and launch), data files, base
    model, adapter or batch geometry changed, recording each change (resumed_with_changes); without it such a resume is
    refused naming what differs."""
    num_threads: int | None = None
    """CPU threads of torch for this run (1 to 1024); bit-identical CPU results need the same in both runs. Default:
    torch's own."""

    STAGE = ""

    def __post_init__(self):
        self.stage = self.stage or self.STAGE
        super().__post_init__()

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
    """Most decoder positions of one forward/backward pass (padded; real ones with packing); 0: off. The per-device
    batch is cut into chunks under it, with the same loss and gradient (docs/scaling.md)."""
    logit_chunk_rows: int = 0
    """Compute the LM head's logits and cross-entropy this many target rows at a time, recomputed in backward (0: all at
    once); on CUDA with the liger extra, Liger's fused kernel instead."""
    reconstruction_input_dropout: float = 0.0
    """Not the paper's (0): in training, replace this share of the reconstruction pass's teacher-forced inputs by zero
    vectors, so the decoder has to read the anchor (docs/demo.md)."""
    reconstruction_prefix: str = ""
    """Not the paper's (empty): a text the reconstruction pass reads before the anchor, so the anchor is not at position
    0, e.g. '<|im_start|>'."""
    stop_decoder_gradient: bool = False
    """Not the paper's (false): the reconstruction pass runs the decoder with detached weights, so its losses train the
    encoding only, through the anchor (docs/demo.md). Not with FSDP."""

    def collator_options(self) -> dict[str, Any]:
        return {"reconstruction": self.reconstruction_targets}


@dataclass
class StageIIArguments(_StageArguments):
    """Stage II: LoRA contrastive fine-tuning (InfoNCE with in-batch and hard negatives)."""

    STAGE = "II"
    peft_model_name_or_path: str | None = None
    """A LoRA adapter merged into the base model before the new adapters are added."""
    accept_other_base: bool = False
    """Merge peft_model_name_or_path although its run_config.json records another base model (same shape), with a
    warning; without it such an adapter is refused."""
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
    """Train with hard negatives, which every example must then have (true, the paper's), or with in-batch negatives
    only."""
    embedding_token_budget: int = 0
    """Gradient cache: the most tokens of one chunk (padded; real ones with packing), at least max_seq_length; 0: off.
    The same loss and gradient for two forward passes (docs/scaling.md)."""
    trainer: Literal[TRAINERS] = "llm2vec"
    """Who trains Stage II: llm2vec (the paper's path) or sentence_transformers (its trainer and the loss named by loss,
    on this project's model, data and run folder; docs/training.md)."""
    loss: str = "CachedMultipleNegativesRankingLoss"
    """trainer sentence_transformers: the name of a loss of sentence_transformers.sentence_transformer.losses; its scale
    defaults to loss_scale."""
    loss_kwargs: dict[str, Any] | None = None
    """trainer sentence_transformers: the loss's arguments as a JSON object, e.g. {"mini_batch_size": 32}; a wrapping
    loss names the one it wraps: {"loss": ..., "loss_kwargs": {...}, "matryoshka_dims": [...]}."""

    def __post_init__(self):
        super().__post_init__()
        if self.trainer != "sentence_transformers":
            for name, default in (("loss", "CachedMultipleNegativesRankingLoss"), ("loss_kwargs", None)):
                if getattr(self, name) not in (default, {}):
                    raise ConfigError(
                        f"{name} is read only with trainer sentence_transformers (this config: trainer {self.trainer}); "
                        "drop it or set trainer sentence_transformers"
                    )
        elif self.loss_kwargs is not None and not isinstance(self.loss_kwargs, dict):
            raise ConfigError(f"loss_kwargs={self.loss_kwargs!r}: give a JSON object of the loss's arguments")
        if not self.lora_target_modules:
            raise ConfigError("lora_target_modules is empty: name the linear modules that get adapters")

    def collator_options(self) -> dict[str, Any]:
        return {"with_negative": self.require_negative}

    def check(self, args: TrainingArguments, source: str) -> None:
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
