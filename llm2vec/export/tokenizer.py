"""The exported tokenizer and chat template: sentence-transformers' input becomes ``templates.encode``'s token ids."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import templates
from .prompts import STRIP_MARKER, TEXT_MARKER, ExportError

SUFFIX_TOKEN_NAME = "llm2vec_anchor"


_jinja_literal = json.dumps  # a Jinja string literal: JSON's escapes are Jinja's


def export_chat_template(spec: templates.TemplateSpec, closing: str | None = None) -> str:
    """A chat template that renders what :func:`templates.encode` tokenizes, for sentence-transformers' message path.

    It accepts ``[user]`` or ``[system, user]`` (the system message is the instruction) with string contents and
    renders ``body + TEXT_MARKER + lead + text.strip() + TEXT_MARKER + closing`` from ``spec``; any other
    conversation raises, naming what it got.
    """
    turn = spec.turn()
    mark = spec.separator.strip()
    after_mark = spec.separator[spec.separator.index(mark) + len(mark) :] if mark else ""
    closing = turn.closing if closing is None else closing
    opening, closing, separator = (_jinja_literal(x) for x in (turn.opening, closing, spec.separator))
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


def fitting_chat_template(spec: templates.TemplateSpec, tokenizer) -> str:
    """:func:`export_chat_template` of ``spec`` whose rendering ``tokenizer`` (an exported one, chat layout) tokenizes
    to :func:`templates.encode`'s ids: the closing as written, or without its leading spaces where the tokenizer
    gives those a token of their own before a special token (a Metaspace tokenizer that marks only the start of the
    input, as Mistral-7B-Instruct-v0.3's, where ``templates.encode`` drops them)."""
    closing = spec.turn().closing
    probe = templates.DERIVATION_PROBES[0]
    expected = list(templates.encode(tokenizer, spec, [probe], 1 << 20)[0].input_ids)
    messages = [{"role": "system", "content": probe[0]}, {"role": "user", "content": probe[1]}]
    for candidate in dict.fromkeys((closing, closing.lstrip(" "))):
        chat_template = export_chat_template(spec, candidate)
        ids = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=True, return_dict=False)
        if list(ids) == expected:
            return chat_template
    return export_chat_template(spec)  # the export's verification names the difference


def export_tokenizer(
    tokenizer, suffix_ids: Sequence[int], max_length: int, chat_template: str | None = None, pad: str | None = None
):
    """A copy of ``tokenizer`` that splits its input at :data:`TEXT_MARKER`, truncates and pads right (``pad`` where it
    has no pad token) and carries ``chat_template`` (the chat layout) or none (the text layout, which also strips the
    text and appends ``suffix_ids``); input without the markers tokenizes as with ``tokenizer``.
    """
    import copy

    from tokenizers import Regex, normalizers, pre_tokenizers, processors

    tok = copy.deepcopy(tokenizer)
    backend = tok.backend_tokenizer
    split = pre_tokenizers.Split(TEXT_MARKER, behavior="removed")
    backend.pre_tokenizer = (
        split if backend.pre_tokenizer is None else pre_tokenizers.Sequence([split, backend.pre_tokenizer])
    )
    if chat_template is None:  # the text layout
        strip = _regex_literal(STRIP_MARKER)
        # Only the piece after the strip marker (prompt's end and text) is touched: an empty text is no tokens, its
        # lead spaces included (as templates.encode; the prompt alone is then the prefix, the length mean pooling
        # leaves out); then the text's trailing whitespace (\K), then the marker with its leading whitespace.
        stripping = [
            normalizers.Replace(Regex(rf"\s*{strip}\s*\z"), ""),
            normalizers.Replace(Regex(rf"{strip}[\s\S]*?\K\s+\z"), ""),
            normalizers.Replace(Regex(rf"{strip}\s*"), ""),
        ]
        backend.normalizer = normalizers.Sequence(stripping + ([backend.normalizer] if backend.normalizer else []))
        suffix = {
            "id": SUFFIX_TOKEN_NAME,
            "ids": list(suffix_ids),
            "tokens": tok.convert_ids_to_tokens(list(suffix_ids)),
        }
        backend.post_processor = processors.TemplateProcessing(
            single=["$A", SUFFIX_TOKEN_NAME], pair=["$A", "$B:1", SUFFIX_TOKEN_NAME], special_tokens=[suffix]
        )
    tok.model_max_length = max_length
    if tok.pad_token is None and pad is not None:
        tok.pad_token = pad
    tok.padding_side = "right"
    tok.truncation_side = "right"
    tok.chat_template = chat_template  # None in the text layout: the model's own would be applied to messages
    return tok


def _regex_literal(text: str) -> str:
    """``text`` as a literal in the tokenizers library's (Oniguruma) regex syntax."""
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in text)


# model types that transformers maps to its generic TokenizersBackend (which reads tokenizer.json as it is)
GENERIC_TOKENIZER_TYPES = ("stablelm", "gpt_bigcode", "olmo2")


def _pipeline(tokenizer) -> dict[str, Any]:
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    return {k: state.get(k) for k in ("normalizer", "pre_tokenizer", "post_processor")}


def write_tokenizer(tokenizer, folder: Path) -> dict[str, Any]:
    """Save ``tokenizer`` so that every transformers version reads ``tokenizer.json`` as it is (no class that rebuilds
    the pipeline), its chat template (or none) the only one. Returns the ``processor_kwargs`` that load it with its
    exported pipeline: for a model type whose tokenizer transformers rebuilds from code anyway (dropping the split at
    :data:`TEXT_MARKER`), ``tokenizer_type`` names one whose class loads ``tokenizer.json`` unchanged."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    tokenizer.save_pretrained(folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("add_bos_token", "add_eos_token", "chat_template", "is_local", "local_files_only"):
        config.pop(key, None)
    config.update(padding_side="right", truncation_side="right")
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    template_file = folder / "chat_template.jinja"
    if tokenizer.chat_template is not None:
        template_file.write_text(tokenizer.chat_template, encoding="utf-8")
    elif template_file.exists():
        template_file.unlink()
    generic = [t for t in GENERIC_TOKENIZER_TYPES if TOKENIZER_MAPPING_NAMES.get(t) == "TokenizersBackend"]
    for kwargs in [{}, *({"tokenizer_type": t} for t in generic)]:
        if _pipeline(AutoTokenizer.from_pretrained(folder, trust_remote_code=False, **kwargs)) == _pipeline(tokenizer):
            return kwargs
    raise ExportError(
        f"transformers' AutoTokenizer rebuilds this {type(tokenizer).__name__}'s pipeline on loading, dropping the "
        "split between prompt and text that exact export needs; this tokenizer cannot be exported"
    )
