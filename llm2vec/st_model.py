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
    max_length: int | None = None,
    template: str | None = None,
    instruction_separator: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    trust_remote_code: bool = False,
    accept_other_base: bool = False,
    seed: int | None = None,
):
    """The model (adapter merged) as a ``SentenceTransformer`` that tokenizes, pools and embeds as its export
    (docs/design.md, st_training), weights in ``dtype``; :class:`llm2vec.export.ExportError` where the export would
    refuse it. With ``lora`` (a ``peft.LoraConfig``) the decoder body gets trainable LoRA adapters (seeded with
    ``seed`` when given), everything else frozen; ``instruction_separator`` rebuilds the chat template with it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from .export import writer
    from .export.prompts import CHAT_LAYOUT, build_prompts

    settings = dict(max_length=max_length, template=template, trust_remote_code=trust_remote_code)
    encoder = writer.exportable_encoder(
        base_model_name_or_path, peft_model_name_or_path, CHAT_LAYOUT, accept_other_base=accept_other_base, **settings
    )
    tokenizer = writer.exported_tokenizer(encoder, build_prompts(encoder, {}, "", CHAT_LAYOUT), CHAT_LAYOUT)
    body = writer.body_in(encoder, dtype)
    body.config.use_cache = False  # as sentence-transformers loads a model
    with tempfile.TemporaryDirectory(prefix="llm2vec-st-") as work:  # its tokenizer loads from a folder only
        folder = Path(work)
        body.config.save_pretrained(folder)
        kwargs = {"processor_kwargs": writer.write_tokenizer(tokenizer, folder), **writer.ST_CHAT_TRANSFORMER_CONFIG}
        transformer = _transformer_class()(folder, model_kwargs={"llm2vec_model": body}, **kwargs)
    pooling = Pooling(**writer.pooling_config(encoder.pooling_mode, body.config.hidden_size))
    model = SentenceTransformer(modules=[transformer, pooling], device=device)
    model.default_prompt_name, model.prompts = None, {}
    model.llm2vec_template = encoder.template
    if instruction_separator is not None:
        set_separator(model, instruction_separator)
    if lora is not None:
        from .llm2vec_contrastive import add_lora

        if seed is not None:
            import transformers

            transformers.set_seed(seed)
        model[0].model = add_lora(model[0].model, lora)
    return model


@functools.cache
def _transformer_class():
    from sentence_transformers.sentence_transformer.modules import Transformer

    class InMemoryTransformer(Transformer):
        """sentence-transformers' ``Transformer`` whose model-loading step returns ``model_kwargs["llm2vec_model"]``
        (a model in memory); its config and tokenizer are read from the folder it is given."""

        def _load_model(self, *args, llm2vec_model, **kwargs):
            return llm2vec_model

    return InMemoryTransformer


def set_separator(model, separator: str) -> None:
    """Rebuild the export's chat template of ``model`` with ``separator`` between instruction and text."""
    from .export.tokenizer import fitting_chat_template

    spec = model.llm2vec_template.with_separator(separator)
    model.tokenizer.chat_template = fitting_chat_template(spec, model.tokenizer)


@contextlib.contextmanager
def separator(model, value: str) -> Iterator[None]:
    """``model``'s chat template joins instruction and text with ``value`` inside the block."""
    before = model.tokenizer.chat_template
    set_separator(model, value)
    try:
        yield
    finally:
        model.tokenizer.chat_template = before
