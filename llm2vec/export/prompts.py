"""The prompts of an export: ``document``, ``query`` and two per instruction entry, and the query instruction."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from .. import templates
from ..llm2vec import LLM2Vec
from ..provenance import UnknownInstructions, trained_query_instructions

logger = logging.getLogger(__name__)

TEXT_MARKER = "<|llm2vec_text|>"
"""Follows the template's prefix in every exported prompt; the exported tokenizer splits the input there."""
STRIP_MARKER = "<|llm2vec_strip|>"
"""Ends every text-layout prompt; the exported tokenizer removes it and strips the text, as ``templates.encode``."""

ADHOC_PROBES = (
    "Given a title, retrieve the abstract of the paper",
    "  Retrieve passages that answer the question:  ",
    "Find a sentence with the same meaning: ",
)
"""Instructions that are not exported prompts: the chat layout's check passes each as ``prompt=`` and requires
``templates.encode``'s token ids (a plain one, one with spaces and its own colon, one ending in the separator)."""

CHAT_LAYOUT = "chat"
TEXT_LAYOUT = "text"

DOCUMENT_PROMPT = "document"
QUERY_PROMPT = "query"


class ExportError(ValueError):
    """The model cannot be exported exactly; the message says why and what to do. Nothing was written."""


@dataclass(frozen=True)
class ExportedPrompt:
    """One sentence-transformers prompt and the token ids LLM2Vec puts after the text."""

    name: str
    instruction: str
    text: str  # the prompt string: the instruction (chat layout), or prefix, TEXT_MARKER, lead spaces, STRIP_MARKER
    suffix_ids: tuple[int, ...]


def template_prompt(encoder: LLM2Vec, name: str, instruction: str, layout: str = CHAT_LAYOUT) -> ExportedPrompt:
    """The prompt of ``instruction``: the instruction itself (chat layout), or the template's opening with it,
    :data:`TEXT_MARKER`, its trailing spaces and :data:`STRIP_MARKER` (text layout)."""
    tokenizer = encoder.tokenizer
    (encoded,) = templates.encode(tokenizer, encoder.template, [(instruction, "x")], max_length=1 << 30)
    ids = list(encoded.input_ids)
    prefix, suffix = ids[: encoded.text_start], ids[encoded.text_end :]
    if len(prefix) + len(suffix) >= encoder.max_length:
        raise ExportError(
            f"prompt {name!r}: template and instruction take {len(prefix) + len(suffix)} tokens, leaving no room "
            f"for text within max_length {encoder.max_length}; raise max_length or shorten the instruction"
        )
    if layout == CHAT_LAYOUT:
        return ExportedPrompt(name, instruction, instruction, tuple(suffix))
    opening = encoder.template.build(instruction)[0]
    body = opening.rstrip(" ")
    return ExportedPrompt(name, instruction, body + TEXT_MARKER + opening[len(body) :] + STRIP_MARKER, tuple(suffix))


def build_prompts(encoder: LLM2Vec, instructions=None, query_instruction: str = "", layout: str = CHAT_LAYOUT) -> dict:
    """``document``, ``query`` and, per instruction entry, ``<name>`` and ``<name>-document``."""
    instructions = dict(instructions or {})
    reserved = [n for n in instructions if n in (DOCUMENT_PROMPT, QUERY_PROMPT) or n.endswith("-document")]
    if reserved:
        raise ExportError(
            f"instruction names {reserved} clash with the prompts the export writes itself "
            f"({DOCUMENT_PROMPT!r}, {QUERY_PROMPT!r}, '<name>-document'); rename them (use query_instruction "
            "for the query prompt)"
        )
    prompts = {
        DOCUMENT_PROMPT: template_prompt(encoder, DOCUMENT_PROMPT, "", layout),
        QUERY_PROMPT: template_prompt(encoder, QUERY_PROMPT, query_instruction, layout),
    }
    for name, instruction in instructions.items():
        if not isinstance(instruction, str):
            raise ExportError(f"instruction of {name!r}: expected a string, got {type(instruction).__name__}")
        prompts[name] = template_prompt(encoder, name, instruction, layout)
        prompts[f"{name}-document"] = template_prompt(encoder, f"{name}-document", "", layout)
    suffixes = {p.suffix_ids for p in prompts.values()}
    if len(suffixes) > 1:
        raise ExportError(
            "the template puts different tokens after the text for different instructions; the tokenizer's "
            "post-processor can append only one fixed suffix, so this template cannot be exported"
        )
    return prompts


@dataclass(frozen=True)
class QueryInstruction:
    """The instruction of the ``query`` prompt and where it came from (for the report and the model card)."""

    instruction: str
    source: str


def resolve_query_instruction(
    given: str | None, run_config: Mapping | None, run_folder: str | None
) -> QueryInstruction:
    """The ``query`` prompt's instruction: ``given`` when it is a string (``""``: an empty prompt, with a warning);
    otherwise the one instruction the run in ``run_folder`` trained its queries with. Raises :class:`ExportError`,
    listing what the run used, when that is not one non-empty string.
    """
    fix = (
        'pass query_instruction (--query_instruction "...") with the instruction queries should get, or '
        '--query_instruction "" to export an empty query prompt (encode_query then equals encode_document)'
    )
    if given is not None:
        if not isinstance(given, str):
            raise ExportError(
                f"query_instruction={given!r:.80}: expected a string, the instruction queries get ('' for none), or "
                "None to read it from the run's run_config.json"
            )
        if not given.strip():
            logger.warning(
                "the query prompt is empty (query_instruction=''): encode_query will embed exactly as "
                "encode_document, and mteb's sentence-transformers path gives queries no instruction"
            )
        return QueryInstruction(given, "given to the export")
    if not run_config:
        raise ExportError(f"no query instruction: the model has no run_config.json to read it from; {fix}")
    try:
        counts = trained_query_instructions(run_config)
    except UnknownInstructions as e:
        raise ExportError(f"no query instruction: {run_folder}/run_config.json: {e}; {fix}") from None
    if list(counts) == [""]:
        raise ExportError(
            f"no query instruction: the run in {run_folder} trained its queries without one; an empty query "
            f"prompt makes encode_query equal encode_document; {fix}"
        )
    if len(counts) > 1:
        listed = "; ".join(repr(i) for i, _ in counts.most_common(3))
        raise ExportError(
            f"no single query instruction: the run in {run_folder} trained with {len(counts)} ({listed}"
            f"{'; ...' if len(counts) > 3 else ''}); {fix}"
        )
    (instruction,) = counts
    return QueryInstruction(instruction, f"{run_folder}/run_config.json (the instruction its queries trained with)")
