"""Export a trained model as a sentence-transformers folder that embeds exactly as :meth:`LLM2Vec.encode`.

``SentenceTransformer(folder)`` loads the result with no custom code and no ``trust_remote_code``:

- the root holds the decoder body (``AutoModel``, safetensors, any LoRA adapter merged), the tokenizer and
  ``sentence_bert_config.json`` (a ``Transformer`` module: text and message modalities in the chat layout,
  text only in the text layout; below) and, in the chat layout, the export's ``chat_template.jinja``;
- ``1_Pooling``: ``lasttoken`` for the paper's ``eos_token`` pooling (the anchor is the last real token),
  or ``mean`` with ``include_prompt: false`` for ``mean`` pooling;
- ``2_Normalize`` when the embeddings are normalised (the default);
- ``config_sentence_transformers.json``: the prompts, ``default_prompt_name: "document"``, cosine similarity;
- ``llm2vec_config.json`` (so :meth:`LLM2Vec.from_pretrained` loads the folder too) and ``README.md``.

How an LLM2Vec input is expressed in sentence-transformers. :func:`llm2vec.templates.encode` builds
``prefix(instruction) + text[:budget] + suffix``, tokenizing prefix and text separately and appending the
suffix (the anchor token) after truncation. Here:

1. text layout: the suffix goes into the tokenizer's post-processor (``TemplateProcessing("$A <suffix>")``); a
   tokenizer reserves room for the tokens its post-processor adds when it truncates, so a text longer
   than ``max_seq_length`` still ends in the anchor (the chat layout renders the suffix itself, below, and
   tokenizes without special tokens, so the post-processor adds nothing there);
2. the instruction is a sentence-transformers *prompt*, and how it reaches the tokenizer depends on the layout:

   - ``chat`` (the default; ``eos_token`` pooling): the folder declares sentence-transformers' ``message``
     modality, so every text becomes a user message and a prompt becomes a system message before it; the
     exported tokenizer's chat template (:func:`export_chat_template`, built from the template spec) renders
     ``prefix(instruction) + text + closing``, joining the instruction as :func:`templates.join_instruction`
     does. Any instruction passed as ``prompt=`` (an exported one or an ad-hoc one) therefore embeds as
     ``LLM2Vec.encode([[instruction, text]])``, and the prompts written are the plain instructions. A
     conversation the template cannot express (a text pair, an assistant turn, a system message of the
     user's own next to a prompt) raises the template's error instead of embedding something else.
     Truncation cuts the rendered closing, which sentence-transformers restores over the last tokens (its
     ``restore_suffix``): the text is cut and the anchor ends the row, as in ``templates.encode``;
   - ``text`` (``named_prompts_only``; required for ``mean`` pooling, which needs sentence-transformers' text
     path to leave the prompt out of the mean): each prompt is the prefix text followed by
     :data:`TEXT_MARKER`, prepended to the text as a string. Only the exported prompts embed exactly: an
     ad-hoc ``prompt=`` string has no marker and no chat header and gives other vectors, which the text path
     cannot detect, so this layout is written only when asked for;

   in both, the rendered string carries :data:`TEXT_MARKER` between prefix and text (and, in the chat layout,
   between text and closing); the exported tokenizer's pre-tokenizer splits the input there and drops the
   marker, so the pieces are tokenized separately, exactly as ``templates.encode`` does, even where
   tokenizing them as one string would merge tokens across a boundary (Mistral's ``"[INST] "`` followed by a
   word);
3. truncation is from the right at ``model_max_length = max_length``: the prompt is on the left, so only
   the text is cut; padding is on the right (position ids then equal LLM2Vec's).

The prefix and closing are derived from the template spec and checked against ``templates.encode`` itself
(the token ids before ``text_start`` and after ``text_end``), not from per-family strings, so a change of a
template is exported as it is. Prompts: ``document`` (no instruction, the default, as ``LLM2Vec.encode(text)``),
``query`` (``query_instruction``, empty by default), and for each instruction entry ``name`` both
``name`` (with the instruction) and ``name-document`` (without): mteb's sentence-transformers path picks
``<task>-document`` for a retrieval corpus and ``<task>`` for queries and symmetric tasks, which is the
routing of :mod:`llm2vec.evaluation.mteb_wrapper`.

What cannot be exported (:class:`ExportError`, nothing is written): pooling modes sentence-transformers
lacks (``last_token``: the token before the anchor; ``weighted_mean``: weights counted from the first text
token), ``mean`` pooling without ``named_prompts_only``, a ``max_length`` above the model's
``max_position_embeddings`` (sentence-transformers caps its
length there), a template whose suffix depends on the instruction, and a tokenizer for which the split
at the marker does not reproduce separate tokenization (e.g. a SentencePiece ``Metaspace`` that prepends
``"▁"`` to the first piece only). Before the folder is renamed into place it is loaded with
``SentenceTransformer`` and checked on probe texts (short, starting with spaces, newlines, digits,
special tokens, and longer than ``max_length``): the same token ids as ``templates.encode`` for every
prompt (and, in the chat layout, for the ad-hoc instructions of :data:`ADHOC_PROBES`), embeddings with cosine
>= :data:`MIN_COSINE` to ``LLM2Vec.encode``, and (chat layout) that a conversation of two user turns is refused.

What the chat layout cannot detect: an ad-hoc instruction so long that template, instruction and anchor fill
``max_length`` (``templates.encode`` raises; sentence-transformers cuts the instruction, and a chat template
cannot count tokens). The exported prompts are checked for this before anything is written.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import templates
from .io import JsonFileError, atomic_dir, read_json_file, remove_stale_temporaries
from .llm2vec import CONFIG_NAME, LLM2Vec, decoder_body, default_device, resolve_dtype
from .model_card import ModelCardInputs, render_model_card
from .model_files import check_model_files

logger = logging.getLogger(__name__)

TEXT_MARKER = "<|llm2vec_text|>"
"""Follows the template's prefix in every exported prompt; the exported tokenizer splits the input there and
removes it."""
STRIP_MARKER = "<|llm2vec_strip|>"
"""Ends every exported prompt (after the spaces ``templates.encode`` puts before a text); the exported tokenizer's
normalizer removes it with the whitespace that follows, and the whitespace at the end of the input: the text is
stripped, as ``templates.encode`` strips it."""

ADHOC_PROBES = (
    "Given a title, retrieve the abstract of the paper",
    "  Retrieve passages that answer the question:  ",
    "Find a sentence with the same meaning: ",
)
"""Instructions that are not exported prompts: the chat layout's check passes each as ``prompt=`` and requires
``templates.encode``'s token ids (a plain one, one with spaces and its own colon, one ending in the separator)."""

