"""Prompt templates: one user turn per model family, shared by training and evaluation.

Contract: an ``(instruction, text)`` input gives the token ids of one user turn of the model's own chat template
(no default system turn), and :func:`encode` appends the closing after truncation, so the anchor (an EOS id of
the model) is always the last token."""

from __future__ import annotations

import functools
import logging
import os

from .template_encoding import (  # noqa: F401  (re-exported: the templates' public names live here)
    EVALUATION_SEPARATOR,
    TRAINING_SEPARATOR,
    EncodedText,
    TemplateSpec,
    UserTurn,
    adds_leading_space,
    chat_difference,
    chat_template_mismatch,
    encode,
    eos_ids,
    join_instruction,
    prompt_parts,
    tokenize_closing,
)

logger = logging.getLogger("llm2vec")


_REGISTRY: dict[str, TemplateSpec] = {}


def register_template(spec: TemplateSpec, overwrite: bool = False) -> TemplateSpec:
    """Add a family. Detection tries families in registration order; the first match wins."""
    if spec.name in _REGISTRY and not overwrite:
        raise ValueError(f"a template named {spec.name!r} is already registered (pass overwrite=True)")
    _REGISTRY[spec.name] = spec
    return spec


# The shipped families' user turns: Llama-3.x Instruct; SmolLM2 Instruct (ChatML on a Llama body) and Qwen2.5
# Instruct (ChatML, no BOS); Mistral-7B-Instruct-v0.2, whose EOS is appended as the anchor. Their architectures'
# packed calls equal texts run alone (tests/test_packing.py::test_packed_call_equals_each_text_run_alone).
LLAMA3_TURN = functools.partial(
    UserTurn, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>", "<|eot_id|>"
)
CHATML_TURN = functools.partial(UserTurn, "<|im_start|>user\n", "<|im_end|>", "<|im_end|>")
MISTRAL_TURN = functools.partial(UserTurn, "<s>[INST] ", " [/INST]</s>", "</s>")
CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
register_template(
    TemplateSpec("llama3", LLAMA3_TURN, ("llama",), ("<|start_header_id|>", "<|eot_id|>"), packing_exact=True)
)
register_template(TemplateSpec("smollm2", CHATML_TURN, ("llama",), CHATML_MARKERS, packing_exact=True))
register_template(TemplateSpec("qwen2", CHATML_TURN, ("qwen2",), CHATML_MARKERS, packing_exact=True))
register_template(TemplateSpec("mistral", MISTRAL_TURN, ("mistral",), ("</s>",), packing_exact=True))


DERIVED_TEMPLATE = "chat_template"  # the family read from each tokenizer's own chat template (derive_template)
PLAIN_TEMPLATE = "plain"  # a base model's: [the BOS it adds], instruction and separator, text, EOS (plain_template)


def plain_template(tokenizer) -> TemplateSpec:
    """The family :data:`PLAIN_TEMPLATE` of ``tokenizer``; a ``ValueError`` when the tokenizer has no EOS token."""
    if tokenizer.eos_token is None:
        raise ValueError(
            f"template {PLAIN_TEMPLATE!r} ends a text with the tokenizer's EOS token, and this one has none"
        )
    bos, probe = tokenizer.bos_token_id, tokenizer("a")["input_ids"]
    adds_bos = (
        bos is not None and probe[:1] == [bos] and tokenizer("a", add_special_tokens=False)["input_ids"][:1] != [bos]
    )
    turn = functools.partial(
        UserTurn, tokenizer.bos_token if adds_bos else "", tokenizer.eos_token, tokenizer.eos_token
    )
    return TemplateSpec(PLAIN_TEMPLATE, turn, (), ())


def named_template(name: str, config, tokenizer, generation_config=None) -> TemplateSpec:
    """The template called ``name`` (derived, plain or registered), not checked against the chat template."""
    if name == DERIVED_TEMPLATE:
        return derive_template(config, tokenizer, generation_config)
    if name == PLAIN_TEMPLATE:
        return plain_template(tokenizer)
    return get_template(name)


