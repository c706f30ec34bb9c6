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

   in both, the tokenizer splits the input at :data:`TEXT_MARKER` and tokenizes the pieces separately, as
   ``templates.encode`` does (:mod:`.tokenizer`);
3. truncation is from the right at ``model_max_length = max_length``: the prompt is on the left, so only
   the text is cut; padding is on the right (position ids then equal LLM2Vec's).

Modules: :mod:`.prompts` (the prompts and the query instruction), :mod:`.tokenizer` (the exported tokenizer
and chat template), :mod:`.verify` (what is refused, and the checks of the written folder), :mod:`.writer` (the
export itself). ``llm2vec_config.json`` records the settings and the prompts as plain instructions, so
``LLM2Vec.from_pretrained(<export>)`` embeds as the source does, its ``encode_query`` with the same ``query`` prompt.

What cannot be exported (pooling modes sentence-transformers lacks, a ``max_length`` above the model's positions, a
template whose suffix depends on the instruction, no single query instruction, a tokenizer whose split at the marker
is not separate tokenization) is an :class:`ExportError` before anything is written; ``docs/export.md`` lists every
refusal. Before the folder is renamed into place it is loaded and checked against ``LLM2Vec.encode`` on probe texts,
token ids and embeddings (:mod:`.verify`).
"""

from __future__ import annotations

from .prompts import ADHOC_PROBES, STRIP_MARKER, TEXT_MARKER, ExportError
from .tokenizer import export_chat_template, export_tokenizer
from .verify import MIN_COSINE
from .writer import export_sentence_transformers, read_instructions

__all__ = [
    "ADHOC_PROBES",
    "MIN_COSINE",
    "STRIP_MARKER",
    "TEXT_MARKER",
    "ExportError",
    "export_chat_template",
    "export_sentence_transformers",
    "export_tokenizer",
    "read_instructions",
]
