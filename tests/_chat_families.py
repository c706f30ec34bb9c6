"""Chat models of no registered family, offline: the tiny published-fact models of :mod:`llm2vec.testing` (their
tokenizer, config and published chat template, ``llm2vec/published/``) and, written out by hand from each published
chat template, the user turn a derived family must have."""

from llm2vec.testing import PUBLISHED, build_tokenizer, published_chat_template, tiny_config  # noqa: F401

# name -> (opening, closing, anchor) of the user turn, written out from the published chat template.
CHAT_FAMILIES = {
    "qwen3": ("<|im_start|>user\n", "<|im_end|>", "<|im_end|>"),
    "gemma3": ("<bos><start_of_turn>user\n", "<end_of_turn>", "<end_of_turn>"),
    "phi3": ("<|user|>\n", "<|end|>\n<|endoftext|>", "<|endoftext|>"),
    "phi3_5": ("<|user|>\n", "<|end|>\n<|endoftext|>", "<|endoftext|>"),
    "phi4_mini": ("<|user|>", "<|end|><|endoftext|>", "<|endoftext|>"),
    "mistral_v03": ("<s>[INST] ", "[/INST]</s>", "</s>"),
    "llama3_0": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>", "<|eot_id|>"),
}


def published(name: str) -> str:
    return published_chat_template(name)


def chat_tokenizer(name: str, chat_template: str | None = None):
    """A tiny tokenizer of ``name`` carrying its published chat template (or ``chat_template``)."""
    return build_tokenizer(name, chat_template=chat_template)


def chat_config(name: str, tokenizer, **kwargs):
    """A config of ``name``'s model type whose eos, bos and pad ids are the published config's (as ids of
    ``tokenizer``); ``kwargs`` set other fields, or override these."""
    return tiny_config(name, tokenizer, **kwargs)


def user_turn(name: str) -> tuple[str, str, str]:
    """``(opening, closing, anchor)`` of ``name``'s user turn, written out from its published chat template."""
    return CHAT_FAMILIES[name]


def save_chat_checkpoint(name: str, folder, seed: int = 0):
    """A tiny random causal LM of ``name`` as published (:func:`llm2vec.testing.save_tiny_model`), saved in
    ``folder``: a chat model of no registered family, as a user would bring one."""
    from llm2vec.testing import save_tiny_model

    return save_tiny_model(name, folder, seed=seed)
