"""Tiny random causal LMs as their publishers ship them, built offline."""

from __future__ import annotations

import json
from pathlib import Path

import torch

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Given a web search query, retrieve relevant passages that answer the query.",
    "Return the number of items in a container; raise an error if the object has no length.",
    "Anchor embeddings reconstruct the document from the query and the query from the document.",
    "Large language models are trained on text; embeddings are vectors that capture meaning.",
    "def function(argument, *args, **kwargs) -> None: open a file and read its lines.",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is in Italy.",
    "0123456789 numbers, punctuation: commas, periods. Questions? Answers! (parentheses) [brackets]",
]

_ALPHABET = sorted(
    set("".join(_CORPUS))
    | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    | set("[]/;:!?.,()'\"-_*#@&%+=<>|")
)


def _byte_level_bpe(specials, bos, vocab_size):
    """A byte-level BPE (Llama-3's, Qwen's, SmolLM2's, GPT-2's), with a "<bos> $A" post-processor when ``bos``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    _add_bos(tok, bos)
    return tok


def _add_bos(tok, bos) -> None:
    from tokenizers import processors

    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )


def _word_start_bpe(specials, bos, vocab_size, style):
    """A BPE over "▁"-marked words, laid out as ``sentencepiece`` (Mistral-7B-Instruct-v0.2: Prepend("▁") on every
    segment), ``llama`` (Metaspace marking the input's start only) or ``gemma`` (nothing prepended)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in map(str, specials) else None, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    alphabet = _ALPHABET + (["▁"] if style == "sentencepiece" else ["▁", "\n"])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    decoding = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(decoding if style == "gemma" else [*decoding, decoders.Strip(" ", 1, 0)])
    if style == "llama":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tok.pre_tokenizer = None
        spaces = normalizers.Replace(" ", "▁")
        tok.normalizer = (
            normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if style == "sentencepiece" else spaces
        )
    _add_bos(tok, bos)
    return tok


TOKENIZER_STYLES = ("byte_level", "sentencepiece", "llama", "gemma")  # byte-level BPE, or :func:`_word_start_bpe`'s


def build_chat_tokenizer(
    style: str,
    specials,
    bos,
    eos,
    pad,
    chat_template: str | None,
    unk: str | None = None,
    vocab_size: int = 320,
    add_bos: bool = True,
):
    """A tokenizer of one of :data:`TOKENIZER_STYLES` with these special tokens (strings or ``AddedToken``) and
    ``chat_template``, trained offline; it adds ``bos`` to every text when ``add_bos``."""
    from transformers import PreTrainedTokenizerFast

    added_bos = bos if add_bos else None
    if style == "byte_level":
        tok = _byte_level_bpe(specials, added_bos, vocab_size)
    elif style in ("sentencepiece", "llama", "gemma"):
        tok = _word_start_bpe(specials, added_bos, vocab_size, style)
    else:
        raise ValueError(f"unknown tokenizer style {style!r}; one of {TOKENIZER_STYLES}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk
    )
    tokenizer.chat_template = chat_template
    return tokenizer


PUBLISHED = Path(__file__).resolve().parent / "published"  # models.json, the chat templates and their SOURCES.md
PUBLISHED_MODELS: dict[str, dict] = {
    k: v for k, v in json.loads((PUBLISHED / "models.json").read_text()).items() if not k.startswith("_")
}
FAMILIES = ("llama3", "smollm2", "qwen2", "mistral")  # the models of the registered template families


def published_chat_template(name: str) -> str | None:
    """The published chat template of model ``name`` of :data:`PUBLISHED_MODELS`, verbatim; None when it has none."""
    file = PUBLISHED_MODELS[name]["chat_template"]
    return None if file is None else (PUBLISHED / file).read_text()


def _special(token):
    from tokenizers import AddedToken

    if isinstance(token, str):
        return token
    return AddedToken(token["content"], rstrip=token.get("rstrip", False), special=True, normalized=False)


def build_tokenizer(name: str, vocab_size: int = 320, chat_template: str | None = None):
    """A tokenizer with the published facts of model ``name`` (its chat template, or ``chat_template``)."""
    facts = PUBLISHED_MODELS[name]
    return build_chat_tokenizer(
        facts["tokenizer"],
        [_special(t) for t in facts["special_tokens"]],
        facts["bos"],
        facts["eos"],
        facts["pad"],
        published_chat_template(name) if chat_template is None else chat_template,
        facts["unk"],
        vocab_size,
        facts["add_bos"],
    )


def _ids(tokenizer, tokens):
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    return ids if len(ids) > 1 else ids[0]


def tiny_config(name: str, tokenizer, hidden_size: int = 32, num_layers: int = 2, **kwargs):
    """A config of model ``name``'s architecture, ``hidden_size`` wide and ``num_layers`` deep, with the published
    config's bos, eos and pad ids (of ``tokenizer``); ``kwargs`` set other fields."""
    from transformers import AutoConfig

    facts = PUBLISHED_MODELS[name]
    fields = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers)
    fields.update(num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=256)
    fields.update(vocab_size=len(tokenizer), tie_word_embeddings=facts["tie_word_embeddings"])
    fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=_ids(tokenizer, facts["config_eos"]))
    fields.update(pad_token_id=None if facts["config_pad"] is None else _ids(tokenizer, [facts["config_pad"]]))
    return AutoConfig.for_model(facts["model_type"], **{**fields, **kwargs})


def build_tiny_model(name: str, seed: int = 0, hidden_size: int = 32, num_layers: int = 2, vocab_size: int = 320):
    """A random causal LM of ``name``'s architecture (float32, its published generation config) and its tokenizer."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tokenizer(name, vocab_size)
    config = tiny_config(name, tokenizer, hidden_size, num_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    facts = PUBLISHED_MODELS[name]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=_ids(tokenizer, facts["generation_eos"])
    )
    model.eval()
    return model, tokenizer


def save_tiny_model(name: str, path: str | Path, seed: int = 0, **kwargs) -> Path:
    """Build a tiny model of ``name`` and save it as a checkpoint folder (safetensors, tokenizer, generation config)."""
    path = Path(path)
    model, tokenizer = build_tiny_model(name, seed=seed, **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
