"""Prompt templates: one function per model family, shared by training and evaluation.

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


# --- one function per family: the user turn of its chat format ----------------------------------------


def llama3_template() -> UserTurn:
    """Llama-3.x Instruct: ``<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n`` ... ``<|eot_id|>``."""
    return UserTurn("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>", "<|eot_id|>")


def qwen2_template() -> UserTurn:
    """Qwen2.5 Instruct (ChatML, no BOS): ``<|im_start|>user\\n`` ... ``<|im_end|>``."""
    return UserTurn("<|im_start|>user\n", "<|im_end|>", "<|im_end|>")


def smollm2_template() -> UserTurn:
    """SmolLM2 Instruct (ChatML on a Llama body): ``<|im_start|>user\\n`` ... ``<|im_end|>``."""
    return UserTurn("<|im_start|>user\n", "<|im_end|>", "<|im_end|>")


def mistral_template() -> UserTurn:
    """Mistral-7B-Instruct-v0.2: ``<s>[INST] `` ... `` [/INST]`` and the EOS ``</s>`` appended as the anchor."""
    return UserTurn("<s>[INST] ", " [/INST]</s>", "</s>")


_REGISTRY: dict[str, TemplateSpec] = {}


def register_template(spec: TemplateSpec, overwrite: bool = False) -> TemplateSpec:
    """Add a family. Detection tries families in registration order; the first match wins."""
    if spec.name in _REGISTRY and not overwrite:
        raise ValueError(f"a template named {spec.name!r} is already registered (pass overwrite=True)")
    _REGISTRY[spec.name] = spec
    return spec


# The shipped families are Llama, Qwen2 and Mistral architectures, whose packed calls equal texts run alone
# (tests/test_packing.py::test_packed_call_equals_each_text_run_alone).
register_template(
    TemplateSpec("llama3", llama3_template, ("llama",), ("<|start_header_id|>", "<|eot_id|>"), packing_exact=True)
)
register_template(
    TemplateSpec("smollm2", smollm2_template, ("llama",), ("<|im_start|>", "<|im_end|>"), packing_exact=True)
)
register_template(TemplateSpec("qwen2", qwen2_template, ("qwen2",), ("<|im_start|>", "<|im_end|>"), packing_exact=True))
register_template(TemplateSpec("mistral", mistral_template, ("mistral",), ("</s>",), packing_exact=True))


DERIVED_TEMPLATE = "chat_template"
"""The name of the family derived from the tokenizer's own chat template (:func:`derive_template`): what
``llm2vec_config.json`` records for such a model, and what ``template=`` names to ask for it. It is not in the
registry: its user turn is read from each tokenizer."""


PLAIN_TEMPLATE = "plain"
"""The family of a base model (no chat format): the BOS where the tokenizer adds one to every text, the instruction
and separator, the text, then the tokenizer's EOS as the anchor (Eq. 1's appended [EOS]). Read from each tokenizer
(:func:`plain_template`); ``template="plain"`` (``"template": "plain"`` in a config) asks for it."""


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
    """The template called ``name`` for this model: derived from its chat template (:data:`DERIVED_TEMPLATE`), its
    plain text (:data:`PLAIN_TEMPLATE`) or a registered family; no checks against the chat template."""
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


def _has_token(tokenizer, token: str) -> bool:
    return token in tokenizer.get_vocab()


def resolve_template(config, tokenizer, name: str | None = None, generation_config=None) -> TemplateSpec:
    """The template for a model: by explicit ``name``, else detected from ``config`` and ``tokenizer``, else derived
    from its chat template (:func:`derive_template`, also ``name="chat_template"``). For a registered family, an
    anchor that is no EOS id or ids that differ from the chat template's are logged as warnings.
    """
    if name in (DERIVED_TEMPLATE, PLAIN_TEMPLATE):
        return named_template(name, config, tokenizer, generation_config)
    if name is not None:
        spec = get_template(name)
    else:
        model_type = getattr(config, "model_type", None)
        candidates = [s for s in _REGISTRY.values() if model_type in s.model_types]
        matches = [s for s in candidates if all(_has_token(tokenizer, t) for t in s.marker_tokens)]
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
    if not _has_token(tokenizer, spec.anchor):
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
    """``None`` when the template's anchor is one of the model's end-of-sequence ids (:func:`eos_ids`), as Eq. 1
    asks, else a one-line description of the problem."""
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
    """The token that pads a batch: the tokenizer's pad token, else (Llama-3.x and Mistral as published have none) the
    template's anchor. Padding is always masked out (attention mask 0, no loss), so which token pads never changes an
    embedding or a loss; the export writes this token into its tokenizer, so sentence-transformers pads with it too."""
    return tokenizer.pad_token if tokenizer.pad_token is not None else spec.anchor


# --- a family derived from the tokenizer's own chat template -------------------------------------------------------

DERIVATION_PROBES = (
    ("Given a question, retrieve passages that answer the question", "Paris is the capital of France."),
    ("", "0123456789 numbers, punctuation: commas, periods. Questions? (parentheses)"),
)
"""``(instruction, text)`` items whose ids a derived family must share with the chat template, with each separator."""


def _model_folder(config, tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or getattr(config, "_name_or_path", None) or "this model"


def template_file(folder: str) -> str:
    """The file of a model folder that holds its chat template: ``chat_template.jinja`` where the folder has one
    (transformers reads it first), else ``tokenizer_config.json``."""
    return (
        "chat_template.jinja"
        if os.path.isfile(os.path.join(folder, "chat_template.jinja"))
        else "tokenizer_config.json"
    )


def _saved_generation_config(config, tokenizer):
    """The generation config saved beside the model (its folder, or the hub cache), read without the network; None
    when there is none. It may name more EOS ids than the config (Gemma 3's ``<end_of_turn>``)."""
    from transformers import GenerationConfig

    for source in dict.fromkeys((getattr(config, "_name_or_path", None), getattr(tokenizer, "name_or_path", None))):
        if source:
            try:
                return GenerationConfig.from_pretrained(source, local_files_only=True)
            except Exception:  # no generation_config.json there
                continue
    return None


def _end_of_turn_not_eos(error, where: str, model_type: str, registered: str) -> str:
    """One line for a chat format whose end-of-turn token is no EOS id of the model (``chat_turn.EndOfTurnNotEos``):
    the token, where the EOS ids come from, and the fix (its id added to ``generation_config.json``)."""
    shipped = " (as google/gemma-3-*-it ship it)" if model_type.startswith("gemma") else ""
    return (
        f"{error.token} (id {error.token_id}) closes the user turn of the chat template of {where} but is not among "
        f"the EOS ids of its tokenizer, config.json and generation_config.json ({error.eos}); add {error.token_id} to "
        f"eos_token_id in {os.path.join(where, 'generation_config.json')}{shipped}, or pass template=<name> "
        f"(registered: {registered})"
    )


def derive_template(config, tokenizer, generation_config=None) -> TemplateSpec:
    """The family :data:`DERIVED_TEMPLATE` of a model: the user turn of ``tokenizer``'s own chat template, anchored
    at one of the model's EOS ids, checked on :data:`DERIVATION_PROBES` against the chat template
    (:func:`chat_template_mismatch`). A template that cannot be derived is a one-line ``ValueError`` naming the
    model folder and ``template=``; packing is off for a derived family (docs/design.md).
    """
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
    except chat_turn.EndOfTurnNotEos as e:
        model_type = getattr(config, "model_type", None) or ""
        raise ValueError(_end_of_turn_not_eos(e, where, model_type, registered)) from None
    except chat_turn.ChatTemplateError as e:
        raise refused(str(e)) from None
    model_type = getattr(config, "model_type", None)
    spec = TemplateSpec(
        DERIVED_TEMPLATE,
        functools.partial(UserTurn, turn.opening, turn.closing, turn.anchor),
        (model_type,) if model_type else (),
        (),
    )

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
