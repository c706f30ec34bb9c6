"""The encoder: templates, masks, pooling, encode(), save/load. Each test has an independent reference."""

import numpy as np
import pytest
import torch

from llm2vec import LLM2Vec
from llm2vec.collator import pad_batch
from llm2vec.pooling import POOLING_MODES, pool
from llm2vec.templates import EncodedText, resolve_template

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "short",
    "Return the number of items in a container; raise an error if the object has no length. " * 3,
]

# The exact user turn each family's template produces for ("Retrieve passages", "the fox") with the evaluation
# separator ": " (the README records these).
EXPECTED_STRINGS = {
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nRetrieve passages: the fox<|eot_id|>",
    "smollm2": "<|im_start|>user\nRetrieve passages: the fox<|im_end|>",
    "qwen2": "<|im_start|>user\nRetrieve passages: the fox<|im_end|>",
    "mistral": "<s>[INST] Retrieve passages: the fox [/INST]</s>",
}
ANCHORS = {"llama3": "<|eot_id|>", "smollm2": "<|im_end|>", "qwen2": "<|im_end|>", "mistral": "</s>"}
CLOSINGS = {"llama3": "<|eot_id|>", "smollm2": "<|im_end|>", "qwen2": "<|im_end|>", "mistral": " [/INST]</s>"}


def encoder(tiny_models, family, **kwargs):
    model, tokenizer = tiny_models[family]
    return LLM2Vec(model.model, tokenizer, **kwargs)


# ----------------------------------------------------------------------------------------------- pooling


def reference_pool(hidden, input_len, text_start, offset, mode):
    """Per-example pooling from the token layout alone (no masks)."""
    positions = list(range(offset, offset + input_len))
    text_positions = positions[text_start:]  # text tokens and the anchor
    if mode == "eos_token":
        return hidden[positions[-1]]
    if mode == "last_token":
        return hidden[positions[-2]]
    weights = torch.ones(len(text_positions)) if mode == "mean" else torch.arange(1, len(text_positions) + 1).float()
    weights = weights / weights.sum()
    return sum(w * hidden[p] for w, p in zip(weights, text_positions))


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("mode", POOLING_MODES)
def test_pooling_matches_per_example_loop(mode, padding_side):
    g = torch.Generator().manual_seed(0)
    layouts = [(7, 3), (12, 5), (4, 1), (9, 9 - 2)]  # (length, text_start)
    encoded = [EncodedText(tuple(range(1, n + 1)), s, n - 1) for n, s in layouts]
    batch = pad_batch(encoded, pad_token_id=0, padding_side=padding_side)
    hidden = torch.randn(len(encoded), batch["input_ids"].shape[1], 6, generator=g)
    pooled = pool(hidden, batch["attention_mask"], batch["text_mask"], mode)
    width = batch["input_ids"].shape[1]
    for row, (n, s) in enumerate(layouts):
        offset = width - n if padding_side == "left" else 0
        expected = reference_pool(hidden[row], n, s, offset, mode)
        torch.testing.assert_close(pooled[row], expected, rtol=0, atol=1e-6)


def test_masks_are_not_mutated_by_pooling():
    encoded = [EncodedText((1, 2, 3, 4), 1, 3), EncodedText((1, 2), 1, 1)]
    batch = pad_batch(encoded, 0)
    before = {k: v.clone() for k, v in batch.items()}
    for mode in POOLING_MODES:
        pool(torch.randn(2, 4, 3), batch["attention_mask"], batch["text_mask"], mode)
    for k in before:
        assert torch.equal(before[k], batch[k])


# ----------------------------------------------------------------------------------------------- templates


def test_template_strings_and_anchor(tiny_models, family):
    enc = encoder(tiny_models, family)
    assert enc.template.name == family
    batch = enc.tokenize([["Retrieve passages", "the fox"]])
    ids = batch["input_ids"][0].tolist()
    # the ids of the whole user turn, tokenized at once from the literal string above
    assert ids == enc.tokenizer(EXPECTED_STRINGS[family], add_special_tokens=False)["input_ids"]
    assert ids[-1] == enc.tokenizer.convert_tokens_to_ids(ANCHORS[family])


