"""A chat model of no registered family, with no code: its prompt template derived from the tokenizer's own chat template.

The references are independent of the derivation: the published chat templates of Qwen3, Gemma 3, Phi-3,
Phi-4-mini, Mistral-7B-Instruct-v0.3 and Llama-3 (``llm2vec/published/``) rendered and tokenized by
transformers' ``apply_chat_template`` on tiny tokenizers with each model's special tokens and tokenizer pipeline
(``tests/_chat_families.py``), each user turn written out by hand, and the registered families' own templates.
"""

import copy
import json
import time

import pytest
import torch
from _chat_families import (
    CHAT_FAMILIES,
    PUBLISHED,
    chat_config,
    chat_tokenizer,
    published,
    save_chat_checkpoint,
    user_turn,
)

from llm2vec import LLM2Vec, chat_turn, templates
from llm2vec.templates import DERIVED_TEMPLATE, encode, get_template, resolve_template

TEXT = "Paris is the capital of France."
ITEMS = [("", TEXT), ("Given a question, retrieve passages", TEXT), ("Retrieve text:", "  0123456789 (numbers)  ")]

# What the published template writes around our ids for one user message: whitespace after the anchor (ChatML's
# and Gemma's newline between turns), and the EOS the user turn lacks (Mistral's open [INST] turn, which we append).
AFTER_THE_ANCHOR = {"qwen3": "\n", "gemma3": "\n"}
APPENDED = {"mistral_v03": "</s>"}


def derived(name):
    tokenizer = chat_tokenizer(name)
    config = chat_config(name, tokenizer)
    return tokenizer, config, resolve_template(config, tokenizer, DERIVED_TEMPLATE)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


@pytest.mark.parametrize("name", list(CHAT_FAMILIES))
def test_derived_ids_equal_apply_chat_template(name):
    """The derived user turn is the one written out from the published template, and for every item the ids are
    exactly ``apply_chat_template``'s for that user message: only the newline after ChatML's and Gemma's anchor is
    left out, and Mistral's EOS is appended after its open ``[INST] ... [/INST]`` turn."""
    tokenizer, config, spec = derived(name)
    assert spec.name == DERIVED_TEMPLATE and spec.turn()[:] == user_turn(name)
    anchor_id = tokenizer.convert_tokens_to_ids(spec.anchor)
    assert anchor_id in templates.eos_ids(tokenizer, config)
    for separator in (": ", "; "):
        for instruction, text in ITEMS:
            ours = list(encode(tokenizer, spec.with_separator(separator), [(instruction, text)], 512)[0].input_ids)
            content = templates.join_instruction(instruction, separator) + text.strip()
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=True, return_dict=False
            )
            appended = ids(tokenizer, APPENDED.get(name, ""))
            assert ours[-1] == anchor_id
            assert list(chat) == ours[: len(ours) - len(appended)] + ids(tokenizer, AFTER_THE_ANCHOR.get(name, "")), (
                f"{name}: ours {tokenizer.decode(ours)!r} vs the chat template's {tokenizer.decode(chat)!r}"
            )


@pytest.mark.parametrize("source", ["test tokenizer", "published"])
@pytest.mark.parametrize("family", ["llama3", "qwen2", "smollm2", "mistral"])
def test_registered_families_derive_their_registered_template(tiny_models, family, source):
    """Derived from the chat template of each registered family (the tiny test tokenizer's, and the published one),
    the user turn is the registered one, string for string, and so are the ids of every item, cut texts included:
    Llama-3.2's and Qwen2.5's default system turns are left out, Mistral's EOS is appended."""
    model, tokenizer = tiny_models[family]
    tokenizer = copy.deepcopy(tokenizer)
    if source == "published":
        tokenizer.chat_template = (PUBLISHED / f"{family}.jinja").read_text()
    spec = resolve_template(model.config, tokenizer, DERIVED_TEMPLATE)
    registered = get_template(family)
    assert spec.turn() == registered.turn()
    items = [*ITEMS, ("Retrieve", TEXT * 20)]
    assert encode(tokenizer, spec, items, 48) == encode(tokenizer, registered, items, 48)


