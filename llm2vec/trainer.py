"""The Hugging Face Trainer, adapted once for every model of this package; it knows no stage by name.

Contract: ``model(**batch)`` returns ``loss``, ``loss_parts`` and optionally ``metrics``; each micro-batch's loss is
weighted over the step's token counts (:func:`llm2vec.collator.loss_weight`); a model with ``step_in_parts`` runs its
own chunked step; a non-finite loss or gradient norm stops the run (:class:`TrainingDiverged`)."""

from __future__ import annotations

import json
import math
import os

import torch
from accelerate.utils import send_to_device
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import Trainer

from .chunked_steps import trainer_hooks
from .collator import loss_weight, step_counts
from .compat import TRAINER_READS_LOSS_IS_SCALED_FOR_GA
from .model_card import write_training_card
from .run import RUN_CONFIG_NAME, CheckpointError, newest_checkpoint, staged_checkpoint

# The private methods of transformers' Trainer that LLM2VecTrainer overrides: name -> (the Trainer's signature they
# were written against; why no public hook does the work). tests/test_upstream.py checks both against transformers.
PRIVATE_OVERRIDES: dict[str, tuple[str, str]] = {
    "_get_grad_norm": (
        "(self, model, grad_norm=None)",
        "the step's finite check needs the Trainer's gradient norm before optimizer.step(); on_pre_optimizer_step is "
        "not given it, and computed again after clipping it would differ",
    ),
    "_save": (
        "(self, output_dir=None, state_dict=None)",
        "the encoder's files, run_config.json and the card (FSDP/DeepSpeed state dict gathered by save_model) must be "
        "in a checkpoint before it is published; on_save comes after",
    ),
    "_save_checkpoint": (
        "(self, model, trial)",
        "checked finite, staged and renamed into place (run.staged_checkpoint): no hook runs before and after",
    ),
    "_load_from_checkpoint": (
        "(self, resume_from_checkpoint, model=None)",
        "checkpoints hold the encoder's own files (LLM2Vec.save), loaded strictly, a misfit reported in one line",
    ),
}


class TrainingDiverged(RuntimeError):
    """The loss, a loss part, the gradient norm or the weights became non-finite; the run stopped there."""


