"""The LLM2Vec encoder: a decoder-only LLM that embeds a text at its appended anchor token."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer

from . import templates
from .collator import pad_batch
from .compat import enable_activation_checkpointing, peft_reads_deprecated_property
from .devices import default_device, resolve_dtype
from .encode_inputs import read_inputs, read_item
from .keywords import strict_booleans
from .load_report import load_backbone
from .model_files import CONFIG_NAME, DEFAULTS, check_model_files, read_llm2vec_config  # noqa: F401 (re-exported)
from .packing import packed_hidden_states
from .pooling import POOLING_MODES, pool, position_ids_from_mask

DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")  # encode_document's default: the first the model has

logger = logging.getLogger(__name__)

Item = tuple[str, str]


def decoder_body(model: nn.Module) -> nn.Module:
    """The module that maps token ids to final-layer hidden states (no LM head), PEFT wrapper or not."""
    if hasattr(model, "get_base_model"):  # a peft.PeftModel
        model = model.get_base_model()
    return model.base_model


class PackingRefused(ValueError):
    """``packing`` asked for a model family that does not declare packed decoder calls exact."""


class LLM2Vec(nn.Module):
    """Text encoder over a decoder-only LLM.

    Args:
        model, tokenizer: a transformers model (``AutoModel``/``AutoModelForCausalLM``, optionally PEFT) and its
            tokenizer.
        pooling_mode: ``eos_token`` (the paper's), ``last_token``, ``mean`` or ``weighted_mean``.
        max_length: the most tokens of one input, template and anchor included.
        template: a registered name, ``"chat_template"`` (derived from the tokenizer), or ``None`` (detected).
        doc_max_length: cut every text to this many tokens before the prompt is added (encoding only).
        packing: packed decoder calls, same embeddings; ``True`` needs a family that declares packing exact
            (a :class:`PackingRefused` otherwise), ``"if_exact"`` packs only for such a family.
        prompts: ``name -> instruction`` for ``encode(prompt_name=...)``, ``encode_query``, ``encode_document``.
        truncate_dim: ``encode`` keeps the first dimensions; more than the hidden size is a ``ValueError``.

    ``doc_max_length``, ``packing`` and ``truncate_dim`` are encoding-time settings, not saved with the model.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        pooling_mode: str = "eos_token",
        max_length: int = 512,
        template: str | None = None,
        doc_max_length: int | None = None,
        packing: bool | str = False,
        prompts: Mapping[str, str] | None = None,
        truncate_dim: int | None = None,
    ):
        super().__init__()
        if pooling_mode not in POOLING_MODES:
            raise ValueError(f"unknown pooling_mode {pooling_mode!r}; choose one of {POOLING_MODES}")
        self.model = model
        self.tokenizer = tokenizer
        self.pooling_mode = pooling_mode
        self.max_length = int(max_length)
        if doc_max_length is not None and int(doc_max_length) < 1:
            raise ValueError(f"doc_max_length must be a positive number of tokens or None, got {doc_max_length}")
        self.doc_max_length = None if doc_max_length is None else int(doc_max_length)
        self.template = templates.resolve_template(
            model.config, tokenizer, template, getattr(model, "generation_config", None)
        )
        self.packing = self._packing(packing)
        if prompts is not None and not (
            isinstance(prompts, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items())
        ):
            raise ValueError(f"prompts must map prompt names to instruction strings, got {prompts!r:.120}")
        self.prompts: dict[str, str] = dict(prompts or {})
        self.truncate_dim = self._checked_truncate_dim(truncate_dim)
        self.pad_token_id = tokenizer.convert_tokens_to_ids(templates.pad_token(tokenizer, self.template))

    def _checked_truncate_dim(self, truncate_dim: int | None) -> int | None:
        """``truncate_dim`` if None or from 1 to the embedding's dimension; else a ``ValueError``."""
        truncate_dim = _positive_or_none("truncate_dim", truncate_dim)
        hidden = decoder_body(self.model).config.hidden_size
        if truncate_dim is not None and truncate_dim > hidden:
            raise ValueError(
                f"truncate_dim={truncate_dim}: the model's embeddings have {hidden} dimensions; give at most "
                f"{hidden}, or None to keep them all"
            )
        return truncate_dim

    def _packing(self, packing: bool | str) -> bool:
        """Whether decoder calls are packed: ``packing`` checked against the family's ``packing_exact``."""
        if packing not in (True, False, "if_exact"):
            raise ValueError(f"packing must be True, False or 'if_exact', got {packing!r}")
        if packing == "if_exact":
            return self.template.packing_exact
        if packing and not self.template.packing_exact:
            raise PackingRefused(
                f"packing: the {self.template.name!r} family does not declare packed decoder calls exact "
                "(packing_exact=False), so a packed row may differ from its texts run alone; set packing false, or "
                "register the family with packing_exact=True once a test shows packed calls equal texts run alone"
            )
        return bool(packing)

    # ------------------------------------------------------------------ loading and saving

    backbone_class = AutoModel  # what load reads a checkpoint with (Stage I, which generates: a causal LM)

    @classmethod
    @strict_booleans
    def load(
        cls,
        base_model_name_or_path: str,
        peft_model_name_or_path: str | None = None,
        merge_peft: bool = True,
        pooling_mode: str | None = None,
        max_length: int | None = None,
        template: str | None = None,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
        accept_other_base: bool = False,
        **kwargs,
    ) -> LLM2Vec:
        """The model of a checkpoint (hub id or folder), optionally with a LoRA adapter, on the CPU; settings from
        the defaults, the base's ``llm2vec_config.json``, the adapter's, then the arguments (``kwargs`` go to the
        constructor). The files are checked first (:func:`llm2vec.model_files.check_model_files`)."""
        check_model_files(base_model_name_or_path, peft_model_name_or_path, trust_remote_code, accept_other_base)
        settings = dict(DEFAULTS)
        saved = {p: read_llm2vec_config(p) for p in (base_model_name_or_path, peft_model_name_or_path) if p}
        for saved_settings in saved.values():
            settings.update(saved_settings)
        if max_length is None and any("max_length" in c for c in saved.values()):
            source = [p for p, c in saved.items() if "max_length" in c][-1]
            logger.info(
                "max_length %s: inherited from %s (the training length); pass max_length= to override",
                settings["max_length"],
                os.path.join(source, CONFIG_NAME),
            )
        given = {
            "pooling_mode": pooling_mode,
            "max_length": max_length,
            "template": template,
            "prompts": kwargs.pop("prompts", None),
        }
        settings.update({k: v for k, v in given.items() if v is not None})

        tokenizer = AutoTokenizer.from_pretrained(base_model_name_or_path, trust_remote_code=trust_remote_code)
        model_kwargs = dict(model_kwargs or {})
        if attn_implementation is not None:
            model_kwargs["attn_implementation"] = attn_implementation
        # without transformers' report of a Stage I model's LM head, which is left out
        model = load_backbone(
            cls.backbone_class,
            base_model_name_or_path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            **model_kwargs,
        )
        if peft_model_name_or_path is not None:
            from peft import PeftModel

            with peft_reads_deprecated_property():
                model = PeftModel.from_pretrained(model, peft_model_name_or_path)
            if merge_peft:
                model = model.merge_and_unload()
        return cls(model, tokenizer, **settings, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        base_model_name_or_path: str,
        peft_model_name_or_path: str | None = None,
        *,
        dtype: str | torch.dtype | None = "auto",
        device: str | torch.device | None = None,
        **kwargs,
    ) -> LLM2Vec:
        """:meth:`load` for inference: on ``device`` (default: the GPU if any), in eval mode, ``dtype`` "auto" as
        :func:`llm2vec.devices.resolve_dtype`."""
        device = torch.device(device) if device is not None else default_device()
        model = cls.load(base_model_name_or_path, peft_model_name_or_path, dtype=resolve_dtype(dtype, device), **kwargs)
        return model.to(device).eval()

    def llm2vec_config(self) -> dict[str, Any]:
        """What ``llm2vec_config.json`` records: pooling, length, template, and the prompts when there are any."""
        config = {"pooling_mode": self.pooling_mode, "max_length": self.max_length, "template": self.template.name}
        return {**config, "prompts": dict(self.prompts)} if self.prompts else config

    @property
    def max_seq_length(self) -> int:
        """sentence-transformers' name for :attr:`max_length` (template, instruction and anchor included)."""
        return self.max_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if _positive_or_none("max_seq_length", value) is None:
            raise ValueError("max_seq_length must be a positive whole number, got None")
        self.max_length = value

    def save(self, path: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Weights (safetensors; a PEFT model's adapter only), tokenizer and ``llm2vec_config.json``; ``state_dict``:
        the wrapped model's weights gathered elsewhere (FSDP, DeepSpeed)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if state_dict is not None:
            state_dict = _without_tied_copy(self.model, state_dict)
        self.model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        with open(path / CONFIG_NAME, "w") as f:
            json.dump(self.llm2vec_config(), f, indent=2)

    @property
    def _no_split_modules(self) -> list[str]:
        """The wrapped model's layer classes, which FSDP's transformer auto-wrap reads (a shard group a layer)."""
        return list(getattr(self.model, "_no_split_modules", None) or [])

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **kwargs) -> None:
        """Activation checkpointing of the wrapped model's layers (the Trainer calls this)."""
        enable_activation_checkpointing(self.model, activation_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs) -> None:
        """The same under the name that the Trainer of transformers < 5.23 calls (:mod:`llm2vec.compat`)."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    # ------------------------------------------------------------------ tokenization and forward

    @staticmethod
    def as_item(x: str | Sequence[str], index: int = 0) -> Item:
        """``("", text)`` for a text, ``(instruction, text)`` for a pair (:func:`llm2vec.encode_inputs.read_item`)."""
        return read_item(x, index)

    def encode_ids(self, items: Sequence[Item]) -> list[templates.EncodedText]:
        return templates.encode(self.tokenizer, self.template, items, self.max_length, self.doc_max_length)

    def tokenize(self, items: Sequence[str | Sequence[str]], padding_side: str = "right") -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` and ``text_mask`` (text + anchor, no instruction) for a batch."""
        pairs = [self.as_item(x, i) for i, x in enumerate(items)]
        return pad_batch(self.encode_ids(pairs), self.pad_token_id, padding_side)

    def hidden_states(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Final-layer hidden states (B, T, H), with position ids counted over the real tokens only."""
        if self.packing:
            return packed_hidden_states(decoder_body(self.model), [features])[0]
        out = decoder_body(self.model)(
            input_ids=features["input_ids"],
            attention_mask=features["attention_mask"],
            position_ids=position_ids_from_mask(features["attention_mask"]),
            use_cache=False,  # an encoder keeps no KV cache (a recomputing checkpoint would append to it again)
        )
        return out.last_hidden_state

    def embed(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """Embeddings (B, H) of a tokenized batch, with gradients (training and ``encode`` both use this)."""
        return pool(self.hidden_states(features), features["attention_mask"], features["text_mask"], self.pooling_mode)

    def embed_many(self, batches: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """:meth:`embed` of several batches: one decoder call over all of them when packing, one a batch otherwise."""
        if not self.packing:
            return [self.embed(features) for features in batches]
        states = packed_hidden_states(decoder_body(self.model), batches)
        return [pool(h, f["attention_mask"], f["text_mask"], self.pooling_mode) for h, f in zip(states, batches)]

    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """The encoder's forward is ``embed``; training subclasses override it to return their loss."""
        return self.embed(features)

    # ------------------------------------------------------------------ inference

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def resolve_prompt(self, prompt: str | None = None, prompt_name: str | None = None) -> str | None:
        """The instruction of an ``encode`` call: ``prompt`` (``prompt_name`` ignored, with a warning), else the
        prompt named ``prompt_name``, else None."""
        for keyword, value in (("prompt", prompt), ("prompt_name", prompt_name)):
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"{keyword}={value!r:.80}: expected a string (or None); one instruction is given to every text, "
                    "so for an instruction per text pass [instruction, text] pairs"
                )
        if prompt is not None:
            if prompt_name is not None:
                logger.warning("both prompt and prompt_name given: prompt_name %r is ignored", prompt_name)
            return prompt
        if prompt_name is None:
            return None
        if prompt_name not in self.prompts:
            raise ValueError(
                f"prompt_name {prompt_name!r}: this model has no such prompt (its prompts: {sorted(self.prompts)}); "
                "pass prompt=<instruction>, or load it with prompts={name: instruction}"
            )
        return self.prompts[prompt_name]

    def length_sorted_batches(
        self, items: Sequence[Item], batch_size: int
    ) -> tuple[list[int], list[list[templates.EncodedText]]]:
        """How :meth:`encode` batches ``items``: ``(order, batches)``, tokenized, by decreasing token count (ties in
        input order)."""
        encoded = self.encode_ids(items)
        order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i].input_ids))
        return order, [[encoded[i] for i in order[s : s + batch_size]] for s in range(0, len(order), batch_size)]

    def padded(self, batch: Sequence[templates.EncodedText], device: torch.device) -> dict[str, torch.Tensor]:
        """One batch of :meth:`length_sorted_batches` as the features :meth:`embed` reads, on ``device``."""
        return {k: v.to(device) for k, v in pad_batch(batch, self.pad_token_id).items()}

    @torch.no_grad()
    @strict_booleans
    def encode(
        self,
        sentences: str | Sequence[str | Sequence[str]],
        prompt_name: str | None = None,
        prompt: str | None = None,
        batch_size: int = 32,
        show_progress_bar: bool | None = None,
        convert_to_numpy: bool = True,
        convert_to_tensor: bool = False,
        normalize_embeddings: bool = False,
        device: str | torch.device | None = None,
        truncate_dim: int | None = None,
    ) -> np.ndarray | torch.Tensor:
        """Embed texts or ``[instruction, text]`` pairs (float32, input order), the arguments as in
        sentence-transformers' ``encode``: ``encode(texts, prompt=i)`` equals ``encode([[i, t] for t in texts])``;
        ``truncate_dim`` applies before ``normalize_embeddings``. Bad input is a one-line ``TypeError``."""
        items, single = read_inputs(sentences)  # what is accepted and refused: llm2vec.encode_inputs
        instruction = self.resolve_prompt(prompt, prompt_name)
        if instruction is not None:
            paired = next((i for i, (given, _) in enumerate(items) if given), None)
            if paired is not None:
                raise ValueError(
                    f"input {paired} is an [instruction, text] pair and a prompt was given too; give the instruction "
                    "one way: plain texts with prompt=, or pairs without it"
                )
            items = [(instruction, text) for _, text in items]
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        truncate_dim = self._checked_truncate_dim(truncate_dim) or self.truncate_dim
        if show_progress_bar is None:
            show_progress_bar = len(items) > batch_size and logger.getEffectiveLevel() <= logging.INFO
        device = torch.device(device) if device is not None else self.device
        was_training = self.training
        self.eval()
        order, batches = self.length_sorted_batches(items, batch_size)
        chunks = []
        for batch in tqdm(batches, desc="Encoding", disable=not show_progress_bar):
            chunks.append(self.embed(self.padded(batch, device)).float().cpu())
        self.train(was_training)
        hidden = decoder_body(self.model).config.hidden_size
        sorted_embeddings = torch.cat(chunks) if chunks else torch.zeros((0, hidden))
        embeddings = torch.empty_like(sorted_embeddings)
        embeddings[torch.tensor(order, dtype=torch.long)] = sorted_embeddings
        if truncate_dim is not None:
            embeddings = embeddings[:, :truncate_dim]
        if normalize_embeddings:
            embeddings = torch.nn.functional.normalize(embeddings, p=2, dim=-1)
        if single:
            embeddings = embeddings[0]
        return embeddings if convert_to_tensor or not convert_to_numpy else embeddings.numpy()

    def encode_query(self, sentences, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """:meth:`encode` with the ``query`` prompt when given none (without one: no instruction, a warning once)."""
        if prompt is None and prompt_name is None:
            if "query" in self.prompts:
                prompt_name = "query"
            elif not getattr(self, "_warned_no_query", False):
                self._warned_no_query = True
                logger.warning(
                    "this model has no 'query' prompt: encode_query embeds without an instruction, exactly as "
                    "encode_document; pass prompt=<instruction>, or load with prompts={'query': <instruction>}"
                )
        return self.encode(sentences, prompt_name, prompt, **kwargs)

    def encode_document(self, sentences, prompt_name: str | None = None, prompt: str | None = None, **kwargs):
        """:meth:`encode` with the first of :data:`DOCUMENT_PROMPT_NAMES` the model has when given no prompt."""
        if prompt is None and prompt_name is None:
            prompt_name = next((n for n in DOCUMENT_PROMPT_NAMES if n in self.prompts), None)
        return self.encode(sentences, prompt_name, prompt, **kwargs)

    @staticmethod
    def similarity(embeddings1, embeddings2) -> torch.Tensor:
        """Cosine similarity of every row of ``embeddings1`` with every row of ``embeddings2``: ``(n1, n2)`` float32."""

        def matrix(x) -> torch.Tensor:
            x = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).float()
            return torch.nn.functional.normalize(x.reshape(1, -1) if x.dim() == 1 else x, p=2, dim=-1)

        return matrix(embeddings1) @ matrix(embeddings2).T


def _positive_or_none(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive whole number or None, got {value!r}")
    return value


def _without_tied_copy(model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` without a tied output embedding equal to the input embedding (FSDP gathers both)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if not getattr(config, "tie_word_embeddings", False) or output is None or inputs is None:
        return state_dict
    names = {module: name for name, module in model.named_modules()}
    tied, source = f"{names[output]}.weight", f"{names[inputs]}.weight"
    if tied in state_dict and source in state_dict and torch.equal(state_dict[tied], state_dict[source]):
        return {k: v for k, v in state_dict.items() if k != tied}
    return state_dict
