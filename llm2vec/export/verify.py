"""The checks of an export: what cannot be exported, and the written folder against ``LLM2Vec.encode``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import templates
from ..keywords import strict_booleans
from ..llm2vec import LLM2Vec, decoder_body, read_llm2vec_config
from .prompts import ExportError

ST_POOLING = {"eos_token": "lasttoken", "mean": "mean"}
"""LLM2Vec pooling mode -> sentence-transformers ``Pooling`` mode, for the modes it can express exactly."""

NOT_EXPORTABLE_POOLING = {
    "last_token": "it reads the token before the anchor; sentence-transformers' lasttoken reads the anchor itself",
    "weighted_mean": "its weights count from the first text token; sentence-transformers' weightedmean counts "
    "from the first token of the sequence (prompt included)",
}

MIN_COSINE = 0.99999
MIN_COSINE_16BIT = 0.9999
"""Required cosine to ``LLM2Vec.encode`` per probe text: float32 weights, and bfloat16/float16 weights (where the
two computations round differently; the token ids are still required to be identical)."""
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    " a text that starts with a space",
    "\na text that starts with a newline",
    "  two spaces, then words",
    "0123 numbers first",
    "Ünïcödé and accents",
    "",
    "x",
    "(parentheses) [brackets]: punctuation first!",
    "a document that ends with a newline\n",
    "ends with spaces and a tab  \t",
    "two lines\n\nand a blank one between\n\n",
    " \n ",
)


def check_exportable(encoder: LLM2Vec) -> None:
    """Refuse what sentence-transformers cannot express exactly (pooling, length)."""
    if encoder.pooling_mode not in ST_POOLING:
        raise ExportError(
            f"pooling_mode {encoder.pooling_mode!r} cannot be exported: "
            f"{NOT_EXPORTABLE_POOLING.get(encoder.pooling_mode, 'no sentence-transformers equivalent')}. "
            f"Exportable modes: {', '.join(ST_POOLING)}"
        )
    limit = getattr(decoder_body(encoder.model).config, "max_position_embeddings", None)
    if limit is not None and encoder.max_length > limit:
        raise ExportError(
            f"max_length {encoder.max_length} exceeds the model's max_position_embeddings {limit}, where "
            f"sentence-transformers caps max_seq_length; export with max_length <= {limit}"
        )


def probe_texts(tokenizer, max_length: int) -> list[str]:
    """:data:`PROBE_TEXTS` plus one text of more than ``max_length`` tokens (tests the truncation)."""
    long_text = PROBE_TEXTS[0]
    while len(tokenizer(long_text, add_special_tokens=False)["input_ids"]) <= max_length:
        long_text += " " + PROBE_TEXTS[0]
    return [*PROBE_TEXTS, long_text]


@strict_booleans
def verify_export(folder, encoder_ids, reference, texts, normalize: bool, device="cpu", adhoc=None) -> dict[str, Any]:
    """Load ``folder`` with ``SentenceTransformer`` and compare token ids (every prompt) and embeddings.

    ``encoder_ids``: label -> ``templates.encode`` ids of ``texts``; ``reference``: label -> ``LLM2Vec.encode``
    embeddings; ``adhoc``: label -> an instruction passed as ``prompt=`` (two user turns must then be refused).
    Returns the smallest cosine; raises :class:`ExportError` on any difference.
    """
    from sentence_transformers import SentenceTransformer

    adhoc = dict(adhoc or {})
    model = SentenceTransformer(str(folder), device=str(device), local_files_only=True, trust_remote_code=False)
    for label, expected in encoder_ids.items():
        features = model.preprocess(list(texts), prompt=adhoc[label] if label in adhoc else model.prompts[label])
        got = [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"])]
        for text, a, b in zip(texts, got, expected):
            if a != b:
                raise ExportError(
                    f"prompt {label!r}: sentence-transformers tokenizes {text[:40]!r} to {len(a)} ids that differ "
                    f"from LLM2Vec's {len(b)} (first difference at position "
                    f"{next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}); "
                    "this tokenizer cannot be exported exactly"
                )
    if adhoc:  # the chat layout refuses what its template cannot express, rather than embed something else
        two_turns = [{"role": "user", "content": text} for text in texts[:2]]
        try:
            model.encode([two_turns], show_progress_bar=False)
        except Exception as e:  # jinja2's TemplateError, raised by the exported chat template
            if "anchor-embedding export" not in str(e):
                raise ExportError(
                    f"two user turns failed with an unexpected error ({e}); the export was not written"
                ) from None
        else:
            raise ExportError(
                "the exported chat template embeds two user turns instead of refusing them; the export was not written"
            )
    worst = 1.0
    for label, ref in reference.items():
        prompt = {"prompt": adhoc[label]} if label in adhoc else {"prompt_name": label}
        raw = model.encode(list(texts), convert_to_tensor=True, show_progress_bar=False, batch_size=1, **prompt)
        emb = raw.float().cpu()
        cos = torch.nn.functional.cosine_similarity(emb, ref.float(), dim=-1)
        worst = min(worst, cos.min().item())
        needed = MIN_COSINE if raw.dtype == torch.float32 else MIN_COSINE_16BIT
        if cos.min().item() < needed:
            i = int(cos.argmin())
            raise ExportError(
                f"prompt {label!r}: the exported model embeds {texts[i][:40]!r} with cosine {cos[i].item():.6f} "
                f"to LLM2Vec.encode (needed >= {needed}); the export was not written"
            )
        tolerance = 1e-4 if raw.dtype == torch.float32 else 1e-2  # a 16-bit vector is normalised to 16 bits
        if normalize and not torch.allclose(emb.norm(dim=-1), torch.ones(len(texts)), atol=tolerance):
            raise ExportError("the exported embeddings are not normalised although normalize=True")
    del model
    return dict(
        min_cosine=worst, prompts_checked=len(encoder_ids), embeddings_checked=list(reference), texts=len(texts)
    )


def verify_llm2vec_loading(folder, settings: Mapping[str, Any], encoder_ids, instruction_of, texts) -> None:
    """The folder as ``LLM2Vec.from_pretrained(folder)`` reads it (``llm2vec_config.json``, and the tokenizer through
    ``AutoTokenizer``) gives the source's settings and, for every label of ``encoder_ids``, the source's token ids of
    ``[instruction_of[label], text]``; raises :class:`ExportError` naming the first difference."""
    from transformers import AutoConfig, AutoTokenizer

    saved = read_llm2vec_config(folder)
    changed = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
    if changed:
        raise ExportError(f"the exported llm2vec_config.json differs from the source (saved, source): {changed}")
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    try:  # a derived or plain template is read again from the export's own tokenizer
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        spec = templates.named_template(saved["template"], config, tokenizer)
    except ValueError as e:
        raise ExportError(
            f"LLM2Vec.from_pretrained(<export>) cannot build the prompt template again ({e}); the export was not written"
        ) from None
    for label, expected in encoder_ids.items():
        got = templates.encode(tokenizer, spec, [(instruction_of[label], t) for t in texts], saved["max_length"])
        for text, a, b in zip(texts, got, expected):
            if list(a.input_ids) != list(b):
                raise ExportError(
                    f"prompt {label!r}: LLM2Vec.from_pretrained(<export>) tokenizes {text[:40]!r} to other ids than "
                    f"the source ({len(a.input_ids)} vs {len(b)}); the export was not written"
                )
