"""A template's user turn and its tokenization in pieces: the instruction joined to the text, the text cut to fit,
and the closing appended after truncation so that the anchor is always the last token (docs/design.md, templates)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

TRAINING_SEPARATOR = "; "  # the authors' E5 loader (LLM2Vec's): f"{instruction}; " + query
EVALUATION_SEPARATOR = ": "  # the authors' evaluation: "<instruction>: <text>" (docs/design.md)


class UserTurn(NamedTuple):
    """One user turn of a chat format: ``opening + content + closing``; ``anchor`` is the closing's last token."""

    opening: str
    closing: str
    anchor: str


def join_instruction(instruction: str, separator: str) -> str:
    """``instruction + separator`` ("" without an instruction); a mark the instruction already ends with
    (``"...the claim:"`` with separator ``": "``) is not repeated."""
    instruction = instruction.strip()
    if not instruction:
        return ""
    mark = separator.strip()
    if mark and instruction.endswith(mark):
        return instruction + separator[separator.index(mark) + len(mark) :]
    return instruction + separator


@dataclass(frozen=True)
class TemplateSpec:
    """A family: ``turn`` returns its :class:`UserTurn`; ``model_types`` and ``marker_tokens`` (all in the
    vocabulary, with the anchor) recognise it; ``separator`` joins instruction and text; ``packing_exact``: packed
    decoder calls give the hidden states of texts run alone (``False``, the default, refuses ``packing: true``)."""

    name: str
    turn: Callable[[], UserTurn]
    model_types: tuple[str, ...]
    marker_tokens: tuple[str, ...]
    separator: str = EVALUATION_SEPARATOR
    packing_exact: bool = False

    @property
    def anchor(self) -> str:
        return self.turn().anchor

    def with_separator(self, separator: str) -> TemplateSpec:
        return dataclasses.replace(self, separator=separator)

    def build(self, instruction: str) -> tuple[str, str]:
        """``(prefix, anchor)``: the opening with the instruction and separator, and the anchor token."""
        turn = self.turn()
        return turn.opening + join_instruction(instruction, self.separator), turn.anchor

    def render(self, instruction: str, text: str) -> str:
        """The whole user turn as one string (what :func:`encode` tokenizes, in pieces)."""
        return self.build(instruction)[0] + text.strip() + self.turn().closing