CHAT_LAYOUT = "chat"
TEXT_LAYOUT = "text"

ST_POOLING = {"eos_token": "lasttoken", "mean": "mean"}
"""LLM2Vec pooling mode -> sentence-transformers ``Pooling`` mode, for the modes it can express exactly."""

NOT_EXPORTABLE_POOLING = {
    "last_token": "it reads the token before the anchor; sentence-transformers' lasttoken reads the anchor itself",
    "weighted_mean": "its weights count from the first text token; sentence-transformers' weightedmean counts "
    "from the first token of the sequence (prompt included)",
}

DOCUMENT_PROMPT = "document"
QUERY_PROMPT = "query"
MIN_COSINE = 0.99999
MIN_COSINE_16BIT = 0.9999
"""Required cosine to ``LLM2Vec.encode`` per probe text: float32 weights, and bfloat16/float16 weights (where the
two computations round differently; the token ids are still required to be identical)."""
SUFFIX_TOKEN_NAME = "llm2vec_anchor"

PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    " a text that starts with a space",
    "\na text that starts with a newline",
    "  two spaces, then words",
    "0123 numbers first",
    "Ünïcödé and accents",
    "",
    "x",
    "(parentheses) [brackets]: punctuation first!",
)

ST_TRANSFORMER_CONFIG = {
    "transformer_task": "feature-extraction",
    "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
    "module_output_name": "token_embeddings",
}
"""``sentence_bert_config.json`` of the text layout: text only, so that sentence-transformers never renders a chat
template."""

ST_CHAT_TRANSFORMER_CONFIG = {
    "transformer_task": "feature-extraction",
    "modality_config": {
        "text": {"method": "forward", "method_output_name": "last_hidden_state"},
        "message": {"method": "forward", "method_output_name": "last_hidden_state", "format": "flat"},
    },
    "module_output_name": "token_embeddings",
}
"""``sentence_bert_config.json`` of the chat layout: with the ``message`` modality declared, sentence-transformers
turns every text into a user message and a prompt into a system message, and renders them with the exported chat
template; ``flat`` gives the template string contents."""


class ExportError(ValueError):
    """The model cannot be exported exactly; the message says why and what to do. Nothing was written."""


