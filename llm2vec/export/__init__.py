"""Export a trained model as a sentence-transformers folder that embeds exactly as :meth:`LLM2Vec.encode`: loaded
with no custom code, refused (:class:`ExportError`) before anything is written, checked before it is published."""

from __future__ import annotations

from .prompts import ADHOC_PROBES, STRIP_MARKER, TEXT_MARKER, ExportError
from .tokenizer import export_chat_template, export_tokenizer
from .verify import MIN_COSINE
from .writer import export_sentence_transformers, read_instructions

__all__ = [
    "ADHOC_PROBES",
    "MIN_COSINE",
    "STRIP_MARKER",
    "TEXT_MARKER",
    "ExportError",
    "export_chat_template",
    "export_sentence_transformers",
    "export_tokenizer",
    "read_instructions",
]
