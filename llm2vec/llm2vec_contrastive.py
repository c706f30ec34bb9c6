"""Stage II model: the encoder (with LoRA adapters) trained by InfoNCE (paper Sec. 3.3, Eq. 6-7)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from .chunked_steps import gradient_cache_step
from .compat import peft_reads_deprecated_property
from .llm2vec import LLM2Vec
from .loss.infonce import InfoNCELoss
from .validation import contrastive_validation

logger = logging.getLogger("llm2vec")


@dataclass
class ContrastiveOutput:
    loss: torch.Tensor
    query_embedding: torch.Tensor
    positive_embedding: torch.Tensor
    negative_embedding: torch.Tensor | None
    loss_parts: dict[str, torch.Tensor] = field(default_factory=dict)  # one loss, no parts


class LLM2VecContrastive(LLM2Vec):
    """``LLM2Vec`` whose forward on (query, positive[, negative]) returns the Stage II InfoNCE loss.

    Args:
        model, tokenizer, **kwargs: as for :class:`LLM2Vec` (the model is usually a ``peft.PeftModel``).
        loss_scale: InfoNCE scale = 1 / tau (paper: tau = 0.05, scale 20).
        embedding_token_budget: 0 (the plain step), or the most tokens of one chunk of the gradient cache.
    """

    def __init__(self, model, tokenizer, loss_scale: float = 20.0, embedding_token_budget: int = 0, **kwargs):
        super().__init__(model, tokenizer, **kwargs)
        self.loss_fn = InfoNCELoss(scale=loss_scale)
        if embedding_token_budget < 0:
            raise ValueError(f"embedding_token_budget must be >= 0 (0: off), got {embedding_token_budget}")
        self.embedding_token_budget = int(embedding_token_budget)

    @classmethod
    def build(cls, model_args, stage_args, dtype: torch.dtype) -> LLM2VecContrastive:
        """The Stage II model of a run config: the decoder body with ``peft_model_name_or_path`` merged into it,
        and fresh trainable LoRA adapters; everything else frozen."""
        model = cls.load(
            model_args.model_name_or_path,
            stage_args.peft_model_name_or_path,
            merge_peft=True,
            pooling_mode=model_args.pooling_mode,
            max_length=model_args.max_seq_length,
            template=model_args.template,
            dtype=dtype,
            attn_implementation=model_args.attn_implementation,
            loss_scale=stage_args.loss_scale,
            embedding_token_budget=stage_args.embedding_token_budget,
            packing=model_args.use_packing,
            trust_remote_code=model_args.trust_remote_code,
            accept_other_base=stage_args.accept_other_base,
        )
        model.model = add_lora(model.model, lora_config(stage_args))
        return model

    def describe(self) -> str:
        text = f"template {self.template.name}, loss scale {self.loss_fn.scale:g} (tau {1 / self.loss_fn.scale:.3f})"
        if hasattr(self.model, "get_nb_trainable_parameters"):
            trainable, total = self.model.get_nb_trainable_parameters()
            config = next(iter(self.model.peft_config.values()))
            text += (
                f"; LoRA r {config.r} / alpha {config.lora_alpha} / dropout {config.lora_dropout} on "
                f"{','.join(sorted(config.target_modules))}; trainable parameters {trainable} of {total} "
                f"({100.0 * trainable / total:.4f}%)"
            )
        if self.embedding_token_budget:
            counted = "real" if self.packing else "padded"
            text += f"; gradient cache, chunks of at most {self.embedding_token_budget} {counted} tokens"
        return text

    def forward(
        self,
        query: dict | None = None,
        positive: dict | None = None,
        negative: dict | None = None,
        *,
        features: dict | None = None,
    ) -> ContrastiveOutput | torch.Tensor:
        """The loss of (query, positive[, negative]) features; given ``features`` alone, their embeddings (B, H)."""
        if features is not None:
            return self.embed(features)
        sides = [query, positive] + ([negative] if negative is not None else [])
        e_q, e_p, *rest = self.embed_many(sides)  # one packed call with packing, else one call per side
        e_n = rest[0] if rest else None
        return ContrastiveOutput(self.loss_fn(e_q, e_p, e_n), e_q, e_p, e_n)

    def validation_metrics(self, model, triples, collate, args) -> dict[str, float]:
        """What the trainer logs at each evaluation (``model``: this model as the trainer wraps it): the validation
        InfoNCE loss over batches of the training loss's size and the retrieval metrics (:mod:`llm2vec.validation`);
        hard negatives join the loss when every validation triple has one."""
        with_negative = all(t.negative for t in triples)
        if getattr(collate, "with_negative", with_negative) != with_negative:
            collate = dataclasses.replace(collate, with_negative=with_negative)
        return contrastive_validation(
            model,
            triples,
            collate,
            batch_size=args.per_device_eval_batch_size,
            contrastive_batch=args.per_device_train_batch_size * args.world_size,
            scale=self.loss_fn.scale,
            device=args.device,
        )

    def step_in_parts(self, model, inputs: dict, backward, no_sync) -> ContrastiveOutput | None:
        """One step with the gradient cache (:mod:`llm2vec.chunked_steps`); ``None`` (the plain step): no budget."""
        if self.embedding_token_budget <= 0:
            return None
        loss, by_side = gradient_cache_step(
            model, inputs, self.embedding_token_budget, self.packing, self.loss_fn, self.pad_token_id, backward, no_sync
        )
        return ContrastiveOutput(loss, by_side["query"], by_side["positive"], by_side.get("negative"))


def lora_config(stage):
    """The paper's LoRA from a Stage II config's ``lora_*`` fields, for the decoder body as a feature extractor."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        r=stage.lora_r,
        lora_alpha=stage.lora_alpha,
        lora_dropout=stage.lora_dropout,
        target_modules=list(stage.lora_target_modules),
        bias="none",
        task_type=TaskType.FEATURE_EXTRACTION,
    )


def add_lora(model, lora):
    """``model`` with trainable LoRA adapters of ``lora`` (a ``peft.LoraConfig``); targets the model lacks are a
    warning (Phi-3 fuses q/k/v), none that it has a :class:`~llm2vec.arguments.ConfigError`."""
    from peft import get_peft_model

    from .arguments import ConfigError

    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_linear(m)} - {"lm_head"})
    missing = sorted(set(lora.target_modules) - set(linear))
    problem = (
        f"lora_target_modules: {', '.join(missing)} not among this {model.config.model_type} model's linear modules "
        f"({', '.join(linear)})"
    )
    if missing and set(missing) == set(lora.target_modules):
        raise ConfigError(f"{problem}; set lora_target_modules to those that get adapters")
    if missing:
        logger.warning("%s: adapters on the others only", problem)
    with peft_reads_deprecated_property():
        return get_peft_model(model, lora)


def _is_linear(module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"  # GPT-2's linear layers
