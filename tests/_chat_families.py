"""Chat models of no registered family, offline: a tiny tokenizer with each model's special tokens, tokenizer
pipeline and published chat template (``tests/data/chat_templates/``, sources in ``SOURCES.md`` there), and the
end-of-sequence ids its config declares."""

from pathlib import Path

from tokenizers import AddedToken

from llm2vec.testing import build_chat_tokenizer

PUBLISHED = Path(__file__).resolve().parent / "data" / "chat_templates"


def _phi3_special(token: str) -> AddedToken:
    """Phi-3's chat tokens strip the whitespace after them (``"rstrip": true`` in its tokenizer_config.json)."""
    return AddedToken(token, rstrip=True, special=True, normalized=False)


# name -> model_type, tokenizer style, special tokens, bos, eos, pad, unk, the config's eos_token_id (tokens), and
# the anchor and user turn the derived family must have. The tokenizer styles are transformers 5's: Qwen3's and
# Phi-4-mini's byte-level BPE, Gemma 3's BPE without a dummy prefix, and LlamaTokenizer's for Mistral-7B-Instruct-v0.3
# and Phi-3 (a dummy prefix on the first piece of the input only).
CHAT_FAMILIES = {
    "qwen3": (  # Qwen/Qwen3-0.6B: config eos_token_id 151645 (<|im_end|>)
        "qwen3",
        "byte_level",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        None,
        "<|im_end|>",
        "<|endoftext|>",
        None,
        ["<|im_end|>"],
        ("<|im_start|>user\n", "<|im_end|>", "<|im_end|>"),
    ),
    "gemma3": (  # google/gemma-3-1b-it: config eos_token_id [1, 106] (<eos>, <end_of_turn>)
        "gemma3_text",
        "gemma",
        ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<eos>",
        "<pad>",
        "<unk>",
        ["<eos>", "<end_of_turn>"],
        ("<bos><start_of_turn>user\n", "<end_of_turn>", "<end_of_turn>"),
    ),
    "phi3": (  # microsoft/Phi-3-mini-4k-instruct: config eos_token_id 32000 (<|endoftext|>)
        "phi3",
        "llama",
        ["<unk>", "<s>", "</s>", "<|endoftext|>"]
        + [_phi3_special(t) for t in ("<|assistant|>", "<|end|>", "<|system|>", "<|user|>")],
        "<s>",
        "<|endoftext|>",
        "<|endoftext|>",
        "<unk>",
        ["<|endoftext|>"],
        ("<|user|>\n", "<|end|>\n<|endoftext|>", "<|endoftext|>"),
    ),
    "phi4_mini": (  # microsoft/Phi-4-mini-instruct: config eos_token_id 199999 (<|endoftext|>)
        "phi3",
        "byte_level",
        ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>", "<|tool|>", "<|/tool|>"],
        "<|endoftext|>",
        "<|endoftext|>",
        "<|endoftext|>",
        "<|endoftext|>",
        ["<|endoftext|>"],
        ("<|user|>", "<|end|><|endoftext|>", "<|endoftext|>"),
    ),
    "mistral_v03": (  # mistralai/Mistral-7B-Instruct-v0.3: config eos_token_id 2 (</s>); [INST] is a control token
        "mistral",
        "llama",
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"],
        "<s>",
        "</s>",
        None,
        "<unk>",
        ["</s>"],
        ("<s>[INST] ", "[/INST]</s>", "</s>"),
    ),
    "llama3_0": (  # meta-llama/Meta-Llama-3-8B-Instruct: config eos_token_id 128009 (<|eot_id|>); no system turn
        "llama",
        "byte_level",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        None,
        ["<|eot_id|>"],
        ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>", "<|eot_id|>"),
    ),
}


def published(name: str) -> str:
    return (PUBLISHED / f"{name}.jinja").read_text()


def chat_tokenizer(name: str, chat_template: str | None = None):
    """A tiny tokenizer of ``name`` carrying its published chat template (or ``chat_template``)."""
    _, style, specials, bos, eos, pad, unk, _, _ = CHAT_FAMILIES[name]
    return build_chat_tokenizer(
        style, specials, bos, eos, pad, published(name) if chat_template is None else chat_template, unk
    )


def chat_config(name: str, tokenizer, **kwargs):
    """A config of ``name``'s model type whose ``eos_token_id`` is the published config's (as ids of ``tokenizer``);
    ``kwargs`` set other fields, or override these."""
    from transformers import AutoConfig

    model_type, *_, eos_tokens, _ = CHAT_FAMILIES[name]
    ids = [tokenizer.convert_tokens_to_ids(t) for t in eos_tokens]
    fields = {
        "vocab_size": len(tokenizer),
        "eos_token_id": ids if len(ids) > 1 else ids[0],
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return AutoConfig.for_model(model_type, **{**fields, **kwargs})


def user_turn(name: str) -> tuple[str, str, str]:
    """``(opening, closing, anchor)`` of ``name``'s user turn, written out from its published chat template."""
    return CHAT_FAMILIES[name][-1]


def save_chat_checkpoint(name: str, folder, seed: int = 0):
    """A tiny random causal LM of ``name``'s model type with its tokenizer and published chat template, saved in
    ``folder`` (2 layers, width 32): a chat model of no registered family, as a user would bring one."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = chat_tokenizer(name)
    config = chat_config(
        name,
        tokenizer,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
