"""Every model as its publisher ships it goes through every path: Stage I, Stage II with the project's trainer and with
sentence-transformers' (CachedMultipleNegativesRankingLoss), the export, ``SentenceTransformer(export)`` against
``LLM2Vec.from_pretrained``, and the mteb evaluation of a local folder.

The models are :mod:`llm2vec.testing`'s tiny random ones with each publisher's tokenizer and config facts
(``llm2vec/published/models.json``, sources in ``SOURCES.md`` there): the paper's Llama-3.2 / 3.1 Instruct,
Mistral-7B-Instruct-v0.2 and Qwen2.5-Instruct, and what adopters use today: Mistral-7B-Instruct-v0.3, Qwen3, Gemma 3,
Phi-3.5-mini and Phi-4-mini, the Llama-3.2 base model and a GPT-2 base model. Llama and Mistral as published have no
pad token. The base models take ``"template": "plain"`` in their Stage I config, and every later step reads it back
from the saved ``llm2vec_config.json``. The reference for the export is ``LLM2Vec`` on the same folders; the
embeddings must agree to cosine 0.99999 on texts with trailing spaces, Unicode, an empty string and one cut at
``max_length``.
"""

import json

import pytest
import torch

pytest.importorskip("sentence_transformers")

import mteb_eval_custom  # noqa: E402
from _drivers import as_flags  # noqa: E402
from _tiny_data import write_tiny_beir, write_tiny_e5  # noqa: E402

from llm2vec import LLM2Vec  # noqa: E402
from llm2vec.testing import PUBLISHED_MODELS, save_tiny_model  # noqa: E402

WALKED = [
    "llama3",
    "llama3_1",
    "mistral",
    "qwen2",
    "mistral_v03",
    "qwen3",
    "gemma3",
    "phi3_5",
    "phi4_mini",
    "llama3_2_base",
    "gpt2",
]
BASE_MODELS = {"llama3_2_base", "gpt2"}  # no chat template: "template": "plain"
# the template each resolves to: its registered family, the one derived from its chat template, or plain
# (Mistral-7B-Instruct-v0.3's user turn has the ids of the registered Mistral family's)
TEMPLATE = {"llama3": "llama3", "llama3_1": "llama3", "mistral": "mistral", "mistral_v03": "mistral", "qwen2": "qwen2"}
MAX_LENGTH = 96
TEXTS = ["a text with trailing spaces   ", "Ünïcödé ☃ テキスト", "", "the quick brown fox jumps over " * 30]


def test_the_walked_models_are_the_published_facts():
    """The walk covers what the facts say: the paper's and adopters' models, pad tokens only where published."""
    assert set(WALKED) <= set(PUBLISHED_MODELS)
    without_pad = {n for n in WALKED if PUBLISHED_MODELS[n]["pad"] is None}
    assert without_pad == {"llama3", "llama3_1", "mistral", "mistral_v03", "llama3_2_base", "gpt2"}
    assert {n for n in WALKED if PUBLISHED_MODELS[n]["chat_template"] is None} == BASE_MODELS


def run_flags(model, data, out, **fields) -> list[str]:
    settings = dict(e5_sources='["nq"]', use_cpu="true", max_seq_length=MAX_LENGTH, per_device_train_batch_size=4)
    settings.update(max_steps=1, save_strategy="no", report_to="none", num_threads=1, disable_tqdm="true", seed=7)
    settings.update(dataloader_num_workers=0, warmup_steps=0)
    return as_flags(model_name_or_path=model, output_dir=out, dataset_file_path=data, **settings, **fields)


@pytest.mark.parametrize("name", WALKED)
def test_every_path_runs_on_the_model_as_published(name, tmp_path, keep_thread_count):
    from sentence_transformers import SentenceTransformer

    from llm2vec.export import export_sentence_transformers
    from llm2vec.training import run

    model = save_tiny_model(name, tmp_path / "model")
    data = write_tiny_e5(tmp_path / "data", n=8, sources=("nq",))
    beir = write_tiny_beir(tmp_path / "beir", queries=4, documents=8)
    template = "plain" if name in BASE_MODELS else None

    stage_I = tmp_path / "stage_I"
    run("I", run_flags(model, data, stage_I, template=template))
    recorded = json.loads((stage_I / "llm2vec_config.json").read_text())["template"]
    assert recorded == (template or TEMPLATE.get(name, "chat_template"))

    lora = dict(stage="II", lora_r=4, lora_alpha=8, learning_rate="1e-3")
    if name == "gpt2":  # GPT-2's linear layers have other names than the paper's Llama ones
        lora.update(lora_target_modules='["c_attn", "c_proj", "c_fc"]')
    run("II", run_flags(stage_I, data, tmp_path / "project", **lora))
    st_loss = dict(trainer="sentence_transformers", loss="CachedMultipleNegativesRankingLoss")
    st_run = tmp_path / "st"
    run("II", run_flags(stage_I, data, st_run, **lora, **st_loss, loss_kwargs='{"mini_batch_size": 2}'))
    for out in (tmp_path / "project", st_run):
        assert json.loads((out / "llm2vec_config.json").read_text())["template"] == recorded

    export = tmp_path / "export"
    export_sentence_transformers(
        str(stage_I), export, str(st_run), query_instruction="Retrieve passages", max_length=MAX_LENGTH
    )
    reference = LLM2Vec.from_pretrained(str(stage_I), peft_model_name_or_path=str(st_run), device="cpu")
    assert reference.template.name == recorded
    st = SentenceTransformer(str(export), device="cpu", local_files_only=True)
    for prompt_name, instruction in (("query", "Retrieve passages"), ("document", "")):
        ours = reference.encode(TEXTS, prompt=instruction, convert_to_tensor=True, normalize_embeddings=True)
        theirs = st.encode(TEXTS, prompt_name=prompt_name, convert_to_tensor=True)
        cosine = torch.nn.functional.cosine_similarity(ours, theirs)
        assert cosine.min() >= 0.99999, (prompt_name, cosine)

    results = tmp_path / "results"
    argv = ["--base_model_name_or_path", str(export), "--local_retrieval_dir", str(beir), "--local_instruction", ""]
    mteb_eval_custom.main([*argv, "--output_dir", str(results), "--device", "cpu", "--batch_size", "4"])
    (result,) = results.rglob("StdlibDocRetrieval.json")
    assert 0 <= json.loads(result.read_text())["scores"]["test"][0]["ndcg_at_10"] <= 1