@dataclass(frozen=True)
class ExportedPrompt:
    """One sentence-transformers prompt and the token ids LLM2Vec puts before and after the text."""

    name: str
    instruction: str
    text: str  # the prompt string: the instruction (chat layout), or prefix, TEXT_MARKER, lead spaces, STRIP_MARKER
    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]


# ---------------------------------------------------------------------------------------------- prompts


def template_prompt(encoder: LLM2Vec, name: str, instruction: str, layout: str = CHAT_LAYOUT) -> ExportedPrompt:
    """The prompt of ``instruction``. Chat layout: the instruction itself (the chat template adds the rest). Text
    layout: the template's opening with the instruction (the string whose ids ``templates.encode`` puts before the
    text), :data:`TEXT_MARKER`, the spaces that end that string (they start the text piece, where a sentencepiece
    dummy prefix would otherwise be missing), :data:`STRIP_MARKER`. Whether the exported tokenizer gives exactly
    the ids of ``templates.encode`` is checked by :func:`verify_export` before anything is written."""
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
        return ExportedPrompt(name, instruction, instruction, tuple(prefix), tuple(suffix))
    opening = encoder.template.build(instruction)[0]
    body = opening.rstrip(" ")
    text = body + TEXT_MARKER + opening[len(body) :] + STRIP_MARKER
    return ExportedPrompt(name, instruction, text, tuple(prefix), tuple(suffix))


def build_prompts(
    encoder: LLM2Vec,
    instructions: Mapping[str, str] | None = None,
    query_instruction: str = "",
    layout: str = CHAT_LAYOUT,
) -> dict[str, ExportedPrompt]:
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


# ---------------------------------------------------------------------------------------------- chat template


def _jinja_literal(text: str) -> str:
    """``text`` as a Jinja string literal (JSON's escapes are Jinja's)."""
    return json.dumps(text)


def export_chat_template(spec: templates.TemplateSpec) -> str:
    """A chat template that renders what :func:`templates.encode` tokenizes, for sentence-transformers' message path.

    It accepts ``[user]`` (no instruction) or ``[system, user]`` (the system message is the instruction, which is
    how sentence-transformers passes ``prompt=``), both with string contents, and renders
    ``body + TEXT_MARKER + lead + text.strip() + TEXT_MARKER + closing``: ``body`` is ``opening +
    join_instruction(instruction, separator)`` without its trailing spaces, ``lead`` those spaces (left out for an
    empty text, as ``templates.encode`` does). Every other conversation raises, naming what it got. Opening,
    separator and closing are read from ``spec``; no family is named here.
    """
    turn = spec.turn()
    mark = spec.separator.strip()
    after_mark = spec.separator[spec.separator.index(mark) + len(mark) :] if mark else ""
    opening, closing, separator = (_jinja_literal(x) for x in (turn.opening, turn.closing, spec.separator))
    marker = _jinja_literal(TEXT_MARKER)
    refused = _jinja_literal(
        "this anchor-embedding export embeds one text, with an optional instruction passed as prompt= (rendered as "
        "a system message); it cannot embed a conversation of roles "
    )
    advice = _jinja_literal(
        " (text pairs, other roles and a system message next to prompt= are refused: encode each text by itself)"
    )
    joined = (
        f"{{%- elif instruction.endswith({_jinja_literal(mark)}) -%}}"
        f"{{%- set prefix = {opening} ~ instruction ~ {_jinja_literal(after_mark)} -%}}"
        if mark
        else ""
    )
    return (
        f"{{#- anchor-embedding export of template {spec.name!r}: LLM2Vec's prompt, text and anchor -#}}\n"
        "{%- set roles = messages | map(attribute='role') | list -%}\n"
        "{%- if roles == ['user'] -%}{%- set instruction = '' -%}\n"
        "{%- elif roles == ['system', 'user'] -%}{%- set instruction = messages[0]['content'] -%}\n"
        f"{{%- else -%}}{{{{- raise_exception({refused} ~ roles | join(', ') ~ {advice}) -}}}}\n"
        "{%- endif -%}\n"
        "{%- set content = messages[-1]['content'] -%}\n"
        "{%- if instruction is not string or content is not string -%}\n"
        f"{{{{- raise_exception({_jinja_literal('this anchor-embedding export embeds text only: the prompt and the input must be strings')}) -}}}}\n"
        "{%- endif -%}\n"
        "{%- set instruction = instruction | trim -%}\n"
        f"{{%- if not instruction -%}}{{%- set prefix = {opening} -%}}\n"
        f"{joined}"
        f"{{%- else -%}}{{%- set prefix = {opening} ~ instruction ~ {separator} -%}}{{%- endif -%}}\n"
        "{%- set body = prefix.rstrip(' ') -%}\n"
        "{%- set text = content | trim -%}\n"
        f"{{{{- body ~ {marker} -}}}}{{%- if text -%}}{{{{- prefix[body | length:] ~ text -}}}}{{%- endif -%}}"
        f"{{{{- {marker} ~ {closing} -}}}}\n"
    )


