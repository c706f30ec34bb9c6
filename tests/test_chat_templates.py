"""Prompts against the families' published chat templates, and the anchor against their end-of-sequence ids.

The references are the model publishers' own chat templates (the Jinja strings of their tokenizer configs, kept
verbatim in ``llm2vec/published/``; sources in ``SOURCES.md`` there) rendered by transformers'
``apply_chat_template``, and the end-of-sequence tokens the published models declare. The tiny test tokenizers
carry each family's special tokens, so a published template renders on them as on the real tokenizer; the real
SmolLM2 tokenizer is checked too where the demo has put it in ``cache/models``.
"""

from pathlib import Path

import pytest

from llm2vec.templates import (
    TemplateSpec,
    UserTurn,
    anchor_mismatch,
    chat_template_mismatch,
    encode,
    eos_ids,
    get_template,
    join_instruction,
)
from llm2vec.testing import PUBLISHED

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "cache" / "models" / "SmolLM2-135M-Instruct"
TEXT = "Paris is the capital of France."

# What the published template adds around one user message that this package leaves out: the default system
# turn (inserted after the first `shared` tokens of ours), the text after the user turn; and what this package
# appends that the template lacks (Eq. 1's [EOS] after Mistral's open user turn).
DEFAULT_SYSTEM = {
    "llama3": (
        "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|>",
        1,
        "",
        "",
    ),
    "qwen2": (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n",
        0,
        "\n",
        "",
    ),
    "smollm2": (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
        0,
        "\n",
        "",
    ),
    "mistral": ("", 1, "", "</s>"),
}

# The end-of-sequence tokens the published models declare (tokenizer eos_token, and eos_token_id of
# generation_config.json): Llama-3.2-1B-Instruct [128001, 128008, 128009]; Qwen2.5-1.5B-Instruct
# [151645, 151643]; Mistral-7B-Instruct-v0.2 2; SmolLM2-135M-Instruct 2.
PUBLISHED_EOS = {
    "llama3": {"<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"},
    "qwen2": {"<|im_end|>", "<|endoftext|>"},
    "mistral": {"</s>"},
    "smollm2": {"<|im_end|>"},
}


def published(family: str) -> str:
    return (PUBLISHED / f"{family}.jinja").read_text()


def tokenizer_with_published_template(tiny_models, family):
    import copy

    tokenizer = copy.deepcopy(tiny_models[family][1])
    tokenizer.chat_template = published(family)
    return tokenizer


def chat_ids(tokenizer, content: str) -> list[int]:
    """The published template's ids for one user message (Llama-3.2's date fixed to its own default)."""
    messages = [{"role": "user", "content": content}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, date_string="26 Jul 2024")
    return list(ids)


def assert_ours_is_the_published_user_turn(tokenizer, family, instruction, separator):
    spec = get_template(family).with_separator(separator)
    ours = list(encode(tokenizer, spec, [(instruction, TEXT)], max_length=512)[0].input_ids)
    chat = chat_ids(tokenizer, join_instruction(instruction, separator) + TEXT)
    system, shared, after, appended = DEFAULT_SYSTEM[family]

    def ids(s):
        return tokenizer(s, add_special_tokens=False)["input_ids"] if s else []

    user_turn = ours[: len(ours) - len(ids(appended))]
    assert ours[len(user_turn) :] == ids(appended)
    assert chat == user_turn[:shared] + ids(system) + user_turn[shared:] + ids(after), (
        f"{family}: ours {tokenizer.decode(ours)!r} vs published {tokenizer.decode(chat)!r}"
    )


def test_every_shipped_family_has_a_published_template():
    from llm2vec.templates import _REGISTRY

    assert set(_REGISTRY) == set(DEFAULT_SYSTEM) == set(PUBLISHED_EOS)
    for family in _REGISTRY:
        assert "{%" in published(family), family


@pytest.mark.parametrize("separator", [": ", "; "])
@pytest.mark.parametrize("instruction", ["", "Given a question, retrieve passages"])
def test_ids_equal_the_published_chat_template_of_one_user_message(tiny_models, family, instruction, separator):
    """Our ids are the published chat template's for the user message "<instruction><separator><text>", without
    the default system turn and ChatML's newline after the turn, plus Mistral's appended EOS anchor."""
    tokenizer = tokenizer_with_published_template(tiny_models, family)
    assert_ours_is_the_published_user_turn(tokenizer, family, instruction, separator)
    assert chat_template_mismatch(tokenizer, get_template(family)) is None  # the run-time check agrees


@pytest.mark.skipif(not SMOLLM2.is_dir(), reason="the demo's SmolLM2-135M-Instruct is not in cache/models")
@pytest.mark.parametrize("instruction", ["", "Given a question, retrieve passages"])
def test_real_smollm2_tokenizer_with_its_own_chat_template(instruction):
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    assert tokenizer.chat_template.strip() == published("smollm2").strip()
    assert_ours_is_the_published_user_turn(tokenizer, "smollm2", instruction, ": ")
    generation = GenerationConfig.from_pretrained(SMOLLM2)
    assert anchor_mismatch(tokenizer, get_template("smollm2"), generation_config=generation) is None


def test_the_anchor_is_an_end_of_sequence_token_of_every_family(tiny_models, family):
    """Eq. 1 reads the embedding at an appended [EOS]: every shipped family's anchor is one of the published
    models' EOS tokens and an EOS id of the test model, and it is the last token of every encoded text."""
    spec = get_template(family)
    assert spec.anchor in PUBLISHED_EOS[family]
    model, tokenizer = tiny_models[family]
    anchor_id = tokenizer.convert_tokens_to_ids(spec.anchor)
    assert anchor_id in eos_ids(tokenizer, model.config, model.generation_config)
    assert anchor_mismatch(tokenizer, spec, model.config) is None
    for instruction in ("", "Retrieve passages"):
        assert encode(tokenizer, spec, [(instruction, TEXT * 5)], max_length=32)[0].input_ids[-1] == anchor_id


def test_an_anchor_that_is_not_eos_is_reported(tiny_models, caplog):
    """The earlier Mistral anchor, the ``]`` of `` [/INST]``, is not an EOS id: resolving it logs one line saying so."""
    import logging

    from llm2vec import templates

    model, tokenizer = tiny_models["mistral"]
    old = TemplateSpec("mistral_bracket_anchor", lambda: UserTurn("<s>[INST] ", " [/INST]", "]"), ("mistral",), ())
    problem = anchor_mismatch(tokenizer, old, model.config)
    assert problem is not None and "not an end-of-sequence id" in problem and "'</s>'" in problem
    templates._REGISTRY[old.name] = old
    try:
        with caplog.at_level(logging.WARNING, logger="llm2vec"):
            templates.resolve_template(model.config, tokenizer, name=old.name)
    finally:
        del templates._REGISTRY[old.name]
    assert any("not an end-of-sequence id" in r.getMessage() for r in caplog.records)