# ------------------------------------------------------------------------------------ the rules the walk relies on


def tiny(name):
    from llm2vec.testing import build_tiny_model

    return build_tiny_model(name)


@pytest.mark.parametrize("name", ["llama3", "mistral", "gpt2"])
def test_a_tokenizer_without_pad_token_pads_with_the_anchor_and_padding_changes_no_embedding(name):
    """Published without a pad token: the batch pads with the anchor, masked out, so a text embeds in a batch of
    longer texts exactly as alone."""
    model, tokenizer = tiny(name)
    assert tokenizer.pad_token is None
    encoder = LLM2Vec(model, tokenizer, max_length=MAX_LENGTH, template="plain" if name == "gpt2" else None)
    assert encoder.pad_token_id == tokenizer.convert_tokens_to_ids(encoder.template.anchor)
    texts = ["short", "a much longer text than the first one, with several more words in it", "x"]
    together = encoder.encode(texts, batch_size=3, convert_to_tensor=True)
    for i, text in enumerate(texts):
        alone = encoder.encode([text], batch_size=1, convert_to_tensor=True)[0]
        torch.testing.assert_close(together[i], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama3_2_base", "gpt2"])
def test_the_plain_template_is_the_text_then_eos_with_the_bos_the_tokenizer_adds(name):
    """The reference is the tokenizer's own call with special tokens (BOS where the published tokenizer adds one)
    followed by the EOS id."""
    from llm2vec.templates import encode, resolve_template

    model, tokenizer = tiny(name)
    spec = resolve_template(model.config, tokenizer, "plain")
    text = "Paris is the capital of France."
    ids = list(encode(tokenizer, spec, [("", text)], MAX_LENGTH)[0].input_ids)
    assert ids == tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert (ids[0] == tokenizer.bos_token_id) == PUBLISHED_MODELS[name]["add_bos"]


def test_a_base_model_with_a_chat_familys_tokens_is_refused_naming_both_ways_out():
    """Llama-3.2 base has Llama-3's chat tokens but no chat template, and its EOS is not the chat anchor."""
    model, tokenizer = tiny("llama3_2_base")
    with pytest.raises(ValueError) as refused:
        LLM2Vec(model, tokenizer)
    message = str(refused.value)
    assert '"template": "plain"' in message and '"template": "llama3"' in message and "\n" not in message
    assert LLM2Vec(model, tokenizer, template="llama3").template.name == "llama3"  # asked for: used, with a warning


def test_a_model_of_no_family_and_no_chat_template_is_told_about_the_plain_template():
    model, tokenizer = tiny("gpt2")
    with pytest.raises(ValueError, match='"template": "plain"'):
        LLM2Vec(model, tokenizer)


def test_lora_targets_the_model_lacks_are_named_with_its_linear_modules(caplog):
    """None of the targets: refused in one line; some (Phi-3's fused projections): a warning, adapters on the rest."""
    from peft import LoraConfig

    from llm2vec.arguments import ConfigError
    from llm2vec.llm2vec_contrastive import add_lora

    model, _ = tiny("gpt2")
    with pytest.raises(ConfigError) as refused:
        add_lora(model.transformer, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert str(refused.value).startswith("lora_target_modules: q_proj, v_proj not among this gpt2 model's linear")
    assert "c_attn" in str(refused.value) and "\n" not in str(refused.value)
    phi3, _ = tiny("phi3_5")
    with caplog.at_level("WARNING", logger="llm2vec"):
        adapted = add_lora(phi3.model, LoraConfig(r=2, target_modules=["q_proj", "o_proj"]))
    assert "lora_target_modules: q_proj not among this phi3 model's linear modules" in caplog.text
    assert {n.split(".lora_A")[0].split(".")[-1] for n, _ in adapted.named_parameters() if "lora_A" in n} == {"o_proj"}