def test_instruction_excluded_from_text_mask(tiny_models, family):
    enc = encoder(tiny_models, family)
    text = "Paris is the capital of France."
    for instruction in ["", "Given a question, retrieve passages that answer it"]:
        batch = enc.tokenize([[instruction, text]])
        in_text = batch["input_ids"][0][batch["text_mask"][0].bool()].tolist()
        assert enc.tokenizer.decode(in_text).strip() == (text + CLOSINGS[family]).strip()
        assert in_text[-1] == enc.tokenizer.convert_tokens_to_ids(ANCHORS[family])


# The ids against the families' published chat templates: tests/test_chat_templates.py.


def test_chat_template_check_flags_a_wrong_template(tiny_models, caplog, monkeypatch):
    """The run-time check agrees with every registered family and catches the old Mistral format (no [/INST])."""
    import logging

    from llm2vec.templates import TemplateSpec, UserTurn, chat_template_mismatch, get_template

    for family in tiny_models:
        assert chat_template_mismatch(tiny_models[family][1], get_template(family)) is None
    old = TemplateSpec(
        "mistral_without_inst_close", lambda: UserTurn("<s>[INST] ", "</s>", "</s>"), ("mistral",), ("</s>",)
    )
    tokenizer = tiny_models["mistral"][1]
    assert "differs from the tokenizer's chat template" in chat_template_mismatch(tokenizer, old)
    from llm2vec import templates

    monkeypatch.setitem(templates._REGISTRY, old.name, old)
    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        templates.resolve_template(tiny_models["mistral"][0].config, tokenizer, name=old.name)
    assert any("differs from the tokenizer's chat template" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("separator", [": ", "; ", " "])
def test_separate_tokenization_adds_no_space_token(tiny_models, family, separator):
    """Prefix, text and closing are tokenized apart, yet give the ids of the whole turn tokenized at once; for
    the sentencepiece-style tokenizer (Mistral) the naive split would add a lone space token."""
    from llm2vec.templates import adds_leading_space, encode, get_template

    tokenizer = tiny_models[family][1]
    spec = get_template(family).with_separator(separator)
    for instruction in ["", "Retrieve passages"]:
        for text in ["the fox", "  Paris is the capital of France.  "]:
            ours = list(encode(tokenizer, spec, [(instruction, text)], max_length=512)[0].input_ids)
            joint = tokenizer(spec.render(instruction, text), add_special_tokens=False)["input_ids"]
            assert ours == joint, (instruction, text)
    assert adds_leading_space(tokenizer) == (family == "mistral")
    if family == "mistral":
        space = tokenizer.convert_tokens_to_ids("\u2581")
        prefix = spec.build("Retrieve passages")[0]
        naive = (
            tokenizer(prefix, add_special_tokens=False)["input_ids"]
            + tokenizer("the fox", add_special_tokens=False)["input_ids"]
        )
        e = encode(tokenizer, spec, [("Retrieve passages", "the fox")], max_length=512)[0]
        body = list(e.input_ids[: e.text_end])
        i = next(k for k, (a, b) in enumerate(zip(naive, body)) if a != b)
        assert naive[i] == space and naive[:i] + naive[i + 1 :] == body  # exactly one extra lone "▁"


@pytest.mark.parametrize("separator", [": ", "\n"])
def test_a_text_after_a_prompt_ending_without_a_space_keeps_the_ids_of_the_whole_turn(separator):
    """transformers 5's LlamaTokenizer (Phi-3's, Mistral-v0.3's) marks the start of an input as a word start: after
    Phi-3's ``<|user|>\\n``, or an instruction joined by a newline, the text has no such mark in the whole user turn,
    and encode gives it none (tokenized alone it would get one)."""
    import functools

    from _chat_families import chat_tokenizer

    from llm2vec.templates import TemplateSpec, UserTurn, adds_leading_space, encode

    tokenizer = chat_tokenizer("phi3")
    assert adds_leading_space(tokenizer)
    turn = functools.partial(UserTurn, "<|user|>\n", "<|end|>\n<|endoftext|>", "<|endoftext|>")
    spec = TemplateSpec("phi3_user_turn", turn, ("phi3",), (), separator=separator)
    for instruction in ["", "Retrieve passages"]:
        for text in ["Paris", "  the quick brown fox  ", TEXTS[0]]:
            ours = list(encode(tokenizer, spec, [(instruction, text)], max_length=512)[0].input_ids)
            assert ours == tokenizer(spec.render(instruction, text), add_special_tokens=False)["input_ids"], text
    alone = tokenizer("Paris", add_special_tokens=False)["input_ids"]
    assert alone != tokenizer("<|user|>\nParis", add_special_tokens=False)["input_ids"][1:]


def test_join_instruction_does_not_repeat_the_mark():
    from llm2vec.templates import join_instruction

    assert join_instruction("Given a claim, find documents that refute the claim", ": ") == (
        "Given a claim, find documents that refute the claim: "
    )
    assert join_instruction("Given a claim, find documents that refute the claim: ", ": ") == (
        "Given a claim, find documents that refute the claim: "
    )  # LLM2Vec's instructions end with ":"
    assert join_instruction("Retrieve text", "; ") == "Retrieve text; "
    assert join_instruction("  ", "; ") == ""


def test_long_text_still_ends_in_anchor(tiny_models, family):
    enc = encoder(tiny_models, family, max_length=24)
    anchor = enc.tokenizer.convert_tokens_to_ids(ANCHORS[family])
    long_text = " ".join(TEXTS) * 5
    batch = enc.tokenize([["Retrieve", long_text]])
    ids = batch["input_ids"][0]
    assert len(ids) == 24 and ids[-1].item() == anchor
    closing = enc.tokenizer(CLOSINGS[family].strip(), add_special_tokens=False)["input_ids"]
    assert ids[-len(closing) :].tolist() == closing  # the whole closing survives truncation
    # The embedding is the final hidden state at that anchor: check against a plain forward of the body.
    with torch.no_grad():
        hidden = enc.model(input_ids=ids[None]).last_hidden_state[0, -1]
    torch.testing.assert_close(
        enc.encode([["Retrieve", long_text]], convert_to_tensor=True, show_progress_bar=False)[0],
        hidden,
        rtol=0,
        atol=1e-5,
    )


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_doc_max_length_cuts_each_text_before_the_prompt(tiny_models, family):
    """The authors' evaluation cap (400 tokens per text under 512): the text keeps its first N ids, the prompt
    and the anchor stay whole, a shorter text is unchanged, and the embedding follows the cut ids."""
    free, capped = encoder(tiny_models, family, max_length=64), encoder(tiny_models, family, max_length=64)
    capped.doc_max_length = 5
    long_text, short_text = " ".join(TEXTS), "fox"
    for item in (["Retrieve", long_text], long_text):
        whole = free.encode_ids([LLM2Vec.as_item(item)])[0]
        cut = capped.encode_ids([LLM2Vec.as_item(item)])[0]
        text = whole.input_ids[whole.text_start : whole.text_end]
        assert len(text) > 5 and cut.input_ids[cut.text_start : cut.text_end] == text[:5]
        assert cut.input_ids[: cut.text_start] == whole.input_ids[: whole.text_start]  # prompt untouched
        assert cut.input_ids[cut.text_end :] == whole.input_ids[whole.text_end :]  # closing and anchor untouched
    assert capped.encode_ids([("", short_text)]) == free.encode_ids([("", short_text)])
    # a cap above the room left by max_length changes nothing: max_length still applies
    capped.doc_max_length = 1000
    assert capped.encode_ids([("", long_text * 9)]) == free.encode_ids([("", long_text * 9)])
    with pytest.raises(ValueError, match="doc_max_length"):
        LLM2Vec(free.model, free.tokenizer, doc_max_length=0)


def test_unknown_family_gives_clear_error(tiny_models):
    """A model of no registered family whose tokenizer has no chat template to derive one from is refused (with a
    chat template it gets the derived family: tests/test_derived_templates.py)."""
    import copy

    from transformers import AutoConfig

    def without_chat_template(tokenizer):
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = None
        return tokenizer

    tokenizer = without_chat_template(tiny_models["llama3"][1])
    with pytest.raises(ValueError, match='no prompt template .* set "template": "plain"'):
        resolve_template(AutoConfig.for_model("gpt2"), tokenizer)
    _, qwen_tokenizer = tiny_models["qwen2"]  # a llama config whose tokenizer lacks both llama chat formats
    with pytest.raises(ValueError, match="known chat families: llama3"):
        resolve_template(AutoConfig.for_model("llama"), without_chat_template(tiny_models["mistral"][1]))
    with pytest.raises(ValueError, match="unknown template"):
        resolve_template(AutoConfig.for_model("llama"), qwen_tokenizer, name="nope")


# ----------------------------------------------------------------------------------------------- encode


def test_embedding_same_alone_and_in_padded_batch(tiny_models, family):
    for mode in POOLING_MODES:
        enc = encoder(tiny_models, family, pooling_mode=mode)
        batched = enc.encode(TEXTS, batch_size=4, convert_to_tensor=True, show_progress_bar=False)
        for i, text in enumerate(TEXTS):
            alone = enc.encode([text], convert_to_tensor=True, show_progress_bar=False)[0]
            torch.testing.assert_close(batched[i], alone, rtol=0, atol=1e-5)
        # Left padding through forward() gives the same vectors (positions are counted from the mask).
        with torch.no_grad():
            left = enc(enc.tokenize(TEXTS, padding_side="left"))
        torch.testing.assert_close(left, batched, rtol=0, atol=1e-5)


def test_encode_keeps_input_order_and_returns_float32(tiny_models):
    enc = encoder(tiny_models, "qwen2")
    out = enc.encode(TEXTS[::-1] + TEXTS, batch_size=3, show_progress_bar=False)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (8, 32)
    np.testing.assert_allclose(out[:4][::-1], out[4:], atol=1e-5)
    for i, text in enumerate(TEXTS):  # row i belongs to text i, checked one at a time
        np.testing.assert_allclose(out[4 + i], enc.encode(text, show_progress_bar=False), atol=1e-5)
    normed = enc.encode(TEXTS, normalize_embeddings=True, show_progress_bar=False)
    np.testing.assert_allclose(np.linalg.norm(normed, axis=1), 1.0, atol=1e-5)


def test_encode_rejects_bad_input(tiny_models):
    enc = encoder(tiny_models, "llama3")
    with pytest.raises(TypeError, match="input 1"):
        enc.encode(["fine", 3], show_progress_bar=False)


def test_save_and_load_give_identical_embeddings(tiny_checkpoints, family, tmp_path):
    enc = LLM2Vec.from_pretrained(str(tiny_checkpoints[family]), pooling_mode="mean", max_length=64, device="cpu")
    before = enc.encode(TEXTS, show_progress_bar=False)
    enc.save(tmp_path / "saved")
    again = LLM2Vec.from_pretrained(str(tmp_path / "saved"), device="cpu")
    assert (again.pooling_mode, again.max_length, again.template.name) == ("mean", 64, family)
    np.testing.assert_array_equal(again.encode(TEXTS, show_progress_bar=False), before)


def test_bad_llm2vec_config_names_the_file(tiny_checkpoints, tmp_path):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["llama3"], folder)
    (folder / "llm2vec_config.json").write_text('{"pooling": "mean"}')
    with pytest.raises(ValueError, match="llm2vec_config.json.*unknown field"):
        LLM2Vec.from_pretrained(str(folder), device="cpu")