# ---------------------------------------------------------------------------------------------- tokenizer


def export_tokenizer(tokenizer, suffix_ids: Sequence[int], max_length: int, chat_template: str | None = None):
    """A copy of ``tokenizer`` that strips the text (:data:`STRIP_MARKER`), splits at :data:`TEXT_MARKER`, appends
    ``suffix_ids`` (when called with special tokens: the text layout), truncates and pads right, and carries
    ``chat_template`` (the chat layout's, which renders the suffix itself) or none."""
    import copy

    from tokenizers import Regex, normalizers, pre_tokenizers, processors

    tok = copy.deepcopy(tokenizer)
    backend = tok.backend_tokenizer
    strip = _regex_literal(STRIP_MARKER)
    # First the input's trailing whitespace (but not the lead spaces of an empty text, which sit just before the
    # strip marker), then the marker with the text's leading whitespace.
    # An empty text (only whitespace after the marker) is no tokens at all, lead spaces included (as in
    # templates.encode; it also makes the prompt alone tokenize to the prefix, which sentence-transformers' mean
    # pooling takes as the prompt's length). Then the input's trailing whitespace, then the marker with the
    # text's leading whitespace.
    stripping = [
        normalizers.Replace(Regex(rf"\s*{strip}\s*\z"), ""),
        normalizers.Replace(Regex(r"\s+\z"), ""),
        normalizers.Replace(Regex(rf"{strip}\s*"), ""),
    ]
    backend.normalizer = normalizers.Sequence(stripping + ([backend.normalizer] if backend.normalizer else []))
    split = pre_tokenizers.Split(TEXT_MARKER, behavior="removed")
    backend.pre_tokenizer = (
        split if backend.pre_tokenizer is None else pre_tokenizers.Sequence([split, backend.pre_tokenizer])
    )
    suffix = {"id": SUFFIX_TOKEN_NAME, "ids": list(suffix_ids), "tokens": tok.convert_ids_to_tokens(list(suffix_ids))}
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", SUFFIX_TOKEN_NAME], pair=["$A", "$B:1", SUFFIX_TOKEN_NAME], special_tokens=[suffix]
    )
    tok.model_max_length = max_length
    tok.padding_side = "right"
    tok.truncation_side = "right"
    tok.chat_template = chat_template  # None in the text layout: the model's own would be applied to messages
    return tok


def _regex_literal(text: str) -> str:
    """``text`` as a literal in the tokenizers library's (Oniguruma) regex syntax."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in text)


GENERIC_TOKENIZER_TYPES = ("stablelm", "gpt_bigcode", "olmo2")
"""Model types that transformers maps to its generic ``TokenizersBackend`` (which reads ``tokenizer.json`` as it
is); one is named as ``tokenizer_type`` when the model's own tokenizer class would rebuild the pipeline."""


def _pipeline(tokenizer) -> dict[str, Any]:
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    return {k: state.get(k) for k in ("normalizer", "pre_tokenizer", "post_processor")}


def tokenizer_loading_kwargs(folder: Path, saved) -> dict[str, Any]:
    """``processor_kwargs`` under which ``AutoTokenizer`` reads the saved tokenizer with its exported pipeline.

    transformers 5 rebuilds the normalizer and pre-tokenizer of some model types from code (Qwen2's
    ``Qwen2Tokenizer``, whatever ``tokenizer.json`` says), which drops the split at :data:`TEXT_MARKER`. For
    those, ``tokenizer_type`` names a model type whose tokenizer class is the generic ``TokenizersBackend``,
    which loads ``tokenizer.json`` unchanged (the model type's own pipeline is in that file: it was saved from
    the tokenizer LLM2Vec uses).
    """
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if _pipeline(AutoTokenizer.from_pretrained(folder, trust_remote_code=False)) == _pipeline(saved):
        return {}
    for model_type in GENERIC_TOKENIZER_TYPES:
        if TOKENIZER_MAPPING_NAMES.get(model_type) == "TokenizersBackend":
            kwargs = {"tokenizer_type": model_type}
            if _pipeline(AutoTokenizer.from_pretrained(folder, trust_remote_code=False, **kwargs)) == _pipeline(saved):
                return kwargs
    raise ExportError(
        f"transformers' AutoTokenizer rebuilds this {type(saved).__name__}'s pipeline on loading, dropping the "
        "split between prompt and text that exact export needs; this tokenizer cannot be exported"
    )