def get_template(name: str) -> TemplateSpec:
    if name == DERIVED_TEMPLATE:
        raise ValueError(
            f"template {DERIVED_TEMPLATE!r} is derived from a tokenizer's chat template: resolve it with "
            "llm2vec.templates.resolve_template(config, tokenizer, 'chat_template')"
        )
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown template {name!r}; choose one of {', '.join(_REGISTRY)} (registered families), "
            f"{DERIVED_TEMPLATE} (from the tokenizer's chat template) or {PLAIN_TEMPLATE} (a base model: text, then "
            "EOS), or register one with llm2vec.templates.register_template(TemplateSpec(...))."
        ) from None


def resolve_template(config, tokenizer, name: str | None = None, generation_config=None) -> TemplateSpec:
    """The template for a model: by ``name``, else detected from ``config`` and ``tokenizer``, else derived from its
    chat template (:func:`derive_template`). For a registered family, an anchor that is no EOS id or ids that
    differ from the chat template's are logged as warnings."""
    if name in (DERIVED_TEMPLATE, PLAIN_TEMPLATE):
        return named_template(name, config, tokenizer, generation_config)
    vocab = tokenizer.get_vocab()
    if name is not None:
        spec = get_template(name)
    else:
        model_type = getattr(config, "model_type", None)
        candidates = [s for s in _REGISTRY.values() if model_type in s.model_types]
        matches = [s for s in candidates if all(t in vocab for t in s.marker_tokens)]
        if not matches and getattr(tokenizer, "chat_template", None):
            return derive_template(config, tokenizer, generation_config)
        if not matches:
            known = ", ".join(f"{s.name} (model_type {'/'.join(s.model_types)})" for s in _REGISTRY.values())
            raise ValueError(
                f"no prompt template for this model: model_type={model_type!r}"
                + (f" with none of the chat tokens of {[s.name for s in candidates]}" if candidates else "")
                + f', and its tokenizer has no chat template to derive one from. For a base model set "template": '
                f'"{PLAIN_TEMPLATE}" in the config (template={PLAIN_TEMPLATE!r} in Python: its text, then its EOS); '
                f"known chat families: {known}"
            )
        spec = matches[0]
    if spec.anchor not in vocab:
        raise ValueError(
            f"template {spec.name!r}: the anchor token {spec.anchor!r} is not in the tokenizer's vocabulary"
        )
    problem = anchor_mismatch(tokenizer, spec, config, generation_config)
    has_chat_template = bool(getattr(tokenizer, "chat_template", None))
    if problem and name is None and not has_chat_template:  # a base model with the family's chat tokens
        raise ValueError(
            f"{_model_folder(config, tokenizer)} has the chat tokens of the {spec.name!r} family but no chat template, "
            f'and its EOS is not that family\'s anchor {spec.anchor!r}: a base model? Set "template": '
            f'"{PLAIN_TEMPLATE}" (its text, then its EOS) for a base model, or "template": "{spec.name}" to '
            "use the chat format anyway"
        )
    if problem:
        logger.warning("%s", problem)
    if has_chat_template:
        try:
            problem = chat_template_mismatch(tokenizer, spec)
        except Exception as e:  # a chat template that cannot render one user message: nothing to compare
            problem = f"template {spec.name!r}: could not compare with the tokenizer's chat template ({e})"
        if problem:
            logger.warning("%s", problem)
    return spec


def anchor_mismatch(tokenizer, spec: TemplateSpec, config=None, generation_config=None) -> str | None:
    """``None`` when the anchor is one of the model's EOS ids (as Eq. 1 asks), else a one-line description."""
    anchor_id = tokenizer.convert_tokens_to_ids(spec.anchor)
    eos = eos_ids(tokenizer, config, generation_config)
    if anchor_id in eos:
        return None
    names = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} ({i})" for i in sorted(eos)) or "none"
    return (
        f"template {spec.name!r}: the anchor {spec.anchor!r} ({anchor_id}) is not an end-of-sequence id of this "
        f"model (EOS ids: {names}); the paper's Eq. 1 reads the embedding at an appended [EOS], so end the "
        "template's closing with one of them"
    )


def pad_token(tokenizer, spec: TemplateSpec) -> str:
    """The token that pads a batch (always masked out): the tokenizer's pad token, else the template's anchor."""
    return tokenizer.pad_token if tokenizer.pad_token is not None else spec.anchor


# --- a family derived from the tokenizer's own chat template -------------------------------------------------------

