"""Export a trained model as a sentence-transformers folder that embeds exactly as :meth:`LLM2Vec.encode`.

``SentenceTransformer(folder)`` loads the result with no custom code and no ``trust_remote_code``:

- the root holds the decoder body (``AutoModel``, safetensors, any LoRA adapter merged), the tokenizer and
  ``sentence_bert_config.json`` (a ``Transformer`` module: text and message modalities in the chat layout,
  text only in the text layout; below) and, in the chat layout, the export's ``chat_template.jinja``;
- ``1_Pooling``: ``lasttoken`` for the paper's ``eos_token`` pooling (the anchor is the last real token),
  or ``mean`` with ``include_prompt: false`` for ``mean`` pooling;
- ``2_Normalize`` when the embeddings are normalised (the default);
- ``config_sentence_transformers.json``: the prompts, ``default_prompt_name: "document"``, cosine similarity;
- ``llm2vec_config.json`` (so :meth:`LLM2Vec.from_pretrained` loads the folder too, prompts included) and
  ``README.md`` (the model card).

How an LLM2Vec input is expressed in sentence-transformers. :func:`llm2vec.templates.encode` builds
``prefix(instruction) + text[:budget] + suffix``, tokenizing prefix and text separately and appending the
suffix (the anchor token) after truncation. Here:

1. text layout: the suffix goes into the tokenizer's post-processor (``TemplateProcessing("$A <suffix>")``); a
   tokenizer reserves room for the tokens its post-processor adds when it truncates, so a text longer
   than ``max_seq_length`` still ends in the anchor (the chat layout renders the suffix itself, below, and
   tokenizes without special tokens, so the post-processor adds nothing there);
2. the instruction is a sentence-transformers *prompt*, and how it reaches the tokenizer depends on the layout:

   - ``chat`` (the default; ``eos_token`` pooling): the folder declares sentence-transformers' ``message``
     modality, so every text becomes a user message and a prompt becomes a system message before it; the
     exported tokenizer's chat template (:func:`export_chat_template`, built from the template spec) renders
     ``prefix(instruction) + text + closing``, joining the instruction as :func:`templates.join_instruction`
     does. Any instruction passed as ``prompt=`` (an exported one or an ad-hoc one) therefore embeds as
     ``LLM2Vec.encode([[instruction, text]])``, and the prompts written are the plain instructions. A
     conversation the template cannot express (a text pair, an assistant turn, a system message of the
     user's own next to a prompt) raises the template's error instead of embedding something else.
     Truncation cuts the rendered closing, which sentence-transformers restores over the last tokens (its
     ``restore_suffix``): the text is cut and the anchor ends the row, as in ``templates.encode``;
   - ``text`` (``named_prompts_only``; required for ``mean`` pooling, which needs sentence-transformers' text
     path to leave the prompt out of the mean): each prompt is the prefix text followed by
     :data:`TEXT_MARKER`, prepended to the text as a string. Only the exported prompts embed exactly: an
     ad-hoc ``prompt=`` string has no marker and no chat header and gives other vectors, which the text path
     cannot detect, so this layout is written only when asked for;

   in both, the rendered string carries :data:`TEXT_MARKER` between prefix and text (and, in the chat layout,
   between text and closing); the exported tokenizer's pre-tokenizer splits the input there and drops the
   marker, so the pieces are tokenized separately, exactly as ``templates.encode`` does, even where
   tokenizing them as one string would merge tokens across a boundary (Mistral's ``"[INST] "`` followed by a
   word);
3. truncation is from the right at ``model_max_length = max_length``: the prompt is on the left, so only
   the text is cut; padding is on the right (position ids then equal LLM2Vec's).

Modules: :mod:`.prompts` (the prompts and the query instruction), :mod:`.tokenizer` (the exported tokenizer
and chat template), :mod:`.verify` (what is refused, and the checks of the written folder), :mod:`.writer` (the
export itself). ``llm2vec_config.json`` records the settings and the prompts as plain instructions, so
``LLM2Vec.from_pretrained(<export>)`` embeds as the source does and its ``encode_query`` uses the same ``query``
prompt; the exported tokenizer tokenizes an input without the markers as the source's does
(:mod:`.tokenizer`), which the checks require.

What cannot be exported (:class:`ExportError`, nothing is written): pooling modes sentence-transformers
lacks (``last_token``: the token before the anchor; ``weighted_mean``: weights counted from the first text
token), ``mean`` pooling without ``named_prompts_only``, a ``max_length`` above the model's
``max_position_embeddings`` (sentence-transformers caps its
length there), a template whose suffix depends on the instruction, no query instruction (none given and the run
config does not name exactly one: :func:`resolve_query_instruction`), and a tokenizer for which the split
at the marker does not reproduce separate tokenization (e.g. a SentencePiece ``Metaspace`` that prepends
``"▁"`` to the first piece only). Before the folder is renamed into place it is loaded with
``SentenceTransformer`` and checked on probe texts (short, starting or ending with spaces and newlines,
digits, special tokens, and longer than ``max_length``): the same token ids as ``templates.encode`` for every
prompt (and, in the chat layout, for the ad-hoc instructions of :data:`ADHOC_PROBES`), embeddings with cosine
>= :data:`MIN_COSINE` to ``LLM2Vec.encode``, (chat layout) that a conversation of two user turns is refused,
and that the folder read by ``LLM2Vec.from_pretrained`` gives the source's token ids (:mod:`.verify`).

What the chat layout cannot detect: an ad-hoc instruction so long that template, instruction and anchor fill
``max_length`` (``templates.encode`` raises; sentence-transformers cuts the instruction, and a chat template
cannot count tokens). The exported prompts are checked for this before anything is written.
"""

from __future__ import annotations

from .prompts import (
    ADHOC_PROBES,
    CHAT_LAYOUT,
    DOCUMENT_PROMPT,
    QUERY_PROMPT,
    STRIP_MARKER,
    TEXT_LAYOUT,
    TEXT_MARKER,
    ExportedPrompt,
    ExportError,
    build_prompts,
    resolve_query_instruction,
)
from .tokenizer import export_chat_template, export_tokenizer
from .verify import MIN_COSINE, MIN_COSINE_16BIT, PROBE_TEXTS, verify_export
from .writer import export_sentence_transformers, mteb_category_table, read_instructions

__all__ = [
    "ADHOC_PROBES",
    "CHAT_LAYOUT",
    "DOCUMENT_PROMPT",
    "MIN_COSINE",
    "MIN_COSINE_16BIT",
    "PROBE_TEXTS",
    "QUERY_PROMPT",
    "STRIP_MARKER",
    "TEXT_LAYOUT",
    "TEXT_MARKER",
    "ExportError",
    "ExportedPrompt",
    "build_prompts",
    "export_chat_template",
    "export_sentence_transformers",
    "export_tokenizer",
    "mteb_category_table",
    "read_instructions",
    "resolve_query_instruction",
    "verify_export",
]
