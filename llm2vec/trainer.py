"""The Hugging Face Trainer, adapted once for both stages.

- Data order: the dataset is pre-arranged so that each optimizer step's global batch comes from one
  source (``llm2vec.dataset.arrange_global_batches``); the sampler is therefore sequential, and
  accelerate deals consecutive per-device batches to the ranks in turn.
- ``compute_loss`` is one call of the (DDP/FSDP-wrapped) model's forward, so gradients synchronise.
- Stage I token averaging: when the model defines ``count_targets``, the number of target tokens of each
  direction is summed over every micro-batch of the optimizer step and over all ranks before the step
  starts, and passed to the forward as ``target_counts``. Each micro-batch then contributes
  ``sum of its token NLLs / global count``; the trainer's own division by the accumulation steps is
  switched off, and the loss is multiplied by the number of processes because DDP averages gradients
  over ranks. The result is exactly the gradient of the token mean over the whole global batch.
- Checkpoints hold the model in its own format (a full causal LM, or a LoRA adapter), the tokenizer,
  ``llm2vec_config.json`` and the resolved run config (``run_config.json``).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file
from torch.utils.data import SequentialSampler
from transformers import Trainer

from .llm2vec import CONFIG_NAME

RUN_CONFIG_NAME = "run_config.json"


class LLM2VecTrainer(Trainer):
    def __init__(self, *args, run_config: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_config = run_config or {}
        self._target_counts = None
        self._component_sums: dict[str, torch.Tensor] = {}
        self._component_steps = 0

    # ------------------------------------------------------------------ data order

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    # ------------------------------------------------------------------ loss

    def _llm2vec(self):
        return self.accelerator.unwrap_model(self.model)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._component_steps += 1
        counter = getattr(self._llm2vec(), "count_targets", None)
        if counter is not None and batch_samples:
            per_batch = [counter(b) for b in batch_samples]
            local = torch.stack([sum(c[k] for c in per_batch) for k in sorted(per_batch[0])]).to(device)
            total = self.accelerator.reduce(local, reduction="sum") if self.accelerator.num_processes > 1 else local
            self._target_counts = {k: total[i] for i, k in enumerate(sorted(per_batch[0]))}
            self.loss_is_scaled_for_ga = True
        return batch_samples, num_items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._target_counts is not None:
            outputs = model(**inputs, target_counts=self._target_counts)
            scale = self.accelerator.num_processes
        else:
            outputs = model(**inputs)
            scale = 1
        if model.training:
            self._accumulate_components(outputs, scale)
        loss = outputs.loss * scale
        return (loss, outputs) if return_outputs else loss

    def _accumulate_components(self, outputs, scale: float) -> None:
        """Running sums of the loss parts for logging (q2d and d2q in Stage I), per optimizer step."""
        for name in ("loss_q2d", "loss_d2q"):
            value = getattr(outputs, name, None)
            if value is not None:
                if self._target_counts is None:  # per-micro-batch means: average over accumulation
                    value = value / self.args.gradient_accumulation_steps
                self._component_sums[name] = self._component_sums.get(name, 0.0) + value.detach() * scale

    def log(self, logs, start_time=None):
        if "loss" in logs and self._component_sums:
            steps = max(1, self._component_steps)
            for name, value in self._component_sums.items():
                value = self.accelerator.reduce(value.clone(), reduction="mean") if self.accelerator.num_processes > 1 else value
                logs[name] = round(value.item() / steps, 6)
            self._component_sums, self._component_steps = {}, 0
        super().log(logs, start_time)

    # ------------------------------------------------------------------ saving and resuming

    def _save(self, output_dir=None, state_dict=None):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        encoder = self._llm2vec()
        if state_dict is not None:  # gathered by FSDP / DeepSpeed: strip the wrapper's "model." prefix
            state_dict = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
        encoder.model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        encoder.tokenizer.save_pretrained(output_dir)
        with open(os.path.join(output_dir, CONFIG_NAME), "w") as f:
            json.dump(encoder.llm2vec_config(), f, indent=2)
        with open(os.path.join(output_dir, RUN_CONFIG_NAME), "w") as f:
            json.dump(self.run_config, f, indent=2)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Load the weights saved by ``_save`` into the wrapped transformers model (strictly)."""
        inner = self._llm2vec().model
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
            raise ValueError(f"{resume_from_checkpoint}: the weights do not match the model "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