def test_detection_derives_a_family_only_where_none_is_registered(tiny_models):
    """A model type no registered family has gets the derived family; one that has a family keeps it."""
    from transformers import AutoConfig

    for name in ("qwen3", "gemma3", "phi3", "phi4_mini"):
        tokenizer = chat_tokenizer(name)
        assert resolve_template(chat_config(name, tokenizer), tokenizer).name == DERIVED_TEMPLATE, name
    for name, family in (("llama3_0", "llama3"), ("mistral_v03", "mistral")):
        tokenizer = chat_tokenizer(name)
        config = chat_config(name, tokenizer)
        detected, own = resolve_template(config, tokenizer), resolve_template(config, tokenizer, DERIVED_TEMPLATE)
        assert detected.name == family, name
        for separator in (": ", "; "):  # and the registered family gives the ids of the model's own chat template
            assert encode(tokenizer, detected.with_separator(separator), ITEMS, 64) == encode(
                tokenizer, own.with_separator(separator), ITEMS, 64
            ), name
    # a GPT-2 body under a Llama-3 tokenizer: no family for gpt2, so the tokenizer's chat template gives it one
    spec = resolve_template(AutoConfig.for_model("gpt2"), tiny_models["llama3"][1])
    assert spec.name == DERIVED_TEMPLATE and spec.turn() == get_template("llama3").turn()
    assert not spec.packing_exact  # packing stays off for an architecture not known to pack exactly


def test_the_default_system_turn_is_left_out():
    """Llama-3.2's template writes a system turn with today's date into every conversation: it is left out, so the
    prompt's ids do not depend on the day. Templates without a default system turn keep their whole opening."""
    tokenizer = chat_tokenizer("llama3_0", chat_template=published("llama3"))  # the Llama-3.2 template
    turn = chat_turn.derive_turn(tokenizer, {tokenizer.eos_token_id}, lambda c: ids(tokenizer, c))
    assert turn.system_turn.startswith("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date")
    assert turn.system_turn.endswith("<|eot_id|>") and "Today Date: " in turn.system_turn
    assert turn.opening == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    for name in ("qwen3", "gemma3", "phi3", "mistral_v03"):
        tokenizer = chat_tokenizer(name)
        eos = templates.eos_ids(tokenizer, chat_config(name, tokenizer))
        turn = chat_turn.derive_turn(tokenizer, eos, lambda c, t=tokenizer: ids(t, c))
        assert turn.system_turn == "" and turn.opening == user_turn(name)[0], name


def test_thinking_is_off_where_the_template_has_the_switch():
    """Qwen3's template reads ``enable_thinking``: it is rendered with the switch off (Gemma's has none). A template
    whose user turn changes with the switch gives the thinking-off turn."""
    assert chat_turn.template_kwargs(chat_tokenizer("qwen3")) == {"enable_thinking": False}
    assert chat_turn.template_kwargs(chat_tokenizer("gemma3")) == {}
    switched = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if enable_thinking is not defined or enable_thinking %} /think{% else %} /no_think{% endif %}"
        "<|im_end|>\n{% endfor %}"
    )
    tokenizer = chat_tokenizer("qwen3", chat_template=switched)
    spec = resolve_template(chat_config("qwen3", tokenizer), tokenizer)
    assert spec.turn() == ("<|im_start|>user\n", " /no_think<|im_end|>", "<|im_end|>")


def test_the_anchor_comes_from_the_rendering_without_a_generation_prompt():
    """Phi-3's template ends a conversation with its EOS only without a generation prompt (with one, it ends with
    ``<|assistant|>``): the derived anchor is that EOS. A template that refuses a generation prompt still renders."""
    tokenizer, _, spec = derived("phi3")
    message = [{"role": "user", "content": TEXT}]
    assert tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True).endswith(
        "<|assistant|>\n"
    )
    assert spec.anchor == "<|endoftext|>"
    refusing = "{% if add_generation_prompt %}{{ raise_exception('no generation prompt') }}{% endif %}" + published(
        "qwen3"
    )
    tokenizer = chat_tokenizer("qwen3", chat_template=refusing)
    assert resolve_template(chat_config("qwen3", tokenizer), tokenizer).turn() == user_turn("qwen3")


# ------------------------------------------------------------------------------------------------------ refusals

