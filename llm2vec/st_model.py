"""This project's model as a ``SentenceTransformer`` for Stage II through sentence-transformers, built in memory from
the export's parts (chat layout, anchor pooling, not normalised), LoRA added as the project's Stage II adds it."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch


def sentence_transformer(
    base_model_name_or_path: str,
    peft_model_name_or_path: str | None = None,
    *,
    lora=None,
    instruction_separator: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int | None = None,
    **loading,
):
    """The model (adapter merged, ``loading`` as :meth:`LLM2Vec.load`) as a ``SentenceTransformer`` that embeds as
    its export (docs/design.md, st_training), weights in ``dtype``; an ``ExportError`` where the export would refuse
    it. ``lora`` (a ``peft.LoraConfig``): trainable adapters on the decoder body (seeded with ``seed``), the rest
    frozen; ``instruction_separator`` rebuilds the chat template with it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from .export import writer
    from .export.prompts import CHAT_LAYOUT, build_prompts
    from .export.tokenizer import write_tokenizer
    from .llm2vec import decoder_body

    encoder = writer.exportable_encoder(base_model_name_or_path, peft_model_name_or_path, CHAT_LAYOUT, dtype, **loading)
    tokenizer = writer.exported_tokenizer(encoder, build_prompts(encoder, {}, "", CHAT_LAYOUT), CHAT_LAYOUT)
    body = decoder_body(encoder.model)
    body.config.use_cache = False  # as sentence-transformers loads a model
    with tempfile.TemporaryDirectory(prefix="llm2vec-st-") as work:  # its tokenizer loads from a folder only
        folder = Path(work)
        body.config.save_pretrained(folder)
        kwargs = {"processor_kwargs": write_tokenizer(tokenizer, folder), **writer.ST_CHAT_TRANSFORMER_CONFIG}
        transformer = _transformer_class()(folder, model_kwargs={"llm2vec_model": body}, **kwargs)
    pooling = Pooling(**writer.pooling_config(encoder.pooling_mode, body.config.hidden_size))
    model = SentenceTransformer(modules=[transformer, pooling], device=device, local_files_only=True)  # no hub look-up
    model.default_prompt_name, model.prompts = None, {}
    model.llm2vec_template = encoder.template
    if instruction_separator is not None:
        set_separator(model, instruction_separator)
    if lora is not None:
        from transformers import set_seed

        from .llm2vec_contrastive import add_lora

        if seed is not None:
            set_seed(seed)
        model[0].model = add_lora(model[0].model, lora)
    return model


# The one private method of sentence-transformers overridden: name, the signature it was written against, and why no
# public hook does the work. tests/test_upstream.py checks the signature against the installed sentence-transformers.
PRIVATE_OVERRIDE = (
    "_load_model",
    "(self, model_name_or_path, transformer_task, config, backend, is_peft_model, **model_kwargs)",
    "Transformer loads its model only from a folder's weights (from_pretrained takes no state_dict beside a path in "
    "transformers 5); the Stage II model is already in memory",
)


@functools.cache
def _transformer_class():
    from sentence_transformers.sentence_transformer.modules import Transformer

    class InMemoryTransformer(Transformer):
        """sentence-transformers' ``Transformer`` whose model-loading step returns ``model_kwargs["llm2vec_model"]``
        (a model in memory); its config and tokenizer are read from the folder it is given."""

        # PRIVATE_OVERRIDE; were it no longer called, loading would fail loudly: the folder holds no weights
        def _load_model(self, *args, llm2vec_model, **kwargs):
            return llm2vec_model

    return InMemoryTransformer


@contextlib.contextmanager
def separator(model, value: str) -> Iterator[None]:
    """``model``'s chat template joins instruction and text with ``value`` inside the block."""
    before = model.tokenizer.chat_template
    set_separator(model, value)
    try:
        yield
    finally:
        model.tokenizer.chat_template = before


def set_separator(model, value: str) -> None:
    from .export.tokenizer import fitting_chat_template

    model.tokenizer.chat_template = fitting_chat_template(model.llm2vec_template.with_separator(value), model.tokenizer)