def eos_ids(tokenizer, config=None, generation_config=None) -> set[int]:
    """The end-of-sequence ids of a model: the tokenizer's ``eos_token_id`` and every ``eos_token_id`` (an id or a
    list) of its config and generation config."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for source in (config, generation_config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


@dataclass(frozen=True)
class EncodedText:
    """Token ids of one (instruction, text) item: ``[:text_start]`` the prefix with the instruction,
    ``[text_start:text_end]`` the (possibly cut) text, ``[text_end:]`` the closing, whose last id is the anchor."""

    input_ids: tuple[int, ...]
    text_start: int
    text_end: int


def adds_leading_space(tokenizer) -> bool:
    """Whether the tokenizer marks the start of every text as a word start (sentencepiece's dummy prefix)."""

    def ids(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    return ids("a b") == ids("a") + ids("b")


def _lead(spaces: str, dummy_prefix: bool) -> str:
    """The spaces to put before a separately tokenized piece that follows ``spaces`` in the joint string."""
    return spaces[1:] if dummy_prefix and spaces else spaces


def tokenize_closing(tokenizer, closing: str, dummy_prefix: bool) -> list[int]:
    body = closing.lstrip(" ")
    return tokenizer(_lead(closing[: len(closing) - len(body)], dummy_prefix) + body, add_special_tokens=False)[
        "input_ids"
    ]


def _text_context(prefix: str, dummy_prefix: bool) -> str:
    """What to tokenize a text after so that it gets the ids it has after ``prefix`` in the whole user turn."""
    return prefix if dummy_prefix and prefix and not prefix.endswith(" ") else ""


def prompt_parts(
    tokenizer, spec: TemplateSpec, instruction: str, dummy_prefix: bool | None = None
) -> tuple[list[int], str]:
    """``(prefix_ids, lead)``: the ids of the prompt before the text, and the spaces :func:`encode` puts before
    the stripped text when it tokenizes it as a separate piece."""
    if dummy_prefix is None:
        dummy_prefix = adds_leading_space(tokenizer)
    prefix = spec.build(instruction)[0]
    body = prefix.rstrip(" ")
    return tokenizer(body, add_special_tokens=False)["input_ids"], _lead(prefix[len(body) :], dummy_prefix)


def encode(
    tokenizer, spec: TemplateSpec, items: Sequence[tuple[str, str]], max_length: int, text_max_tokens: int | None = None
) -> list[EncodedText]:
    """Token ids for ``(instruction, text)`` items, the stripped text cut so that prefix + text + closing fit in
    ``max_length`` (and to at most ``text_max_tokens``); the ids equal those of the whole user turn tokenized at once,
    and the closing is appended after truncation (docs/design.md)."""
    turn = spec.turn()
    dummy_prefix = adds_leading_space(tokenizer)
    closing_ids = tokenize_closing(tokenizer, turn.closing, dummy_prefix)
    anchor_id = tokenizer.convert_tokens_to_ids(turn.anchor)
    if not closing_ids or closing_ids[-1] != anchor_id:
        raise ValueError(
            f"template {spec.name!r}: the closing {turn.closing!r} does not end with the anchor "
            f"{turn.anchor!r} with this tokenizer ({closing_ids}); fix the template's anchor"
        )
    prefixes: dict[str, tuple[list[int], str]] = {}
    for instruction, _ in items:
        if instruction not in prefixes:
            prefixes[instruction] = prompt_parts(tokenizer, spec, instruction, dummy_prefix)
    # a text tokenized after its prompt (see above): the prompt, else ""
    context = {i: _text_context(spec.build(i)[0], dummy_prefix) for i in prefixes}
    # the lead spaces belong to a text: an empty one is no tokens at all
    texts = [
        (context[instruction] or prefixes[instruction][1]) + text.strip() if text.strip() else ""
        for instruction, text in items
    ]
    text_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = []
    for (instruction, text), ids in zip(items, text_ids):
        prefix_ids = prefixes[instruction][0]
        if context[instruction] and text.strip():
            n = len(prefix_ids)
            ids = ids[n:] if ids[:n] == prefix_ids else tokenizer(text.strip(), add_special_tokens=False)["input_ids"]
        budget = max_length - len(prefix_ids) - len(closing_ids)
        if budget < 1:
            raise ValueError(
                f"max_length={max_length} leaves no room for text after the {len(prefix_ids)}-token prompt "
                f"of instruction {instruction[:60]!r}; raise max_length or shorten the instruction"
            )
        ids = list(ids[: budget if text_max_tokens is None else min(budget, text_max_tokens)])
        out.append(EncodedText(tuple(prefix_ids + ids + closing_ids), len(prefix_ids), len(prefix_ids) + len(ids)))
    return out


def chat_template_mismatch(
    tokenizer,
    spec: TemplateSpec,
    instruction: str = "Given a question, retrieve passages",
    text: str = "Paris is the capital of France.",
    *,
    chat_ids: Callable[[str], list[int]] | None = None,
    eos: Collection[int] | None = None,
) -> str | None:
    """``None`` when :func:`encode` agrees with the tokenizer's chat template for one user message (a default
    system turn left out, whitespace after the anchor, an EOS anchor appended after an open user turn allowed), else
    a one-line description of the difference. ``chat_ids``: the chat template's ids for a content (default
    ``apply_chat_template``); ``eos``: the ids an appended anchor may be (default the tokenizer's EOS)."""
    difference = chat_difference(tokenizer, spec, instruction, text, chat_ids, eos)
    if difference is None:
        return None
    ours, chat = difference
    return (
        f"template {spec.name!r} differs from the tokenizer's chat template for one user message: ours "
        f"{ours!r}, the chat template's {chat!r}. Pass the right template=<name> or register one that matches the "
        "model's chat format."
    )


def chat_difference(
    tokenizer, spec: TemplateSpec, instruction: str, text: str, chat_ids, eos
) -> tuple[str, str] | None:
    """``None`` when :func:`encode` agrees with the chat template (:func:`chat_template_mismatch`), else both decoded:
    ``(ours, the chat template's)``."""
    content = join_instruction(instruction, spec.separator) + text
    if chat_ids is None:
        chat = list(
            tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True, return_dict=False)
        )
    else:
        chat = list(chat_ids(content))
    ours = list(encode(tokenizer, spec, [(instruction, text)], max_length=1 << 20)[0].input_ids)
    while chat and chat[-1] != ours[-1] and not tokenizer.decode([chat[-1]]).strip():
        chat.pop()
    if chat and chat[-1] != ours[-1] and ours[-1] in (eos_ids(tokenizer) if eos is None else eos):
        chat.append(ours[-1])  # the EOS anchor appended after a user turn the chat format leaves open (Mistral)
    if chat == ours:
        return None
    common = 0
    while common < min(len(chat), len(ours)) and chat[common] == ours[common]:
        common += 1
    tail = ours[common:]
    if len(chat) > len(ours) and chat[len(chat) - len(tail) :] == tail:
        inserted = tokenizer.decode(chat[common : len(chat) - len(tail)])
        if "system" in inserted:
            return None
    return tokenizer.decode(ours), tokenizer.decode(chat)
