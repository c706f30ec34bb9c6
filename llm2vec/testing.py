"""Tiny random causal LMs with each family's tokenizer, built offline.

Used by the test-suite, the distributed tests (which need a checkpoint folder) and the reduced CI demo.
Nothing here touches the network: the tokenizer is a byte-level BPE trained in memory on a small
built-in corpus, with the family's special tokens and chat template added.
"""

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

# family -> (model class name, special tokens, bos, eos/anchor, pad, chat template)
_FAMILIES = {
    "llama3": (
        "llama",
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>",
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}",
    ),
    "smollm2": (
        "llama",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "<|im_start|>", "<|im_end|>", "<|im_end|>",
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    ),
    "qwen2": (
        "qwen2",
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        None, "<|im_end|>", "<|endoftext|>",
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    ),
    "mistral": (
        "mistral",
        ["<unk>", "<s>", "</s>"],
        "<s>", "</s>", "</s>",
        "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}",
    ),
}

FAMILIES = tuple(_FAMILIES)


def build_tokenizer(family: str, vocab_size: int = 320):
    """A byte-level BPE tokenizer with ``family``'s special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    _, specials, bos, eos, pad, chat_template = _FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                        unk_token="<unk>" if family == "mistral" else None)
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_model(family: str, seed: int = 0, hidden_size: int = 32, num_layers: int = 2, vocab_size: int = 320):
    """A random causal LM of ``family``'s architecture (float32) and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer(family, vocab_size)
    model_type = _FAMILIES[family][0]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
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


def write_tiny_e5(folder: str | Path, n: int = 24, sources: tuple[str, ...] = ("nq", "fever"), seed: int = 0) -> Path:
    """E5-layout training files (``<source>.jsonl`` with query/positive/negative) of random words, offline."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    words = " ".join(_CORPUS).replace(".", "").replace(",", "").split()
    g = torch.Generator().manual_seed(seed)

    def pick(k: int) -> str:
        return " ".join(words[i] for i in torch.randint(len(words), (k,), generator=g))

    for source in sources:
        with open(folder / f"{source}.jsonl", "w") as f:
            for _ in range(n):
                f.write(json.dumps({"query": pick(5), "positive": pick(14), "negative": pick(9)}) + "\n")
    return folder