UNBOUNDED = "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"
RECURSIVE = "{% macro turn(n) %}{{ turn(n + 1) }}{% endmacro %}{{ turn(0) }}"
CHATML_USER = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
USER_ONLY_CLOSED = (  # a user turn closed by <|im_end|>, a reply by nothing
    "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>{{ m.content }}<|im_end|>"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    "chat_template, eos, says",
    [
        ("{{ raise_exception('Only user and assistant roles\nare supported') }}", None, "raised TemplateError: Only"),
        (UNBOUNDED, None, "ran past 1,000,000 template lines"),
        (RECURSIVE, None, "raised RecursionError"),
        ("{% for m in messages %}{{ m.content }} {{ m.content }}{% endfor %}<|im_end|>", None, "2 times"),
        ("<|im_start|>user\nHello<|im_end|>", None, "0 times"),
        ("{{ messages[0]['content'] | replace('Paris', 'Rome') }}<|im_end|>", None, "differs from the chat template"),
        (USER_ONLY_CLOSED, "<|endoftext|>", "its user turn ends with '<|im_end|>'"),
    ],
    ids=["raises", "unbounded-loop", "recursion", "text-twice", "no-text", "rewrites-text", "anchor-not-eos"],
)
def test_a_template_that_gives_no_prompt_is_refused_in_one_line(tmp_path, chat_template, eos, says):
    """A chat template that raises, loops without end, does not render the user's text once or as it is, or ends no
    turn with an EOS id is refused in one line naming the model folder, the problem (the token, for an anchor that
    is no EOS id) and ``template=`` / ``register_template`` as the way out, never with a Jinja traceback."""
    from transformers import AutoTokenizer

    folder = tmp_path / "chat-model"
    tokenizer = chat_tokenizer("qwen3", chat_template=chat_template)
    if eos:
        tokenizer.eos_token = eos
    tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = chat_config("qwen3", tokenizer, eos_token_id=tokenizer.eos_token_id)
    start = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        resolve_template(config, tokenizer)
    assert time.perf_counter() - start < 30
    message = str(refused.value)
    assert "\n" not in message and says in message, message
    assert message.startswith(f"the chat template of {folder} gives no prompt template: ")
    assert "template=<name>" in message and "register_template" in message
    assert refused.value.__cause__ is None and (refused.value.__context__ is None or refused.value.__suppress_context__)


@pytest.mark.parametrize("name, chat_template", [("gemma3", None), ("qwen3", CHATML_USER)], ids=["gemma3", "chatml"])
def test_an_end_of_turn_token_missing_from_the_eos_ids_is_named_with_the_file_to_fix(tmp_path, name, chat_template):
    """A chat format whose token closing the user turn (and the reply) is no EOS id of the model's files (a Gemma 3
    config.json with only ``<eos>``, no generation_config.json) is refused in one line that names the token and its
    id, where the EOS ids come from and the fix: the id added to eos_token_id in generation_config.json, or
    ``template=``. With that fix the template derives."""
    from transformers import AutoTokenizer, GenerationConfig

    folder = tmp_path / "chat-model"
    tokenizer = chat_tokenizer(name, chat_template=chat_template)
    tokenizer.eos_token = "<eos>" if name == "gemma3" else "<|endoftext|>"  # Qwen's base models' EOS
    tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat_config(name, tokenizer, eos_token_id=tokenizer.eos_token_id).save_pretrained(folder)
    config = chat_config(name, tokenizer, eos_token_id=tokenizer.eos_token_id)
    config._name_or_path = str(folder)
    end = "<end_of_turn>" if name == "gemma3" else "<|im_end|>"
    end_id = tokenizer.convert_tokens_to_ids(end)
    with pytest.raises(ValueError) as refused:
        resolve_template(config, tokenizer)
    message = str(refused.value)
    assert "\n" not in message and refused.value.__cause__ is None, message
    assert message.startswith(f"{end} (id {end_id}) closes the user turn of the chat template of {folder}"), message
    eos = f"({tokenizer.eos_token!r} ({tokenizer.eos_token_id}))"
    assert f"not among the EOS ids of its tokenizer, config.json and generation_config.json {eos}" in message
    assert f"add {end_id} to eos_token_id in {folder / 'generation_config.json'}" in message
    assert ("google/gemma-3-*-it" in message) is (name == "gemma3") and "template=<name>" in message
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, end_id]).save_pretrained(folder)  # the fix named
    assert resolve_template(config, tokenizer).anchor == end


