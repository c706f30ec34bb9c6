"""Write the export: :func:`export_sentence_transformers` (the steps of the package docstring) and the folder's
sentence-transformers files."""

from __future__ import annotations

import gc
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import templates
from ..devices import default_device, resolve_dtype
from ..keywords import strict_booleans
from ..llm2vec import CONFIG_NAME, LLM2Vec, decoder_body
from ..model_card import ModelCardInputs, history_of, render_model_card
from ..model_files import check_model_files
from ..run import check_export_target, claim_export_folder
from ..templates import pad_token
from .prompts import (
    ADHOC_PROBES,
    CHAT_LAYOUT,
    DOCUMENT_PROMPT,
    TEXT_LAYOUT,
    TEXT_MARKER,
    ExportedPrompt,
    ExportError,
    build_prompts,
    resolve_query_instruction,
)
from .tokenizer import export_chat_template, export_tokenizer, fitting_chat_template, write_tokenizer
from .verify import ST_POOLING, check_exportable, probe_texts, verify_export, verify_llm2vec_loading

logger = logging.getLogger(__name__)

# sentence_bert_config.json (the Transformer module's arguments). The text layout: text only, so sentence-transformers
# never renders a chat template. The chat layout declares the message modality: every text becomes a user message, a
# prompt a system message, rendered by the exported chat template ("flat": string contents).
_FORWARD = {"method": "forward", "method_output_name": "last_hidden_state"}
ST_TRANSFORMER_CONFIG = {
    "transformer_task": "feature-extraction",
    "modality_config": {"text": _FORWARD},
    "module_output_name": "token_embeddings",
}
ST_CHAT_TRANSFORMER_CONFIG = {
    **ST_TRANSFORMER_CONFIG,
    "modality_config": {"text": _FORWARD, "message": {**_FORWARD, "format": "flat"}},
}


def read_instructions(path: str | os.PathLike, names: Sequence[str] | None = None) -> dict[str, str]:
    """``name -> instruction`` from a JSON object (the repository's MTEB ``task_to_instructions.json``), keeping
    ``names`` (all entries when None or ``["all"]``)."""
    from ..evaluation.paths import read_input_json

    holds = "pass a JSON object mapping task names to instructions (the repository ships one as "
    holds += "mteb/task_to_instructions.json among its test configs)"
    mapping = read_input_json(path, "instructions file", holds, ExportError)
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ExportError(f"instructions file {str(path)!r} must be a JSON object mapping names to instruction strings")
    if names is None or list(names) == ["all"]:
        return mapping
    missing = [n for n in names if n not in mapping]
    if missing:
        raise ExportError(f"{path}: no instruction for {missing}; add them there or leave them out of the task list")
    return {n: mapping[n] for n in names}


def mteb_category_table(results_dirs: Sequence[str | os.PathLike], tasks_file: str | os.PathLike | None) -> str:
    """Category averages in the layout of the paper's Table 1 for mteb result folders, the tasks grouped as
    ``tasks_file`` says (the repository's MTEB ``tasks.json``), for the export's model card. Raises
    :class:`llm2vec.evaluation.tables.TableError` for a folder without result files of those tasks."""
    if not tasks_file:
        raise ValueError(
            "mteb_results given without mteb_tasks_file: the card needs the tasks file that groups "
            "the results into categories (the repository's MTEB tasks.json)"
        )
    from ..evaluation import tables
    from ..evaluation.benchmark import load_benchmark

    benchmark = load_benchmark(tasks_file)
    runs = [tables.read_run(folder, benchmark, label=Path(folder).name) for folder in results_dirs]
    return tables.render_category_table(runs, benchmark, paper=None)


