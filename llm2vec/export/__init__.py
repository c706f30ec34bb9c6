"""Export a trained model as a sentence-transformers folder that embeds exactly as :meth:`LLM2Vec.encode`.

Contract: ``SentenceTransformer(folder)`` loads it with no custom code; what cannot be exported is an
:class:`ExportError` before anything is written; the folder is checked against ``LLM2Vec.encode`` (token ids and
embeddings) before it is renamed into place."""

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
