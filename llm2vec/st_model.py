"""This project's model as a ``SentenceTransformer`` for Stage II through sentence-transformers: written by the
export, loaded, its chat template set to a separator, LoRA added as the project's Stage II adds it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def sentence_transformer(
    base_model_name_or_path: str,
    work_dir: str | os.PathLike,
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
    """This project's model as a ``SentenceTransformer`` (docs/design.md, st_training), written to ``work_dir``
    (a new or empty folder) by the export and loaded from there; with ``lora`` (a ``peft.LoraConfig``) the decoder
    body gets trainable LoRA adapters (seeded with ``seed`` when given), everything else frozen.
    ``instruction_separator`` rebuilds the chat template with that separator (the training one)."""
    from sentence_transformers import SentenceTransformer

    from .export import export_sentence_transformers

    if os.path.isdir(work_dir) and os.listdir(work_dir):  # the export would refuse it naming its --overwrite
        raise ValueError(
            f"work_dir {work_dir} is not empty; give a new or empty folder (a tempfile.TemporaryDirectory)"
        )
    export_sentence_transformers(
        base_model_name_or_path,
        work_dir,
        peft_model_name_or_path,
        query_instruction="",  # the prompts are not used here: the training data carries the instructions
        max_length=max_length,
        template=template,
        normalize=False,  # the raw anchor state, as LLM2Vec.embed (a loss normalises where it needs to)
        dtype=dtype,
        device="cpu",
        trust_remote_code=trust_remote_code,
        accept_other_base=accept_other_base,
    )
    model = SentenceTransformer(str(work_dir), device=device, local_files_only=True, trust_remote_code=False)
    model.default_prompt_name = None
    model.prompts = {}
    _spec_of(model, "")  # the template read while the folder is there
    if instruction_separator is not None:
        set_separator(model, instruction_separator)
    if lora is not None:
        from .llm2vec_contrastive import add_lora

        if seed is not None:
            import transformers

            transformers.set_seed(seed)
        model[0].model = add_lora(model[0].model, lora)
    return model


def _spec_of(model, separator: str):
    """The model's template with ``separator``; read from its folder once (the folder may be gone later)."""
    from transformers import AutoConfig

    from . import templates
    from .llm2vec import read_llm2vec_config

    if not hasattr(model, "_llm2vec_template"):
        folder = str(model[0].model.name_or_path)
        name = read_llm2vec_config(folder)["template"]
        model._llm2vec_template = templates.named_template(name, AutoConfig.from_pretrained(folder), model.tokenizer)
    return model._llm2vec_template.with_separator(separator)


def set_separator(model, separator: str) -> None:
    """Rebuild the export's chat template of ``model`` with ``separator`` between instruction and text."""
    from .export.tokenizer import fitting_chat_template

    model.tokenizer.chat_template = fitting_chat_template(_spec_of(model, separator), model.tokenizer)


@contextlib.contextmanager
def separator(model, value: str) -> Iterator[None]:
    """``model``'s chat template joins instruction and text with ``value`` inside the block."""
    before = model.tokenizer.chat_template
    set_separator(model, value)
    try:
        yield
    finally:
        model.tokenizer.chat_template = before