def _default_dtype(path: str, trust_remote_code: bool = False) -> torch.dtype:
    """The dtype in the checkpoint's config.json, float32 when it names none."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), "dtype", None)
    dtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


@strict_booleans
def export_sentence_transformers(
    base_model_name_or_path: str,
    output_dir: str | os.PathLike,
    peft_model_name_or_path: str | None = None,
    *,
    instructions: Mapping[str, str] | None = None,
    task_to_instructions_fp: str | os.PathLike | None = None,
    tasks: Sequence[str] | None = None,
    query_instruction: str | None = None,
    pooling_mode: str | None = None,
    max_length: int | None = None,
    template: str | None = None,
    normalize: bool = True,
    dtype: str | torch.dtype | None = None,
    mteb_results: Sequence[str | os.PathLike] = (),
    mteb_tasks_file: str | os.PathLike | None = None,
    verify_embeddings: bool = True,
    device: str | torch.device | None = None,
    overwrite: bool = False,
    named_prompts_only: bool = False,
    trust_remote_code: bool = False,
    accept_other_base: bool = False,
) -> dict[str, Any]:
    """Write a sentence-transformers folder to ``output_dir`` (layouts: docs/design.md, arguments: docs/export.md);
    returns a summary. The source (``peft_model_name_or_path`` merged) loads as :meth:`LLM2Vec.load`; ``instructions``
    (or those of ``tasks`` in ``task_to_instructions_fp``) become prompts; ``query_instruction`` None is the one the
    run trained with; ``dtype`` defaults to the base's; ``named_prompts_only`` is the text layout."""
    check_model_files(base_model_name_or_path, peft_model_name_or_path, trust_remote_code, accept_other_base)
    output_dir = Path(output_dir)
    read = [("base model", base_model_name_or_path), ("adapter", peft_model_name_or_path)]
    read += [("instructions file", task_to_instructions_fp), *[("mteb results folder", r) for r in mteb_results]]
    check_export_target(output_dir, overwrite, read)  # the lock and rules of a run's folder (llm2vec.run.target)
    for folder in {output_dir, next(p for p in output_dir.absolute().parents if p.exists())}:  # before the model loads
        if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
            raise ExportError(f"output_dir {output_dir}: cannot write in {folder} (permissions or a read-only mount)")
    given = dict(instructions or {})
    if task_to_instructions_fp is not None:
        given.update(read_instructions(task_to_instructions_fp, tasks))
    elif tasks:
        raise ExportError("tasks were named but no task_to_instructions_fp was given to read their instructions from")

    # the query instruction is known from the run configs alone: refused before the model loads
    history = history_of([p for p in (base_model_name_or_path, peft_model_name_or_path) if p])
    last_run = history[-1] if history else None
    query = resolve_query_instruction(
        query_instruction, last_run.run_config if last_run else None, last_run.folder if last_run else None
    )
    save_dtype = (
        resolve_dtype(dtype) if dtype is not None else _default_dtype(base_model_name_or_path, trust_remote_code)
    )
    layout = TEXT_LAYOUT if named_prompts_only else CHAT_LAYOUT
    loading = dict(trust_remote_code=trust_remote_code, accept_other_base=accept_other_base)
    settings = dict(pooling_mode=pooling_mode, max_length=max_length, template=template, **loading)
    encoder = exportable_encoder(base_model_name_or_path, peft_model_name_or_path, layout, save_dtype, **settings)
    prompts = build_prompts(encoder, given, query.instruction, layout)
    template_name, has_chat_template = encoder.template.name, bool(encoder.tokenizer.chat_template)
    tokenizer = exported_tokenizer(encoder, prompts, layout)
    body = decoder_body(encoder.model)

    device = torch.device(device) if device is not None else default_device()
    texts = probe_texts(encoder.tokenizer, encoder.max_length)
    named = {name: p.instruction for name, p in prompts.items()}
    # the chat layout's check also passes instructions that are no exported prompt as prompt=, as they are
    adhoc = {f"prompt={text!r}": text for text in ADHOC_PROBES} if layout == CHAT_LAYOUT else {}
    instruction_of = {**named, **adhoc}
    encoder_ids = {
        label: [list(e.input_ids) for e in encoder.encode_ids([(instruction, t) for t in texts])]
        for label, instruction in instruction_of.items()
    }
    reference = {}
    if verify_embeddings:  # the plain prompt, one with an instruction, one ad-hoc (token ids are checked for all)
        encoder.to(device)
        one_by_one = dict(batch_size=1, show_progress_bar=False, convert_to_tensor=True, normalize_embeddings=normalize)
        for label in [DOCUMENT_PROMPT, *[n for n in given][:1], *list(adhoc)[:1]]:
            items = [[instruction_of[label], t] for t in texts]
            reference[label] = encoder.encode(items, device=device, **one_by_one).cpu()

    card = render_model_card(
        ModelCardInputs.for_export(
            base_model_name_or_path,
            peft_model_name_or_path,
            encoder=encoder,
            prompts=named,
            normalize=normalize,
            dtype=save_dtype,
            adhoc_prompts=layout == CHAT_LAYOUT,
            text_marker=TEXT_MARKER,
            mteb_results=mteb_results,
            mteb_table=mteb_category_table(mteb_results, mteb_tasks_file) if mteb_results else "",
            output_dir=output_dir,
            query_source=query.source,
        )
    )
    with claim_export_folder(output_dir, overwrite, read) as tmp:
        body.to("cpu").save_pretrained(tmp, safe_serialization=True)
        processor_kwargs = write_tokenizer(tokenizer, tmp)
        llm2vec_settings = {**encoder.llm2vec_config(), "prompts": named}
        hidden = body.config.hidden_size
        del encoder, body
        gc.collect()
        _write_st_files(tmp, prompts, hidden, llm2vec_settings, normalize, processor_kwargs, layout)
        (tmp / "README.md").write_text(card, encoding="utf-8")
        for path in tmp.rglob("*"):  # some writers leave files private (0600); the folder is meant to be shared
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            report = verify_export(tmp, encoder_ids, reference, texts, normalize, device, adhoc)
        except ExportError as e:
            if template_name == templates.DERIVED_TEMPLATE or not has_chat_template:
                raise
            raise ExportError(
                f"{e}; the template derived from the model's own chat template may export exactly: pass "
                f"--template {templates.DERIVED_TEMPLATE} (template={templates.DERIVED_TEMPLATE!r} in Python)"
            ) from None
        verify_llm2vec_loading(tmp, llm2vec_settings, encoder_ids, instruction_of, texts)
    report.update(
        output_dir=str(output_dir),
        layout=layout,
        processor_kwargs=processor_kwargs,
        prompts=list(prompts),
        query_instruction=query.instruction,
        query_instruction_source=query.source,
        dtype=str(save_dtype).replace("torch.", ""),
        pooling=ST_POOLING[llm2vec_settings["pooling_mode"]],
        max_seq_length=llm2vec_settings["max_length"],
    )
    return report


