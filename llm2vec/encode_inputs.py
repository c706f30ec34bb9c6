"""What :meth:`llm2vec.LLM2Vec.encode` accepts as input, checked before anything is tokenized."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from typing import Any

Item = tuple[str, str]


def _describe(x: Any) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def read_item(x: Any, index: int = 0) -> Item:
    """One input as ``(instruction, text)``: a text gets ``""`` as its instruction; a pair is kept."""
    if isinstance(x, str):
        return "", str(x)
    where = f"input {index}"
    if x is None:
        raise TypeError(f"{where} is None; give a text or an [instruction, text] pair")
    if isinstance(x, (bytes, bytearray)):
        raise TypeError(f"{where} is {type(x).__name__}, not text; decode it first (e.g. x.decode('utf-8'))")
    if isinstance(x, (list, tuple)) or (type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 1):
        parts = list(x)
        if len(parts) != 2:
            raise TypeError(
                f"{where}: a pair is [instruction, text], two strings; got {len(parts)} item(s): {_describe(x)}"
            )
        for name, part in zip(("instruction", "text"), parts):
            if not isinstance(part, str):
                raise TypeError(f"{where}: the pair's {name} must be a string, got {_describe(part)}")
        return str(parts[0]), str(parts[1])
    raise TypeError(f"{where}: expected a text or an [instruction, text] pair of strings, got {_describe(x)}")


def read_inputs(sentences: Any) -> tuple[list[Item], bool]:
    """``(items, single)``: the ``(instruction, text)`` items of ``sentences`` (module docstring) and whether it
    was one text. Raises ``TypeError`` (one line) for what the module docstring refuses."""
    if isinstance(sentences, str):
        return [read_item(sentences)], True
    refused = None
    if sentences is None:
        refused = "None"
    elif isinstance(sentences, (bytes, bytearray)):
        refused = f"{type(sentences).__name__}, not text; decode it first (e.g. sentences.decode('utf-8'))"
    elif isinstance(sentences, Mapping):
        refused = (
            f"a mapping ({type(sentences).__name__}), whose iteration gives its keys; pass list(d.values()) "
            "(or the keys, if they are the texts, as a list)"
        )
    elif isinstance(sentences, Set):
        refused = f"a {type(sentences).__name__}, which has no order to give the rows in; pass a list"
    elif type(sentences).__module__ == "numpy" and hasattr(sentences, "dtype"):
        if getattr(sentences, "ndim", 0) == 0:
            refused = f"a numpy scalar {_describe(sentences)}; pass a str or a list of texts"
        elif sentences.dtype.kind not in "UO":
            refused = f"a numpy array of {sentences.dtype} values, not texts"
    elif not isinstance(sentences, Iterable):
        refused = _describe(sentences)
    if refused:
        raise TypeError(f"sentences: expected a text or a list of texts / [instruction, text] pairs; got {refused}")
    return [read_item(x, i) for i, x in enumerate(sentences)], False