# (instruction, text) items whose ids a derived family must share with the chat template, with each separator
DERIVATION_PROBES = (
    ("Given a question, retrieve passages that answer the question", "Paris is the capital of France."),
    ("", "0123456789 numbers, punctuation: commas, periods. Questions? (parentheses)"),
)


def _model_folder(config, tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or getattr(config, "_name_or_path", None) or "this model"


def template_file(folder: str) -> str:
    """The file of a model folder that holds its chat template (transformers reads ``chat_template.jinja`` first)."""
    return (
        "chat_template.jinja"
        if os.path.isfile(os.path.join(folder, "chat_template.jinja"))
        else "tokenizer_config.json"
    )


def _saved_generation_config(config, tokenizer):
    """The generation config saved beside the model (its folder, or the hub cache; no network), else None."""
    from transformers import GenerationConfig

    for source in dict.fromkeys((getattr(config, "_name_or_path", None), getattr(tokenizer, "name_or_path", None))):
        if source:
            try:
                return GenerationConfig.from_pretrained(source, local_files_only=True)
            except Exception:  # no generation_config.json there
                continue
    return None


def derive_template(config, tokenizer, generation_config=None) -> TemplateSpec:
    """The family :data:`DERIVED_TEMPLATE` of a model, checked on :data:`DERIVATION_PROBES` against its chat
    template; one that cannot be derived is a one-line ``ValueError`` naming the model folder and ``template=``."""
    from . import chat_turn

    where = _model_folder(config, tokenizer)
    registered = ", ".join(_REGISTRY)

    def refused(reason: str) -> ValueError:
        reason = " ".join(reason.split())
        return ValueError(
            f"the chat template of {where} gives no prompt template: {reason} (the template: "
            f"{os.path.join(where, template_file(where))}). Pass template=<name> (registered: {registered}) or register the model's format with llm2vec.templates.register_template(TemplateSpec(...))"
        )

    eos = eos_ids(tokenizer, config, generation_config or _saved_generation_config(config, tokenizer))
    dummy_prefix = adds_leading_space(tokenizer)
    try:
        turn = chat_turn.derive_turn(tokenizer, eos, lambda closing: tokenize_closing(tokenizer, closing, dummy_prefix))
    except chat_turn.EndOfTurnNotEos as e:  # the fix: its id added to generation_config.json
        model_type = getattr(config, "model_type", None) or ""
        shipped = " (as google/gemma-3-*-it ship it)" if model_type.startswith("gemma") else ""
        raise ValueError(
            f"{e.token} (id {e.token_id}) closes the user turn of the chat template of {where} but is not among the "
            f"EOS ids of its tokenizer, config.json and generation_config.json ({e.eos}); add {e.token_id} to "
            f"eos_token_id in {os.path.join(where, 'generation_config.json')}{shipped}, or pass template=<name> "
            f"(registered: {registered})"
        ) from None
    except chat_turn.ChatTemplateError as e:
        raise refused(str(e)) from None
    model_type = getattr(config, "model_type", None)
    user_turn = functools.partial(UserTurn, turn.opening, turn.closing, turn.anchor)
    spec = TemplateSpec(DERIVED_TEMPLATE, user_turn, (model_type,) if model_type else (), ())

    def chat_ids(content: str) -> list[int]:
        text = chat_turn.render(tokenizer, [{"role": "user", "content": content}])
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for separator in (EVALUATION_SEPARATOR, TRAINING_SEPARATOR):
        for instruction, text in DERIVATION_PROBES:
            try:
                difference = chat_difference(
                    tokenizer, spec.with_separator(separator), instruction, text, chat_ids, eos
                )
            except ValueError as e:  # ChatTemplateError, or encode's: the closing does not end with the anchor
                raise refused(str(e)) from None
            if difference:
                raise refused(
                    "its user turn tokenized in pieces (prompt, text, closing) differs from the chat template's "
                    f"ids for that message: ours {difference[0]!r}, the chat template's {difference[1]!r}"
                )
    logger.info(
        "template %r: derived from the chat template of %s: opening %r, closing %r, anchor %r%s%s",
        DERIVED_TEMPLATE,
        where,
        turn.opening,
        turn.closing,
        turn.anchor,
        f"; its default system turn {turn.system_turn!r} left out" if turn.system_turn else "",
        f"; the EOS {turn.appended!r} appended after the open user turn" if turn.appended else "",
    )
    return spec
