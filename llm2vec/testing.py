"""Tiny random causal LMs with each family's tokenizer, built offline.

Used by the test-suite, the distributed tests (which need a checkpoint folder) and the reduced CI demo.
Nothing here touches the network: the tokenizer is a BPE trained in memory on a small built-in corpus
(byte-level like Llama-3's, Qwen2.5's and SmolLM2's; sentencepiece-style for Mistral), with the family's
special tokens and a chat template that renders conversations as the real model's does.
"""

from __future__ import annotations

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

# The families' chat templates, written after the public formats of the real models' tokenizers (only the
# parts a user/system/assistant conversation uses; no tool calls). Each inserts the model's default system
# turn when the conversation has none, as the real ones do; Llama-3.x's date is fixed to the 3.1 default.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN2_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MISTRAL_CHAT_TEMPLATE = (  # Mistral-7B-Instruct-v0.2: no system role; [INST] and [/INST] are plain text
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

# family -> (model class name, special tokens, bos, eos, pad, chat template)
_FAMILIES = {
    "llama3": (
        "llama",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        LLAMA3_CHAT_TEMPLATE,
    ),
    "smollm2": (
        "llama",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        SMOLLM2_CHAT_TEMPLATE,
    ),
    "qwen2": (
        "qwen2",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None,
        "<|im_end|>",
        "<|endoftext|>",
        QWEN2_CHAT_TEMPLATE,
    ),
    "mistral": ("mistral", ["<unk>", "<s>", "</s>"], "<s>", "</s>", "</s>", MISTRAL_CHAT_TEMPLATE),
}

FAMILIES = tuple(_FAMILIES)
SENTENCEPIECE_FAMILIES = ("mistral",)  # the legacy sentencepiece layout of :func:`_word_start_bpe`

_ALPHABET = sorted(
    set("".join(_CORPUS))
    | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    | set("[]/;:!?.,()'\"-_*#@&%+=<>|")
)


def _byte_level_bpe(specials, vocab_size):
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
    return tok


def _word_start_bpe(specials, bos, vocab_size, style):
    """A BPE over "▁"-marked words (merges learnt within words, as sentencepiece does), laid out as ``sentencepiece``
    (Mistral-7B-Instruct-v0.2's tokenizer.json: normalizer Prepend("▁") + Replace(" ", "▁") on every text segment
    between special tokens), ``llama`` (transformers 5's ``LlamaTokenizer``, as Mistral-7B-Instruct-v0.3's and
    Phi-3's: a Metaspace pre-tokenizer that marks the start of the input only) or ``gemma`` (``GemmaTokenizer``:
    spaces become "▁", nothing is prepended), with a "<bos> $A" post-processor where there is a bos token. Outside
    the legacy ``sentencepiece`` layout, newlines are single tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

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
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


TOKENIZER_STYLES = ("byte_level", "sentencepiece", "llama", "gemma")  # byte-level BPE, or :func:`_word_start_bpe`'s


def build_chat_tokenizer(
    style: str, specials, bos, eos, pad, chat_template: str | None, unk: str | None = None, vocab_size: int = 320
):
    """A tokenizer of one of :data:`TOKENIZER_STYLES` with these special tokens (strings, or ``tokenizers.AddedToken``
    for one that strips the whitespace beside it, as Phi-3's do) and ``chat_template``, trained offline."""
    from transformers import PreTrainedTokenizerFast

    if style == "byte_level":
        tok = _byte_level_bpe(specials, vocab_size)
    elif style in ("sentencepiece", "llama", "gemma"):
        tok = _word_start_bpe(specials, bos, vocab_size, style)
    else:
        raise ValueError(f"unknown tokenizer style {style!r}; one of {TOKENIZER_STYLES}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tokenizer(family: str, vocab_size: int = 320):
    """A tokenizer with ``family``'s special tokens and chat template."""
    _, specials, bos, eos, pad, chat_template = _FAMILIES[family]
    style = "sentencepiece" if family in SENTENCEPIECE_FAMILIES else "byte_level"
    unk = "<unk>" if "<unk>" in specials else None
    return build_chat_tokenizer(style, specials, bos, eos, pad, chat_template, unk, vocab_size)


def build_tiny_model(family: str, seed: int = 0, hidden_size: int = 32, num_layers: int = 2, vocab_size: int = 320):
    """A random causal LM of ``family``'s architecture (float32) and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer(family, vocab_size)
    model_type = _FAMILIES[family][0]
    sizes = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers)
    sizes.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, vocab_size=len(tokenizer))
    ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    config = AutoConfig.for_model(model_type, tie_word_embeddings=False, **sizes, **ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def save_tiny_model(family: str, path: str | Path, seed: int = 0, **kwargs) -> Path:
    """Build a tiny model and save it as a checkpoint folder (safetensors + tokenizer)."""
    path = Path(path)
    model, tokenizer = build_tiny_model(family, seed=seed, **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
