"""Export a trained model as a sentence-transformers folder that embeds exactly as :meth:`LLM2Vec.encode`: loaded
with no custom code, refused (:class:`ExportError`) before anything is written, checked before it is published."""

from .prompts import ADHOC_PROBES, STRIP_MARKER, TEXT_MARKER, ExportError  # noqa: F401  (the package's face)
from .tokenizer import export_chat_template, export_tokenizer  # noqa: F401
from .verify import MIN_COSINE  # noqa: F401
from .writer import export_sentence_transformers, read_instructions  # noqa: F401