def first_line(error: BaseException, limit: int = 300) -> str:
    """An error's message on one line: its first line, and the next one when the first ends in a colon (torch's
    "Error(s) in loading state_dict for ...:" names the problem below it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    text = lines[0] + (f" {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def save_run(trainer, encoder, output_dir=None, state_dict=None) -> None:
    """A stage's save into ``output_dir`` (default: the trainer's): ``encoder.save``, ``run_config.json`` and the
    model card; nothing on a process that does not save."""
    output_dir = output_dir if output_dir is not None else trainer.args.output_dir
    if not trainer.args.should_save:
        return
    encoder.save(output_dir, state_dict=state_dict)
    with open(os.path.join(output_dir, RUN_CONFIG_NAME), "w") as f:
        json.dump(trainer.run_config, f, indent=2)
    write_training_card(output_dir, trainer.run_config, trainer.state.log_history, encoder, trainer.state.global_step)


class LLM2VecTrainer(Trainer):
    # The loss is weighted over the whole step already (llm2vec.collator.loss_weight), so the Trainer must not divide
    # it by the accumulation steps: transformers >= 5.19 reads this attribute; before 5.19 it skips the division only
    # when model_accepts_loss_kwargs (set in __init__) and num_items_in_batch is not None (set in training_step).
    loss_is_scaled_for_ga = True

    def __init__(self, *args, run_config: dict | None = None, retrieval_evaluation=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.retrieval_evaluation = retrieval_evaluation  # a llm2vec.retrieval.RetrievalEvaluation, or None
        self.args.train_sampling_strategy = "sequential"  # pre-arranged (llm2vec.dataset.arrange_global_batches)
        if not TRAINER_READS_LOSS_IS_SCALED_FOR_GA:  # see loss_is_scaled_for_ga
            self.model_accepts_loss_kwargs = True
        self.run_config = run_config or {}
        self._part_sums, self._part_steps, self._metric_sums = {}, 0, {}  # since the last log
        self._step_loss, self._step_parts = 0.0, {}  # this optimizer step's, for the finite check

    def _encoder(self):
        return self.accelerator.unwrap_model(self.model)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The micro-batches of one optimizer step, each with the step's summed token counts
        (:func:`llm2vec.collator.step_counts`)."""
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._part_steps += 1
        reduce = (lambda t: self.accelerator.reduce(t, reduction="sum")) if self.accelerator.num_processes > 1 else None
        return step_counts(batches, device, reduce), num_items

    def _loss_weight(self, inputs) -> float:
        return loss_weight(inputs, self.accelerator.num_processes, self.args.gradient_accumulation_steps)

    def _record_parts(self, outputs, weight: float) -> None:
        for name, value in outputs.loss_parts.items():
            self._part_sums[name] = self._part_sums.get(name, 0.0) + value.detach() * weight
            self._step_parts[name] = self._step_parts.get(name, 0.0) + value.detach() * weight
        for name, value in getattr(outputs, "metrics", {}).items():
            total, count = self._metric_sums.get(name, (0.0, 0))
            value = value.detach().float() if isinstance(value, torch.Tensor) else value  # no device sync here
            self._metric_sums[name] = (total + value, count + 1)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs.loss
        if model.training:
            weight = self._loss_weight(inputs)
            loss = loss * weight
            self._record_parts(outputs, weight)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step, or the model's own ``step_in_parts`` when it has one and uses it for this batch;
        either way the micro-batch's weighted loss."""
        if num_items_in_batch is None and not TRAINER_READS_LOSS_IS_SCALED_FOR_GA:
            num_items_in_batch = 1  # see loss_is_scaled_for_ga; compute_loss does not read the count
        loss = self._micro_batch_step(model, inputs, num_items_in_batch)
        self._step_loss = self._step_loss + loss.detach().float()
        return loss

    def _micro_batch_step(self, model, inputs, num_items_in_batch=None):
        step_in_parts = getattr(self._encoder(), "step_in_parts", None)
        if step_in_parts is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = send_to_device(inputs, self.args.device)
        weight = self._loss_weight(inputs)
        with self.compute_loss_context_manager():
            outputs = step_in_parts(model, inputs, *trainer_hooks(self.accelerator, model, weight))
        if outputs is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self._record_parts(outputs, weight)
        return outputs.loss.detach() * weight

    def _get_grad_norm(self, model, grad_norm=None):
        """The Trainer's gradient norm (after the step's last backward, before ``optimizer.step()``), checked finite
        with the step's loss and parts."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        self._check_step_finite(grad_norm)
        return grad_norm

    def _check_step_finite(self, grad_norm) -> None:
        names = ["loss", *sorted(self._step_parts)]
        steps = [self._step_loss, *(self._step_parts[n] for n in names[1:])]
        values = torch.stack(
            [torch.as_tensor(v, dtype=torch.float32, device=self.args.device).reshape(()) for v in steps]
        )
        if self.accelerator.num_processes > 1:  # a NaN on any process makes the sum NaN on all of them
            values = self.accelerator.reduce(values, reduction="sum")
        self._step_loss, self._step_parts = 0.0, {}
        norm = float(grad_norm) if grad_norm is not None else 0.0
        bad = [f"{n} {v}" for n, v in zip([*names, "grad_norm"], [*values.tolist(), norm]) if not math.isfinite(v)]
        if bad:
            self._diverged(
                f"training diverged at step {self.state.global_step + 1}: {', '.join(bad)}; the step was not applied"
            )

    def _diverged(self, what: str) -> None:
        newest = newest_checkpoint(self.args.output_dir)
        last = f"the last finite checkpoint is {newest}" if newest else "no checkpoint was saved before it"
        raise TrainingDiverged(
            f"{what}; no final model or completion marker was written ({last}). Lower learning_rate (now "
            f"{self.args.learning_rate:g}) or raise warmup_steps and start anew with --overwrite_output_dir true"
        )

    def check_weights_finite(self, what: str) -> None:
        """Raise :class:`TrainingDiverged` when any weight (any process's shard) is NaN or infinite."""
        flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in self.model.parameters()]
        ok = torch.stack(flags).all().float() if flags else torch.ones((), device=self.args.device)
        if self.accelerator.num_processes > 1:
            ok = self.accelerator.reduce(ok.to(self.args.device), reduction="sum") / self.accelerator.num_processes
        if float(ok) != 1.0:
            self._diverged(f"the weights hold NaN or infinite values at step {self.state.global_step}; {what}")

    def log(self, logs, start_time=None):
        if "loss" in logs:  # the means since the last log: loss parts per step, metrics per micro-batch
            steps = max(1, self._part_steps)
            sums = {n: (v, steps) for n, v in self._part_sums.items()} | self._metric_sums
            if sums:  # one stack, one collective, one copy to the host
                means = [torch.as_tensor(t / c).float().to(self.args.device).reshape(()) for t, c in sums.values()]
                values = torch.stack(means)
                if self.accelerator.num_processes > 1:
                    values = self.accelerator.reduce(values, reduction="mean")
                logs.update(zip(sums, (round(v, 6) for v in values.tolist())))
            self._part_sums, self._part_steps, self._metric_sums = {}, 0, {}
        super().log(logs, start_time)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The model's own ``validation_metrics(model, pairs, collate, args)`` on the held-out pairs and the scores of the
        retrieval folders, logged as ``eval_<name>`` by every process alike; else the Trainer's loss-only evaluation."""
        measure = getattr(self._encoder(), "validation_metrics", None)
        if measure is None and self.retrieval_evaluation is None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        pairs = list(eval_dataset if eval_dataset is not None else self.eval_dataset or [])
        measured = measure(self.model, pairs, self.data_collator, self.args) if measure and pairs else {}
        if self.retrieval_evaluation is not None:
            batch = self.args.per_device_eval_batch_size
            measured.update(self.retrieval_evaluation(self.model, self._encoder(), batch, self.args.device))
        metrics = {f"{metric_key_prefix}_{k}": round(v, 6) for k, v in measured.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _save(self, output_dir=None, state_dict=None):
        if state_dict is not None:  # gathered by FSDP / DeepSpeed: strip the encoder's "model." prefix
            state_dict = {k[len("model.") :]: v for k, v in state_dict.items() if k.startswith("model.")}
        save_run(self, self._encoder(), output_dir, state_dict)

    def _save_checkpoint(self, model, trial) -> None:  # PRIVATE_OVERRIDES says why (as the three others)
        with staged_checkpoint(self):
            super()._save_checkpoint(model, trial)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        try:
            self._load_weights(resume_from_checkpoint)
        except (OSError, RuntimeError, ValueError, KeyError, SafetensorError) as e:
            raise CheckpointError(
                f"resume_from_checkpoint {resume_from_checkpoint}: cannot load its weights ({first_line(e)}). Resume "
                "from another checkpoint or start anew"
            ) from e

    def _load_weights(self, resume_from_checkpoint):
        inner = self._encoder().model
        adapter = os.path.join(resume_from_checkpoint, "adapter_model.safetensors")
        if os.path.isfile(adapter):
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(inner, load_file(adapter))
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"{adapter}: keys that do not fit this model: {result.unexpected_keys[:5]}")
            return
        index = os.path.join(resume_from_checkpoint, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        state = {}
        for name in files:
            path = os.path.join(resume_from_checkpoint, name)
            if not os.path.isfile(path):
                raise ValueError(f"resume_from_checkpoint: {path} is missing; the checkpoint folder is incomplete")
            state.update(load_file(path))
        missing, unexpected = inner.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(inner.config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"{resume_from_checkpoint}: the weights do not match the model "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