@pytest.fixture
def transformers_warnings():
    """The messages transformers logs at warning level or above while the test runs (its verbosity: warning)."""
    import logging

    from transformers.utils import logging as hf_logging

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler, verbosity = Keep(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logging.getLogger("transformers").addHandler(handler)
    yield messages
    logging.getLogger("transformers").removeHandler(handler)
    hf_logging.set_verbosity(verbosity)


def test_a_causal_lm_checkpoint_loads_without_a_report_of_its_lm_head_but_other_keys_are_reported(
    tiny_checkpoints, tmp_path, transformers_warnings
):
    """A Stage I model is saved as a causal LM; the encoder reads its decoder body and leaves ``lm_head.weight`` out,
    as expected: no transformers load report for that. A checkpoint with another unexpected key, or a missing one,
    still gets transformers' report."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tiny_checkpoints["mistral"]  # a causal LM whose head is not tied: lm_head.weight is saved
    weights = load_file(folder / "model.safetensors")
    assert "lm_head.weight" in weights
    LLM2Vec.from_pretrained(str(folder), device="cpu")
    assert not [m for m in transformers_warnings if "LOAD REPORT" in m or "lm_head" in m], transformers_warnings

    changes = {
        "unexpected": (
            "model.layers.0.mlp.extra.weight",
            lambda w: w.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
        ),
        "missing": ("norm.weight", lambda w: w.pop("model.norm.weight")),
    }
    for name, (key, change) in changes.items():
        changed = dict(weights)
        change(changed)
        shutil.copytree(folder, tmp_path / name)
        save_file(changed, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        transformers_warnings.clear()
        LLM2Vec.from_pretrained(str(tmp_path / name), device="cpu")
        reports = [m for m in transformers_warnings if "LOAD REPORT" in m]
        assert len(reports) == 1 and key.removeprefix("model.") in reports[0], (name, transformers_warnings)


# ----------------------------------------------------------------------------------------------- sentence-transformers calls


def test_sentence_transformers_calls_against_independent_references(tiny_models, caplog):
    """``prompt=`` equals ``[instruction, text]`` pairs, ``prompt_name`` reads ``prompts``, ``truncate_dim`` is the
    first dimensions renormalised, ``similarity`` is the per-pair cosine, and ``encode_query`` without a ``query``
    prompt says so and equals ``encode_document``."""
    enc = encoder(tiny_models, "qwen2", prompts={"query": "Retrieve passages", "Sim": "Find similar text"})
    pairs = enc.encode([["Retrieve passages", t] for t in TEXTS], show_progress_bar=False)
    np.testing.assert_array_equal(enc.encode(TEXTS, prompt="Retrieve passages"), pairs)
    np.testing.assert_array_equal(enc.encode_query(TEXTS), pairs)
    np.testing.assert_array_equal(enc.encode_document(TEXTS), enc.encode(TEXTS))
    np.testing.assert_array_equal(
        enc.encode(TEXTS, prompt_name="Sim"), enc.encode([["Find similar text", t] for t in TEXTS])
    )
    full = enc.encode(TEXTS)
    cut = enc.encode(TEXTS, truncate_dim=5, normalize_embeddings=True)
    np.testing.assert_allclose(cut, full[:, :5] / np.linalg.norm(full[:, :5], axis=1, keepdims=True), rtol=0, atol=1e-6)
    sims = enc.similarity(pairs, full).numpy()
    for i, a in enumerate(pairs):
        for j, b in enumerate(full):
            assert sims[i, j] == pytest.approx(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), abs=1e-6)
    assert enc.similarity(pairs[0], full[0]).shape == (1, 1)
    bare = encoder(tiny_models, "qwen2")
    with caplog.at_level("WARNING"):
        np.testing.assert_array_equal(bare.encode_query(TEXTS), bare.encode_document(TEXTS))
    assert any("no 'query' prompt" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="truncate_dim must be a positive whole number"):
        enc.encode(TEXTS, truncate_dim=0)


def test_prompts_are_saved_and_loaded_with_the_model(tiny_checkpoints, tmp_path):
    """``prompts`` go into llm2vec_config.json and come back with ``from_pretrained``; ``max_seq_length`` is
    ``max_length``."""
    enc = LLM2Vec.from_pretrained(str(tiny_checkpoints["llama3"]), device="cpu", prompts={"query": "Find it"})
    enc.max_seq_length = 48
    enc.save(tmp_path / "saved")
    again = LLM2Vec.from_pretrained(str(tmp_path / "saved"), device="cpu")
    assert again.prompts == {"query": "Find it"} and again.max_length == again.max_seq_length == 48
    np.testing.assert_array_equal(again.encode_query(TEXTS), enc.encode([["Find it", t] for t in TEXTS]))
