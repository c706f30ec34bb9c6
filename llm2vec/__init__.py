"""Anchor Embedding: LLM2Vec-style text encoders with the paper's bidirectional-reconstruction Stage I."""

from .llm2vec import LLM2Vec

__all__ = ["LLM2Vec"]
__version__ = "0.1.0"