def test_refused_at_the_start_of_training_with_the_config_named(tmp_path):
    """The training start-up check reports the refusal as one ``error:`` line before any data or weights load."""
    from _drivers import tiny_run_flags

    from llm2vec.arguments import ConfigError
    from llm2vec.training import run

    folder = tmp_path / "model"
    tokenizer = chat_tokenizer("qwen3", chat_template=UNBOUNDED)
    tokenizer.save_pretrained(folder)
    chat_config("qwen3", tokenizer).save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"the chat template of .*model gives no prompt template: rendering"):
        run("I", tiny_run_flags(folder, tmp_path / "no_data", tmp_path / "out"))


# ----------------------------------------------------------------------------------- training and evaluation


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    """A tiny random Qwen3 causal LM (a model type no family is registered for) with Qwen3's chat template."""
    return save_chat_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3") / "model")


def test_a_new_chat_model_trains_and_evaluates_with_no_code(qwen3_checkpoint, tmp_path):
    """Both stages train a Qwen3 checkpoint with a plain config; the runs record ``template: chat_template``, and the
    trained model loads with the same derived template and embeds at the anchor, the last token of every input."""
    from _drivers import tiny_run_flags
    from _tiny_data import write_tiny_e5

    from llm2vec.training import run

    data = write_tiny_e5(tmp_path / "data", n=8)
    common = dict(max_steps=2, save_steps=2, num_threads=1, disable_tqdm="true", max_seq_length=64, learning_rate=1e-3)
    run("I", tiny_run_flags(qwen3_checkpoint, data, tmp_path / "stage_I", **common))
    run("II", tiny_run_flags(tmp_path / "stage_I", data, tmp_path / "stage_II", stage="II", lora_r=4, **common))
    for out in ("stage_I", "stage_II"):
        assert json.loads((tmp_path / out / "llm2vec_config.json").read_text())["template"] == DERIVED_TEMPLATE
    encoder = LLM2Vec.from_pretrained(str(tmp_path / "stage_I"), str(tmp_path / "stage_II"), device="cpu")
    assert encoder.template.name == DERIVED_TEMPLATE and encoder.template.turn()[:] == user_turn("qwen3")
    batch = encoder.tokenize([["Retrieve passages", TEXT], TEXT * 30])
    anchor = encoder.tokenizer.convert_tokens_to_ids("<|im_end|>")
    last = batch["attention_mask"].sum(1) - 1
    assert batch["input_ids"][torch.arange(2), last].tolist() == [anchor, anchor]
    with torch.no_grad():
        hidden = encoder.model(input_ids=batch["input_ids"][:1, : last[0] + 1]).last_hidden_state[0, -1]
    vector = encoder.encode([["Retrieve passages", TEXT]], convert_to_tensor=True, show_progress_bar=False)[0]
    torch.testing.assert_close(vector, hidden, rtol=0, atol=1e-5)


def test_a_derived_family_exports_and_loads_back(qwen3_checkpoint, tmp_path):
    """The sentence-transformers export of a derived family passes its own checks, and ``LLM2Vec.from_pretrained``
    derives the template again from the export, with the source's token ids and embeddings."""
    pytest.importorskip("sentence_transformers")
    from llm2vec.export import export_sentence_transformers

    instruction = "Retrieve passages that answer the question"
    export_sentence_transformers(
        str(qwen3_checkpoint),
        tmp_path / "export",
        max_length=64,
        instructions={"Questions": instruction},
        query_instruction=instruction,
    )
    source = LLM2Vec.from_pretrained(str(qwen3_checkpoint), device="cpu", max_length=64)
    again = LLM2Vec.from_pretrained(str(tmp_path / "export"), device="cpu")
    assert again.template.name == DERIVED_TEMPLATE
    items = [[instruction, TEXT], ["", TEXT * 30], ["", "  ends with spaces  "]]
    assert again.encode_ids([LLM2Vec.as_item(i) for i in items]) == source.encode_ids(
        [LLM2Vec.as_item(i) for i in items]
    )
    torch.testing.assert_close(
        again.encode(items, convert_to_tensor=True, show_progress_bar=False),
        source.encode(items, convert_to_tensor=True, show_progress_bar=False),
        rtol=0,
        atol=1e-5,
    )