def exportable_encoder(
    base_model_name_or_path: str, peft_model_name_or_path, layout: str, dtype, **settings
) -> LLM2Vec:
    """``LLM2Vec.load`` of the source in eval mode, the adapter merged (``settings``: pooling_mode, max_length,
    template, trust_remote_code, accept_other_base), its parameters in ``dtype`` (its buffers, such as RoPE's
    inv_freq, in float32, as ``from_pretrained(dtype=...)`` leaves them); :class:`ExportError` for what
    sentence-transformers cannot express exactly in ``layout``."""
    encoder = LLM2Vec.load(
        base_model_name_or_path, peft_model_name_or_path, merge_peft=True, dtype=torch.float32, **settings
    )
    check_exportable(encoder)
    if layout == CHAT_LAYOUT and encoder.pooling_mode != "eos_token":
        raise ExportError(
            f"pooling_mode {encoder.pooling_mode!r}: sentence-transformers' chat path, which maps an ad-hoc prompt= "
            "onto the template, cannot leave the prompt out of the mean; export with named_prompts_only "
            "(--named_prompts_only), where only the exported prompts embed exactly"
        )
    for parameter in decoder_body(encoder.model).parameters():
        parameter.data = parameter.data.to(dtype)
    return encoder.eval()


def exported_tokenizer(encoder: LLM2Vec, prompts: Mapping[str, ExportedPrompt], layout: str):
    """:func:`export_tokenizer` of ``encoder`` for ``prompts``, with the fitted chat template in the chat layout."""
    suffix_ids = next(iter(prompts.values())).suffix_ids
    chat_template = export_chat_template(encoder.template) if layout == CHAT_LAYOUT else None
    pad = pad_token(encoder.tokenizer, encoder.template)
    tokenizer = export_tokenizer(encoder.tokenizer, suffix_ids, encoder.max_length, chat_template, pad)
    if layout == CHAT_LAYOUT:
        tokenizer.chat_template = fitting_chat_template(encoder.template, tokenizer)
    return tokenizer


def pooling_config(pooling_mode: str, hidden: int) -> dict[str, Any]:
    """sentence-transformers' ``Pooling`` arguments (and ``1_Pooling/config.json``) of an exportable pooling mode."""
    # mean pooling leaves the prompt out
    return {
        "embedding_dimension": hidden,
        "pooling_mode": ST_POOLING[pooling_mode],
        "include_prompt": pooling_mode == "eos_token",
    }


def _write_st_files(folder: Path, prompts, hidden: int, settings, normalize: bool, processor_kwargs, layout) -> None:
    """sentence-transformers' own configuration files (the layout ``SentenceTransformer.save`` writes)."""
    import sentence_transformers
    import transformers

    modules = [
        ("", "base.modules.transformer.Transformer"),
        ("1_Pooling", "sentence_transformer.modules.pooling.Pooling"),
    ]
    modules += [("2_Normalize", "base.modules.normalize.Normalize")] if normalize else []
    versions = (sentence_transformers.__version__, transformers.__version__, torch.__version__)
    files = {
        "modules.json": [
            {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.{kind}"}
            for i, (path, kind) in enumerate(modules)
        ],
        "sentence_bert_config.json": {
            **(ST_CHAT_TRANSFORMER_CONFIG if layout == CHAT_LAYOUT else ST_TRANSFORMER_CONFIG),
            **({"processor_kwargs": dict(processor_kwargs)} if processor_kwargs else {}),
        },
        "1_Pooling/config.json": pooling_config(settings["pooling_mode"], hidden),
        "config_sentence_transformers.json": {
            "__version__": dict(zip(("sentence_transformers", "transformers", "pytorch"), versions)),
            "model_type": "SentenceTransformer",
            "prompts": {name: p.text for name, p in prompts.items()},
            "default_prompt_name": DOCUMENT_PROMPT,
            "similarity_fn_name": "cosine",
        },
        CONFIG_NAME: dict(settings),
    }
    if normalize:
        files["2_Normalize/config.json"] = dict.fromkeys(
            ("module_input_name", "module_output_name"), "sentence_embedding"
        )
    for name, content in files.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