def _fix_tokenizer_config(folder: Path, chat_template: str | None = None) -> None:
    """Make every transformers version read ``tokenizer.json`` as it is (no class that rebuilds the pipeline), with
    ``chat_template`` as the only chat template (in ``chat_template.jinja``) or none."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("add_bos_token", "add_eos_token", "chat_template", "is_local", "local_files_only"):
        config.pop(key, None)
    config.update(padding_side="right", truncation_side="right")
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    template_file = folder / "chat_template.jinja"
    if chat_template is not None:
        template_file.write_text(chat_template, encoding="utf-8")
    elif template_file.exists():
        template_file.unlink()


# ---------------------------------------------------------------------------------------------- checks


def check_exportable(encoder: LLM2Vec) -> None:
    """Refuse what sentence-transformers cannot express exactly (pooling, length)."""
    if encoder.pooling_mode not in ST_POOLING:
        raise ExportError(
            f"pooling_mode {encoder.pooling_mode!r} cannot be exported: "
            f"{NOT_EXPORTABLE_POOLING.get(encoder.pooling_mode, 'no sentence-transformers equivalent')}. "
            f"Exportable modes: {', '.join(ST_POOLING)}"
        )
    limit = getattr(decoder_body(encoder.model).config, "max_position_embeddings", None)
    if limit is not None and encoder.max_length > limit:
        raise ExportError(
            f"max_length {encoder.max_length} exceeds the model's max_position_embeddings {limit}, where "
            f"sentence-transformers caps max_seq_length; export with max_length <= {limit}"
        )


def probe_texts(tokenizer, max_length: int) -> list[str]:
    """:data:`PROBE_TEXTS` plus one text of more than ``max_length`` tokens (tests the truncation)."""
    long_text = PROBE_TEXTS[0]
    while len(tokenizer(long_text, add_special_tokens=False)["input_ids"]) <= max_length:
        long_text += " " + PROBE_TEXTS[0]
    return [*PROBE_TEXTS, long_text]


def _real_ids(features: Mapping[str, torch.Tensor]) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"])]


def verify_export(
    folder: str | os.PathLike,
    encoder_ids: Mapping[str, list[list[int]]],
    reference: Mapping[str, torch.Tensor],
    texts: Sequence[str],
    normalize: bool,
    device: str | torch.device = "cpu",
    adhoc: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Load ``folder`` with ``SentenceTransformer`` and compare token ids (every prompt) and embeddings.

    ``encoder_ids``: label -> the ids ``templates.encode`` gives for ``texts``; ``reference``: label ->
    ``LLM2Vec.encode`` embeddings of ``texts`` for the labels whose embeddings are checked. A label is an exported
    prompt's name, or a key of ``adhoc`` (label -> an instruction passed as ``prompt=`` as it is: the chat
    layout's ad-hoc prompts), whose check also requires that a conversation of two user turns is refused. Returns the smallest cosine;
    raises :class:`ExportError` on any difference.
    """
    from sentence_transformers import SentenceTransformer

    adhoc = dict(adhoc or {})
    model = SentenceTransformer(str(folder), device=str(device), local_files_only=True, trust_remote_code=False)

    def encode_kwargs(label: str) -> dict[str, str]:
        return {"prompt": adhoc[label]} if label in adhoc else {"prompt_name": label}

    for label, expected in encoder_ids.items():
        prompt = adhoc[label] if label in adhoc else model.prompts[label]
        features = model.preprocess(list(texts), prompt=prompt)
        got = _real_ids(features)
        for text, a, b in zip(texts, got, expected):
            if a != b:
                raise ExportError(
                    f"prompt {label!r}: sentence-transformers tokenizes {text[:40]!r} to {len(a)} ids that differ "
                    f"from LLM2Vec's {len(b)} (first difference at position "
                    f"{next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}); "
                    "this tokenizer cannot be exported exactly"
                )
    if adhoc:  # the chat layout refuses what its template cannot express, rather than embed something else
        two_turns = [{"role": "user", "content": text} for text in texts[:2]]
        try:
            model.encode([two_turns], show_progress_bar=False)
        except Exception as e:  # jinja2's TemplateError, raised by the exported chat template
            if "anchor-embedding export" not in str(e):
                raise ExportError(
                    f"two user turns failed with an unexpected error ({e}); the export was not written"
                ) from None
        else:
            raise ExportError(
                "the exported chat template embeds two user turns instead of refusing them; the export was not written"
            )
    worst = 1.0
    for label, ref in reference.items():
        raw = model.encode(
            list(texts), convert_to_tensor=True, show_progress_bar=False, batch_size=1, **encode_kwargs(label)
        )
        emb = raw.float().cpu()
        cos = torch.nn.functional.cosine_similarity(emb, ref.float(), dim=-1)
        worst = min(worst, cos.min().item())
        needed = MIN_COSINE if raw.dtype == torch.float32 else MIN_COSINE_16BIT
        if cos.min().item() < needed:
            i = int(cos.argmin())
            raise ExportError(
                f"prompt {label!r}: the exported model embeds {texts[i][:40]!r} with cosine {cos[i].item():.6f} "
                f"to LLM2Vec.encode (needed >= {needed}); the export was not written"
            )
        tolerance = 1e-4 if raw.dtype == torch.float32 else 1e-2  # a 16-bit vector is normalised to 16 bits
        if normalize and not torch.allclose(emb.norm(dim=-1), torch.ones(len(texts)), atol=tolerance):
            raise ExportError("the exported embeddings are not normalised although normalize=True")
    del model
    return {
        "min_cosine": worst,
        "prompts_checked": len(encoder_ids),
        "embeddings_checked": list(reference),
        "texts": len(texts),
    }


