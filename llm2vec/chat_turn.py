"""The user turn of a tokenizer's own chat template: how a model of no registered family gets its prompt."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import NamedTuple

# sentinel contents: plain letters, which no template trims or escapes and no chat format contains
USER_TEXT = "LLM2VECUSERTEXT"
SYSTEM_TEXT = "LLM2VECSYSTEMTEXT"
REPLY_TEXT = "LLM2VECREPLYTEXT"

RENDER_LINES = 1_000_000  # the most template lines one rendering may execute (a published template: a few hundred)
RENDER_SECONDS = 10.0  # the most wall-clock seconds one rendering may take


class ChatTemplateError(ValueError):
    """The tokenizer's chat template gives no usable user turn (one line; the caller names the way out)."""


class EndOfTurnNotEos(ChatTemplateError):
    """The token that closes both the user turn and the reply (``token``, ``token_id``) is not among the model's EOS
    ids (``eos``, as ``'<eos>' (1), ...``)."""

    def __init__(self, message: str, token: str, token_id: int, eos: str):
        super().__init__(message)
        self.token, self.token_id, self.eos = token, token_id, eos


class ChatTurn(NamedTuple):
    """The user turn of a chat template: ``opening + text + closing``; ``anchor`` is the closing's last token;
    ``system_turn``, ``trailing`` and ``appended``: what the opening leaves out, what follows, the EOS appended."""

    opening: str
    closing: str
    anchor: str
    system_turn: str = ""
    trailing: str = ""
    appended: str = ""


class _OverBudget(BaseException):
    """A budget spent (a BaseException: no ``except Exception`` inside the template can swallow it)."""


@contextmanager
def _budget(lines: int, seconds: float) -> Iterator[None]:
    """Raise :class:`_OverBudget` in this thread's compiled Jinja templates (code named ``<template>``) past
    ``lines`` executed lines or ``seconds``; the trace function set before is restored."""
    count, deadline = 0, time.monotonic() + seconds

    def in_template(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count > lines:
                raise _OverBudget(f"ran past {lines:,} template lines (a loop without end?)")
            if time.monotonic() > deadline:
                raise _OverBudget(f"ran past {seconds:g} s")
        return in_template

    def on_call(frame, event, arg):
        return in_template if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first[:200]}" if first else type(error).__name__


def template_kwargs(tokenizer) -> dict[str, bool]:
    """``enable_thinking=False`` where the chat template reads that switch (Qwen3), else nothing."""
    try:
        source = tokenizer.get_chat_template()
    except Exception:  # no template, or several without a default: render() says so
        return {}
    return {"enable_thinking": False} if "enable_thinking" in source else {}


