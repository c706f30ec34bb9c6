"""Prompt templates: one function per model family, shared by training and evaluation.

A template turns an instruction into the *prefix* string that precedes the text in the family's chat
format, and names the family's *anchor* token: the closing token of a user turn, which is also the
model's end-of-turn / [EOS] token. :func:`encode` tokenizes prefix and text separately, truncates the
text, and appends the anchor **as a token id after truncation**, so the anchor is always the last real
token of the sequence however long the text is (the paper's Eq. 1 reads the embedding there).

The family is selected from the model config (``config.model_type``) together with the special tokens
present in the tokenizer (Llama-3 and SmolLM2 are both ``model_type == "llama"`` but use different
chat formats), never from a hub name. Register a new family with :func:`register_template`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


def _instruction_line(instruction: str) -> str:
    """The instruction and the text are separated by a newline; no instruction, no separator."""
    instruction = instruction.strip()
    return instruction + "\n" if instruction else ""


# --- one function per family: instruction -> (prefix string, anchor token) -------------------------


def llama3_template(instruction: str) -> tuple[str, str]:
    """Llama-3.x Instruct: ``<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n`` ... ``<|eot_id|>``."""
    return (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n" + _instruction_line(instruction),
        "<|eot_id|>",
    )


def qwen2_template(instruction: str) -> tuple[str, str]:
    """Qwen2.5 Instruct (ChatML, no BOS): ``<|im_start|>user\\n`` ... ``<|im_end|>``."""
    return "<|im_start|>user\n" + _instruction_line(instruction), "<|im_end|>"


def smollm2_template(instruction: str) -> tuple[str, str]:
    """SmolLM2 Instruct (ChatML on a Llama body; the default system turn is left out): ``<|im_start|>user\\n`` ... ``<|im_end|>``."""
    return "<|im_start|>user\n" + _instruction_line(instruction), "<|im_end|>"


def mistral_template(instruction: str) -> tuple[str, str]:
    """Mistral-7B (Instruct format): ``<s>[INST] `` ... ``</s>``."""
    return "<s>[INST] " + _instruction_line(instruction), "</s>"


@dataclass(frozen=True)
class TemplateSpec:
    """A registered family: its template function and how to recognise it.

    ``model_types``: values of ``config.model_type`` this family can have.
    ``marker_tokens``: tokens that must all be in the tokenizer's vocabulary (they tell apart families
    sharing a ``model_type``); the anchor token must be among them or in the vocabulary too.
    """

    name: str
    build: Callable[[str], tuple[str, str]]
    model_types: tuple[str, ...]
    marker_tokens: tuple[str, ...]


_REGISTRY: dict[str, TemplateSpec] = {}


def register_template(spec: TemplateSpec, overwrite: bool = False) -> TemplateSpec:
    """Add a family. Detection tries families in registration order; the first match wins."""
    if spec.name in _REGISTRY and not overwrite:
        raise ValueError(f"a template named {spec.name!r} is already registered (pass overwrite=True)")
    _REGISTRY[spec.name] = spec
    return spec


register_template(TemplateSpec("llama3", llama3_template, ("llama",), ("<|start_header_id|>", "<|eot_id|>")))
register_template(TemplateSpec("smollm2", smollm2_template, ("llama",), ("<|im_start|>", "<|im_end|>")))
register_template(TemplateSpec("qwen2", qwen2_template, ("qwen2",), ("<|im_start|>", "<|im_end|>")))
register_template(TemplateSpec("mistral", mistral_template, ("mistral",), ("</s>",)))


def registered_templates() -> list[str]:
    return list(_REGISTRY)


def get_template(name: str) -> TemplateSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown template {name!r}; registered templates: {', '.join(_REGISTRY)}. "
            "Register one with llm2vec.templates.register_template(TemplateSpec(...))."
        ) from None


def _has_token(tokenizer, token: str) -> bool:
    return token in tokenizer.get_vocab()


def resolve_template(config, tokenizer, name: str | None = None) -> TemplateSpec:
    """The template for a model: by explicit ``name``, else detected from ``config`` and ``tokenizer``."""
    if name is not None:
        spec = get_template(name)
    else:
        model_type = getattr(config, "model_type", None)
        candidates = [s for s in _REGISTRY.values() if model_type in s.model_types]
        matches = [s for s in candidates if all(_has_token(tokenizer, t) for t in s.marker_tokens)]
        if not matches:
            known = ", ".join(f"{s.name} (model_type {'/'.join(s.model_types)})" for s in _REGISTRY.values())
            raise ValueError(
                f"no prompt template for this model: model_type={model_type!r}"
                + (f" with none of the chat tokens of {[s.name for s in candidates]}" if candidates else "")
                + f". Known families: {known}. Register one with "
                "llm2vec.templates.register_template(TemplateSpec(name, build_fn, model_types, marker_tokens)) "
                "and pass template=<name> (or set \"template\" in the config)."
            )
        spec = matches[0]
    _, anchor = spec.build("")
    if not _has_token(tokenizer, anchor):
        raise ValueError(f"template {spec.name!r}: the anchor token {anchor!r} is not in the tokenizer's vocabulary")
    return spec


@dataclass(frozen=True)
class EncodedText:
    """Token ids of one (instruction, text) item.

    ``input_ids[:text_start]`` is the template prefix with the instruction, ``input_ids[text_start:text_end]``
    the (possibly truncated) text, and ``input_ids[-1]`` the anchor token (``text_end == len(input_ids) - 1``).
    """

    input_ids: tuple[int, ...]
    text_start: int
    text_end: int


def encode(
    tokenizer, spec: TemplateSpec, items: Sequence[tuple[str, str]], max_length: int
) -> list[EncodedText]:
    """Token ids for ``(instruction, text)`` items; the text is cut so that prefix + text + anchor <= max_length.

    Prefix and text are tokenized separately (the text tokens are then the same whatever the instruction).
    """
    anchor_id = tokenizer.convert_tokens_to_ids(spec.build("")[1])
    prefixes: dict[str, list[int]] = {}
    for instruction, _ in items:
        if instruction not in prefixes:
            prefixes[instruction] = tokenizer(spec.build(instruction)[0], add_special_tokens=False)["input_ids"]
    texts = [text for _, text in items]
    text_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = []
    for (instruction, _), ids in zip(items, text_ids):
        prefix_ids = prefixes[instruction]
        budget = max_length - len(prefix_ids) - 1
        if budget < 1:
            raise ValueError(
                f"max_length={max_length} leaves no room for text after the {len(prefix_ids)}-token prompt "
                f"of instruction {instruction[:60]!r}; raise max_length or shorten the instruction"
            )
        ids = list(ids[:budget])
        out.append(EncodedText(tuple(prefix_ids + ids + [anchor_id]), len(prefix_ids), len(prefix_ids) + len(ids)))
    return out