# ---------------------------------------------------------------------------------------------- export


def read_instructions(path: str | os.PathLike, names: Sequence[str] | None = None) -> dict[str, str]:
    """``name -> instruction`` from a JSON object (the repository's MTEB ``task_to_instructions.json``), keeping
    ``names`` (all entries when None or ``["all"]``)."""
    path = Path(path)
    if not path.exists():
        raise ExportError(
            f"instructions file {str(path)!r} not found; pass a JSON object mapping task names to "
            "instructions (the repository ships one as mteb/task_to_instructions.json among its test configs)"
        )
    try:
        mapping = read_json_file(path, "instructions file")
    except JsonFileError as e:
        raise ExportError(str(e)) from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ExportError(f"instructions file {str(path)!r} must be a JSON object mapping names to instruction strings")
    if names is None or list(names) == ["all"]:
        return mapping
    missing = [n for n in names if n not in mapping]
    if missing:
        raise ExportError(f"{path}: no instruction for {missing}; add them there or leave them out of the task list")
    return {n: mapping[n] for n in names}


def mteb_category_table(results_dirs: Sequence[str | os.PathLike], tasks_file: str | os.PathLike | None) -> str:
    """Category averages in the layout of the paper's Table 1 for mteb result folders, the tasks grouped as
    ``tasks_file`` says (the repository's MTEB ``tasks.json``), for the export's model card. Raises
    :class:`llm2vec.evaluation.tables.TableError` for a folder without result files of those tasks."""
    if not tasks_file:
        raise ValueError(
            "mteb_results given without mteb_tasks_file: the card needs the tasks file that groups "
            "the results into categories (the repository's MTEB tasks.json)"
        )
    from .evaluation import tables
    from .evaluation.benchmark import load_benchmark

    benchmark = load_benchmark(tasks_file)
    runs = [tables.read_run(folder, benchmark, label=Path(folder).name) for folder in results_dirs]
    return tables.render_category_table(runs, benchmark, paper=None)