def render(tokenizer, messages: list[dict[str, str]]) -> str:
    """The chat template's text for ``messages`` (no generation prompt, thinking off) under the line and time
    budgets; a template that raises or runs past a budget is a :class:`ChatTemplateError`."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the tokenizer has no chat template")
    kwargs = template_kwargs(tokenizer)
    roles = "+".join(m["role"] for m in messages)
    try:
        with _budget(RENDER_LINES, RENDER_SECONDS):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)
    except _OverBudget as e:
        raise ChatTemplateError(f"rendering a {roles} conversation {e}") from None
    except Exception as e:  # jinja2's TemplateError, raise_exception(), RecursionError, a TypeError of the template
        raise ChatTemplateError(f"rendering a {roles} conversation raised {_one_line(e)}") from None
    if not isinstance(text, str):
        raise ChatTemplateError(f"rendering a {roles} conversation gave a {type(text).__name__}, not text")
    return text


def _around(text: str, sentinel: str, what: str) -> tuple[str, str]:
    """``text`` before and after the one occurrence of ``sentinel``."""
    if text.count(sentinel) != 1:
        raise ChatTemplateError(
            f"it renders {what} {text.count(sentinel)} times in one message, not once (rendered {text[:120]!r})"
        )
    before, after = text.split(sentinel)
    return before, after


def _first_token_text(tokenizer, text: str) -> str:
    """The text of the first token of ``text`` (leading whitespace left out); "" for no tokens."""
    ids = tokenizer(text.lstrip(), add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:1]) if ids else ""


def _reply_end(tokenizer, closing_ids: Callable[[str], list[int]], user_turn: str) -> int | None:
    """The id of the last token written after an assistant's reply that follows ``user_turn`` (one user message
    up to its closing), trailing whitespace aside; ``None`` for none, or no reply rendered."""
    try:
        text = render(tokenizer, [{"role": "user", "content": USER_TEXT}, {"role": "assistant", "content": REPLY_TEXT}])
    except ChatTemplateError:
        return None
    if not text.startswith(user_turn) or text.count(REPLY_TEXT) != 1:
        return None
    after = text.split(REPLY_TEXT)[1].rstrip()
    ids = closing_ids(after) if after else []
    return ids[-1] if ids else None


def _without_default_system_turn(tokenizer, opening: str, closing: str) -> tuple[str, str]:
    """``(opening, system_turn)``: ``opening`` without the default system turn, and that turn ("" for none)."""
    try:
        text = render(tokenizer, [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": USER_TEXT}])
    except ChatTemplateError:  # no system role (Mistral v0.2, Gemma 2): no default system turn either
        return opening, ""
    if text.count(SYSTEM_TEXT) != 1 or text.count(USER_TEXT) != 1 or text.index(SYSTEM_TEXT) > text.index(USER_TEXT):
        return opening, ""
    before, rest = text.split(SYSTEM_TEXT)
    between = rest.split(USER_TEXT)[0]  # the system turn's end, then the user header
    if not (len(opening) >= len(before) + len(between) and opening.startswith(before) and opening.endswith(between)):
        return opening, ""  # no system turn around a default text (Gemma 3 puts a system text inside the user turn)
    turn_end = _first_token_text(tokenizer, closing)  # the token that ends a turn: <|eot_id|>, <|im_end|>
    end = between.rfind(turn_end) if turn_end else -1
    if end < 0:
        return opening, ""
    header = between[end + len(turn_end) :].lstrip()
    turn_start = _first_token_text(tokenizer, header)  # <|start_header_id|>, <|im_start|>: the system turn's start
    start = before.find(turn_start) if turn_start else -1
    if start < 0:
        bos = getattr(tokenizer, "bos_token", None)
        start = len(bos) if bos and before.startswith(bos) else 0
    return before[:start] + header, opening[start : len(opening) - len(header)]


def derive_turn(tokenizer, eos: Collection[int], closing_ids: Callable[[str], list[int]]) -> ChatTurn:
    """The user turn of ``tokenizer``'s chat template, whose anchor is one of ``eos``; ``closing_ids`` tokenizes a
    closing as :func:`llm2vec.templates.encode` does. Raises :class:`ChatTemplateError`."""
    pre, post = _around(render(tokenizer, [{"role": "user", "content": USER_TEXT}]), USER_TEXT, "the user's text")
    closing = post.rstrip()
    trailing = post[len(closing) :]
    ids = closing_ids(closing) if closing else []
    appended = ""
    if not ids or ids[-1] not in eos:
        reply_end = _reply_end(tokenizer, closing_ids, pre + USER_TEXT + closing)
        appended = tokenizer.decode([reply_end]) if reply_end is not None and reply_end in eos else ""
        if not appended:
            names = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} ({i})" for i in sorted(eos)) or "none"
            if ids and reply_end == ids[-1]:
                token = tokenizer.convert_ids_to_tokens(ids[-1])
                raise EndOfTurnNotEos(
                    f"{token!r} (id {ids[-1]}) closes the user turn and the assistant's reply but is not among the "
                    f"model's EOS ids ({names})",
                    token,
                    ids[-1],
                    names,
                )
            ends = (
                f"its user turn ends with {tokenizer.convert_ids_to_tokens(ids[-1])!r} ({ids[-1]}), which is not an "
                f"end-of-sequence id of the model (EOS ids: {names})"
                if ids
                else f"it writes nothing after the user's text, so no end-of-sequence id of the model ({names}) ends it"
            )
            raise ChatTemplateError(
                f"{ends}, and no EOS id ends an assistant's reply either; the anchor must be an EOS id (Eq. 1)"
            )
        ids = closing_ids(closing + appended)
        if not ids or ids[-1] not in eos:
            raise ChatTemplateError(
                f"the reply's end-of-sequence token {appended!r} does not tokenize alone after the user turn"
            )
    opening, system_turn = _without_default_system_turn(tokenizer, pre, closing)
    return ChatTurn(
        opening, closing + appended, tokenizer.convert_ids_to_tokens(ids[-1]), system_turn, trailing, appended
    )