def _default_dtype(path: str, trust_remote_code: bool = False) -> torch.dtype:
    """The dtype in the checkpoint's config.json, float32 when it names none."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), "dtype", None)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def export_sentence_transformers(
    base_model_name_or_path: str,
    output_dir: str | os.PathLike,
    peft_model_name_or_path: str | None = None,
    *,
    instructions: Mapping[str, str] | None = None,
    task_to_instructions_fp: str | os.PathLike | None = None,
    tasks: Sequence[str] | None = None,
    query_instruction: str = "",
    pooling_mode: str | None = None,
    max_length: int | None = None,
    template: str | None = None,
    normalize: bool = True,
    dtype: str | torch.dtype | None = None,
    mteb_results: Sequence[str | os.PathLike] = (),
    mteb_tasks_file: str | os.PathLike | None = None,
    verify_embeddings: bool = True,
    device: str | torch.device | None = None,
    overwrite: bool = False,
    named_prompts_only: bool = False,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Write a sentence-transformers folder to ``output_dir`` (see the module docstring); returns a summary.

    Args:
        base_model_name_or_path, peft_model_name_or_path: as :meth:`LLM2Vec.load`; the adapter is merged.
        instructions: prompt name -> instruction (e.g. mteb task name -> its instruction).
        task_to_instructions_fp, tasks: read ``instructions`` from a ``task -> instruction`` JSON file,
            keeping the named ``tasks`` (all entries when ``tasks`` is None or ``["all"]``).
        query_instruction: the instruction of the ``query`` prompt (``encode_query``); empty by default.
        pooling_mode, max_length, template: override the saved ``llm2vec_config.json``.
        normalize: add a ``Normalize`` module (unit-length embeddings; cosine = dot product).
        dtype: dtype of the saved weights; default the base checkpoint's (float32 if it names none).
        mteb_results: folders of mteb result files, shown in the model card (Table 1 layout).
        mteb_tasks_file: the tasks file that groups ``mteb_results`` into categories (needed with them).
        verify_embeddings: also compare embeddings (loads the model a second time); token ids are always
            compared.
        device: where the check embeds (both models); default the GPU when there is one.
        overwrite: replace an existing ``output_dir``.
        named_prompts_only: write the text layout (module docstring), where only the exported prompts embed
            exactly and an ad-hoc ``prompt=`` string silently gives other vectors; required for ``mean`` pooling.
            Default: the chat layout, where any instruction passed as ``prompt=`` embeds as ``LLM2Vec.encode``.
        trust_remote_code: let the model folder's own code run while reading it (:mod:`llm2vec.model_files`;
            refused by default). The exported folder is read back without it.
    """
    check_model_files(base_model_name_or_path, peft_model_name_or_path, trust_remote_code)
    output_dir = Path(output_dir)
    if output_dir.exists() and not overwrite:
        raise ExportError(f"output_dir {output_dir} exists; choose another folder or pass overwrite")
    given = dict(instructions or {})
    if task_to_instructions_fp is not None:
        given.update(read_instructions(task_to_instructions_fp, tasks))
    elif tasks:
        raise ExportError("tasks were named but no task_to_instructions_fp was given to read their instructions from")

    save_dtype = (
        resolve_dtype(dtype) if dtype is not None else _default_dtype(base_model_name_or_path, trust_remote_code)
    )
    encoder = LLM2Vec.load(
        base_model_name_or_path,
        peft_model_name_or_path,
        merge_peft=True,
        pooling_mode=pooling_mode,
        max_length=max_length,
        template=template,
        dtype=torch.float32,
        trust_remote_code=trust_remote_code,
    )
    check_exportable(encoder)
    layout = TEXT_LAYOUT if named_prompts_only else CHAT_LAYOUT
    if layout == CHAT_LAYOUT and encoder.pooling_mode != "eos_token":
        raise ExportError(
            f"pooling_mode {encoder.pooling_mode!r}: sentence-transformers' chat path, which maps an ad-hoc prompt= "
            "onto the template, cannot leave the prompt out of the mean; export with named_prompts_only "
            "(--named_prompts_only), where only the exported prompts embed exactly"
        )
    prompts = build_prompts(encoder, given, query_instruction, layout)
    suffix_ids = next(iter(prompts.values())).suffix_ids
    chat_template = export_chat_template(encoder.template) if layout == CHAT_LAYOUT else None
    body = decoder_body(encoder.model).eval()  # saved from the CPU below
    for parameter in body.parameters():  # parameters only: buffers such as RoPE's inv_freq stay float32, as
        parameter.data = parameter.data.to(save_dtype)  # from_pretrained(dtype=...) leaves them
    encoder.eval()

    device = torch.device(device) if device is not None else default_device()
    texts = probe_texts(encoder.tokenizer, encoder.max_length)
    instruction_of = {name: p.instruction for name, p in prompts.items()}
    adhoc = {}
    if layout == CHAT_LAYOUT:  # instructions that are no exported prompt, passed as prompt= as they are
        adhoc = {f"prompt={text!r}": text for text in ADHOC_PROBES}
        instruction_of.update(adhoc)
    encoder_ids = {
        label: [list(e.input_ids) for e in encoder.encode_ids([(instruction, t) for t in texts])]
        for label, instruction in instruction_of.items()
    }
    reference = {}
    if verify_embeddings:  # the plain prompt, one with an instruction, one ad-hoc (token ids are checked for all)
        encoder.to(device)
        for label in [DOCUMENT_PROMPT, *[n for n in given][:1], *list(adhoc)[:1]]:
            items = [[instruction_of[label], t] for t in texts]
            reference[label] = encoder.encode(
                items,
                batch_size=1,
                show_progress_bar=False,
                convert_to_tensor=True,
                normalize_embeddings=normalize,
                device=device,
            ).cpu()

    card = render_model_card(
        ModelCardInputs.for_export(
            base_model_name_or_path,
            peft_model_name_or_path,
            encoder=encoder,
            prompts=list(prompts),
            normalize=normalize,
            dtype=save_dtype,
            adhoc_prompts=layout == CHAT_LAYOUT,
            text_marker=TEXT_MARKER,
            mteb_results=mteb_results,
            mteb_table=mteb_category_table(mteb_results, mteb_tasks_file) if mteb_results else "",
            output_dir=output_dir,
        )
    )
    remove_stale_temporaries(output_dir)
    with atomic_dir(output_dir, replace=overwrite) as tmp:
        body.to("cpu").save_pretrained(tmp, safe_serialization=True)
        exported_tokenizer = export_tokenizer(encoder.tokenizer, suffix_ids, encoder.max_length, chat_template)
        exported_tokenizer.save_pretrained(tmp)
        _fix_tokenizer_config(tmp, chat_template)
        processor_kwargs = tokenizer_loading_kwargs(tmp, exported_tokenizer)
        llm2vec_settings = encoder.llm2vec_config()
        hidden = body.config.hidden_size
        del encoder, body
        gc.collect()
        _write_st_files(tmp, prompts, hidden, llm2vec_settings, normalize, processor_kwargs, layout)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        for path in tmp.rglob("*"):  # some writers leave files private (0600); the folder is meant to be shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        report = verify_export(tmp, encoder_ids, reference, texts, normalize, device, adhoc)
    report.update(
        output_dir=str(output_dir),
        layout=layout,
        processor_kwargs=processor_kwargs,
        prompts=list(prompts),
        dtype=str(save_dtype).replace("torch.", ""),
        pooling=ST_POOLING[llm2vec_settings["pooling_mode"]],
        max_seq_length=llm2vec_settings["max_length"],
    )
    return report


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_st_files(
    folder: Path,
    prompts: Mapping[str, ExportedPrompt],
    hidden: int,
    settings: Mapping[str, Any],
    normalize: bool,
    processor_kwargs: Mapping[str, Any],
    layout: str = CHAT_LAYOUT,
) -> None:
    """sentence-transformers' own configuration files (the layout ``SentenceTransformer.save`` writes)."""
    import sentence_transformers
    import transformers

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.base.modules.normalize.Normalize",
            }
        )
        _write_json(
            folder / "2_Normalize" / "config.json",
            {"module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding"},
        )
    _write_json(folder / "modules.json", modules)
    _write_json(
        folder / "sentence_bert_config.json",
        {
            **(ST_CHAT_TRANSFORMER_CONFIG if layout == CHAT_LAYOUT else ST_TRANSFORMER_CONFIG),
            **({"processor_kwargs": dict(processor_kwargs)} if processor_kwargs else {}),
        },
    )
    _write_json(
        folder / "1_Pooling" / "config.json",
        {
            "embedding_dimension": hidden,
            "pooling_mode": ST_POOLING[settings["pooling_mode"]],
            "include_prompt": settings["pooling_mode"] == "eos_token",  # mean pooling leaves the prompt out
        },
    )
    _write_json(
        folder / "config_sentence_transformers.json",
        {
            "__version__": {
                "sentence_transformers": sentence_transformers.__version__,
                "transformers": transformers.__version__,
                "pytorch": torch.__version__,
            },
            "model_type": "SentenceTransformer",
            "prompts": {name: p.text for name, p in prompts.items()},
            "default_prompt_name": DOCUMENT_PROMPT,
            "similarity_fn_name": "cosine",
        },
    )
    _write_json(folder / CONFIG_NAME, dict(settings))
