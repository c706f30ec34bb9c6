"""A model card as Markdown (:func:`render_model_card`), naming no machine path, and its writing into a save."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..retrieval import LOGGED, MEAN, split_log_key
from .history import ModelCardInputs, loss_curve

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"

STAGE_TITLES = {
    "I": "Stage I: bidirectional reconstruction (EBQ2D + EBD2Q), full-parameter",
    "II": "Stage II: contrastive fine-tuning (InfoNCE, LoRA)",
}
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/(?:[^\s/'\"`,;()\[\]<>|*]+/)*[^\s/'\"`,;()\[\]<>|*]+")


def shown_path(path: str) -> str:
    """``path`` as a card shows it: an absolute path by its last two parts (``.../stage_I/checkpoint-2``)."""
    if not os.path.isabs(path):
        return path
    parts = Path(path).parts[1:]
    return ".../" + "/".join(parts[-2:]) if parts else path


def without_machine_paths(text: str) -> str:
    """``text`` with every absolute path replaced by :func:`shown_path`'s form."""
    return _ABSOLUTE_PATH.sub(lambda m: shown_path(m.group(0)), text)


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-3 and value != 0 else f"{value:.4f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], text_columns: int = 0) -> list[str]:
    """A Markdown table: the first ``text_columns`` columns as they are, the others numbers, right-aligned."""
    shown = [[str(v) if i < text_columns else _fmt(v) for i, v in enumerate(row)] for row in rows]
    align = "|" + "---|" * text_columns + "---:|" * (len(header) - text_columns)
    return ["| " + " | ".join(header) + " |", align, *("| " + " | ".join(row) + " |" for row in shown)]


def render_loss_curve(log_history: Sequence[Mapping[str, Any]]) -> list[str]:
    curve = loss_curve(log_history)
    if curve is None:
        return ["No training loss was logged."]
    return [
        f"{curve['n']} logged points; lowest loss {_fmt(curve['min'][1])} at step {curve['min'][0]}, "
        f"last {_fmt(curve['last'][1])} at step {curve['last'][0]}"
        + (f"; mean training loss {_fmt(curve['train_loss'])}." if curve["train_loss"] is not None else "."),
        "",
        *_table(curve["columns"], [[row[c] for c in curve["columns"]] for row in curve["rows"]]),
    ]


def render_validation_curve(log_history: Sequence[Mapping[str, Any]]) -> list[str]:
    """One row per evaluation of the held-out pairs (``eval_*`` but the diagnostics); empty without any."""
    skip = {"eval_pairs", "eval_queries", "eval_documents", "eval_runtime"}

    def shown(key: str) -> bool:
        diagnostic = key.startswith("eval_geometry_") or "per_second" in key
        return key.startswith("eval_") and key not in skip and not diagnostic and not split_log_key(key)

    evals = [e for e in log_history if "step" in e and any(shown(k) for k in e)]
    columns = sorted({k for e in evals for k in e if shown(k)})
    if not evals or not columns:
        return []
    return [
        "Validation (held-out pairs, every `eval_steps`):",
        "",
        *_table(
            ["step", *(c.removeprefix("eval_") for c in columns)], [[e["step"], *map(e.get, columns)] for e in evals]
        ),
        "",
    ]


def render_retrieval_scores(log_history: Sequence[Mapping[str, Any]]) -> list[str]:
    """The retrieval folders' mean scores at every evaluation, and each folder's at the last; empty without any."""
    evals = [e for e in log_history if "step" in e and any(k.startswith(f"eval_{MEAN}_") for k in e)]
    if not evals:
        return []
    last = evals[-1]
    folders = list(dict.fromkeys(p[0] for k in last if (p := split_log_key(k)) and p[0] != MEAN))
    return [
        f"Retrieval on the BEIR folders (`retrieval_eval_dirs`), mean over {len(folders)} folder(s) at every evaluation:",
        "",
        *_table(["step", *LOGGED], [[e["step"], *(e.get(f"eval_{MEAN}_{m}") for m in LOGGED)] for e in evals]),
        "",
        f"Each folder at step {last['step']}:",
        "",
        *_table(["folder", *LOGGED], [[f, *(last.get(f"eval_{f}_{m}") for m in LOGGED)] for f in folders], 1),
        "",
    ]


def _stage_settings(config: Mapping[str, Any]) -> list[str]:
    get = config.get
    sizes = per_device, world, accumulation = [
        get(k) for k in ("per_device_train_batch_size", "world_size", "gradient_accumulation_steps")
    ]
    batch = per_device * world * accumulation if all(isinstance(x, int) for x in sizes) else None
    length = f"{get('max_steps')} steps" if (get("max_steps") or -1) > 0 else f"{get('num_train_epochs')} epochs"
    lines = [
        f"- base: `{get('model_name_or_path')}`"
        + (f" + adapter `{get('peft_model_name_or_path')}` (merged)" if get("peft_model_name_or_path") else ""),
        f"- length: {length}; global batch {batch if batch else '–'} ({per_device} per device x {world} "
        f"process(es) x {accumulation} accumulation); learning rate {get('learning_rate')}, "
        f"{get('lr_scheduler_type')} schedule, warm-up {get('warmup_steps')} steps; seed {get('seed')}",
        f"- precision: {'bf16' if get('bf16') else 'fp16' if get('fp16') else 'fp32'} "
        f"(weights {get('torch_dtype')}); pooling {get('pooling_mode')}, max length {get('max_seq_length')}",
    ]
    if get("stage") == "I":
        lines.append(
            f"- loss: alpha = {get('alpha')} (L = alpha L_Q2D + (1 - alpha) L_D2Q), "
            f"reconstruction targets {get('reconstruction_targets')}"
        )
    elif get("stage") == "II":
        scale = get("loss_scale")
        tau = f"{1 / scale:.3g}" if isinstance(scale, (int, float)) and scale else "–"
        lines.append(
            f"- loss: InfoNCE, scale {get('loss_scale')} (tau = {tau}); LoRA r "
            f"{get('lora_r')}, alpha {get('lora_alpha')}, dropout {get('lora_dropout')} on "
            f"{', '.join(get('lora_target_modules') or [])}; hard negatives: {get('require_negative')}"
        )
        if get("embedding_token_budget"):
            lines.append(
                f"- gradient cache: the per-device batch embedded in chunks of at most "
                f"{get('embedding_token_budget')} tokens, padded or, with packing, real (the same gradient as one graph)"
            )
    sources = get("e5_sources")
    lines.append(
        f"- training data: {get('dataset_name')} from `{get('dataset_file_path')}`"
        + (f", sources {', '.join(sources)}" if sources else ", all sources")
        + (f", at most {get('max_examples_per_source')} examples per source" if get("max_examples_per_source") else "")
    )
    for entry in get("resumed_with_changes") or []:  # what a resume changed, and from which step (run_config.json)
        if isinstance(entry, Mapping) and entry.get("changes"):
            lines.append(
                f"- resumed from `{entry.get('checkpoint')}` with changes that hold from step "
                f"{entry.get('from_step', '?')} (the steps before were trained without them): "
                + "; ".join(map(str, entry["changes"]))
            )
    if get("fsdp"):
        lines.append(f"- distribution: FSDP, fsdp_config `{json.dumps(get('fsdp_config'), sort_keys=True)}`")
    if get("deepspeed"):
        lines.append(f"- distribution: DeepSpeed, config `{json.dumps(get('deepspeed'), sort_keys=True)}`")
    return lines


# kind -> (what the card calls it, library_name, pipeline_tag, tags)
KINDS = {
    "export": (
        "a sentence-transformers export of a text embedding model",
        "sentence-transformers",
        "sentence-similarity",
        ["sentence-transformers", "sentence-similarity", "feature-extraction"],
    ),
    "model": ("a text embedding model", "transformers", "feature-extraction", ["feature-extraction"]),
    "adapter": (
        "a LoRA adapter of a text embedding model",
        "peft",
        "feature-extraction",
        ["feature-extraction", "lora"],
    ),
}


def _front_matter(inputs: ModelCardInputs) -> list[str]:
    _, library, pipeline, tags = KINDS[inputs.kind]
    lines = ["---"]
    if inputs.base_model:
        lines.append(f"base_model: {inputs.base_model}")
    lines += [f"library_name: {library}", f"pipeline_tag: {pipeline}", "tags:"]
    lines += [f"- {t}" for t in [*tags, "anchor-embedding", "llm2vec", "text-embedding"]]
    return lines + ["---"]


def _cell(text: str) -> str:
    """``text`` on one line, safe in a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _usage(inputs: ModelCardInputs) -> list[str]:
    path = Path(inputs.path).name if os.path.isabs(inputs.path) else inputs.path
    first = next((p for p in inputs.prompts if p not in ("document", "query") and not p.endswith("-document")), None)
    lines = ["## How to use it", ""]
    if inputs.kind == "export":
        if inputs.adhoc_prompts:
            how = (
                "the exported chat template puts the instruction given as a prompt into the model's prompt format "
                "and ends the input with the anchor token"
            )
            adhoc_line = [
                "# any instruction works as a prompt, and embeds as LLM2Vec.encode([[instruction, text]]) does:",
                'manual = model.encode(["list the files in a directory"], '
                'prompt="Given a one-line summary of a command, retrieve its manual page")',
            ]
            prompt_note = (
                "Each prompt is an instruction (the chat template joins it to the text with the model's separator); "
                "text pairs and conversations are refused with an error."
            )
        else:
            how = "the prompts hold the chat template and the instruction, the tokenizer appends the anchor token after truncation"
            adhoc_line = []
            prompt_note = (
                f"Each prompt ends with `{inputs.text_marker}`, where the tokenizer splits prompt from text (and drops the "
                "marker) so that both are tokenized as in training; only these prompts embed exactly, an instruction "
                "of your own passed as `prompt=` does not."
            )
        query = inputs.prompts.get("query", "")
        lines += [
            f"With sentence-transformers (no custom code; {how}):",
            "",
            "```python",
            "from sentence_transformers import SentenceTransformer",
            "",
            f'model = SentenceTransformer("{path}")',
            'queries = model.encode_query(["how do I read a file line by line?"])  # the "query" prompt',
            'documents = model.encode_document(["Open the file and iterate over it."])  # "document": none',
            "scores = model.similarity(queries, documents)",
            *(
                [f'task_queries = model.encode(["a claim to check"], prompt_name="{first}")  # a task\'s prompt']
                if first
                else []
            ),
            *adhoc_line,
            "```",
            "",
            "Prompts (name: instruction; `document`, the default, has none):",
            "",
            "| prompt | instruction |",
            "|---|---|",
            *(f"| `{name}` | {_cell(instruction) or '(none)'} |" for name, instruction in inputs.prompts.items()),
            "",
            (
                f'`encode_query` uses the `query` prompt, "{_cell(query)}"'
                + (f" ({inputs.query_source})" if inputs.query_source else "")
                + "."
                if query
                else "The `query` prompt is empty: `encode_query` embeds exactly as `encode_document`."
            )
            + f" {prompt_note}"
            + (
                " `<task>` carries that task's instruction and `<task>-document` none, so mteb's sentence-transformers "
                "path gives retrieval corpora no instruction, as this package's evaluation does."
                if first
                else ""
            ),
            "",
            "With this package (the folder holds `llm2vec_config.json`, prompts included), the same vectors:",
            "",
            "```python",
            "from llm2vec import LLM2Vec",
            "",
            f'model = LLM2Vec.from_pretrained("{path}")',
            'queries = model.encode_query(["how do I read a file line by line?"])',
            'documents = model.encode_document(["Open the file and iterate over it."])',
            "scores = model.similarity(queries, documents)",
            "```",
        ]
    else:
        adapter = inputs.kind == "adapter"
        source = f'"{shown_path(inputs.base_for_adapter or "path/to/base")}"' if adapter else f'"{path}"'
        peft = f', peft_model_name_or_path="{path}"' if adapter else ""
        if adapter:
            lines += ["This folder holds a LoRA adapter; load it on its base model with this package:", ""]
        lines += [
            "```python",
            "from llm2vec import LLM2Vec",
            "",
            f"model = LLM2Vec.from_pretrained({source}{peft})",
            'embeddings = model.encode([["an instruction", "a query"], "a document"])',
            "```",
            "",
            f"For sentence-transformers, export it{' (the adapter is merged)' if adapter else ''}:",
            "",
            "```python",
            "from llm2vec.export import export_sentence_transformers",
            "",
            f'export_sentence_transformers({source}, "{path}-st"{peft})',
            "```",
        ]
    return lines


def render_model_card(inputs: ModelCardInputs) -> str:
    """The card as Markdown (see the module docstring)."""
    emb = inputs.embedding
    title = Path(inputs.path).name or "model"
    what = KINDS[inputs.kind][0]
    lines = _front_matter(inputs) + [
        "",
        f"# {title}",
        "",
        f'This is {what}, trained with anchor-embedding, a reproduction of "Training '
        'LLMs to be Better Text Embedders through Bidirectional Reconstruction" (EMNLP '
        "2025): a text's embedding is the final hidden state at an anchor token appended "
        "to it.",
        "",
    ]
    if inputs.base_model:
        base = f"`{inputs.base_model}`"
    elif inputs.base_path:
        base = f"`{shown_path(inputs.base_path)}`, a local folder whose hub id was not recorded (`base_model_hub_id`)"
    else:
        base = "unknown"
    lines += ["## Model", "", f"- base model: {base}"]
    stages = [STAGE_TITLES.get(r.run_config.get("stage"), f"stage {r.run_config.get('stage')}") for r in inputs.history]
    lines.append(f"- stages run: {' -> '.join(stages) if stages else 'none recorded (no run_config.json found)'}")
    lines.append(
        f"- embedding: the final hidden state at the anchor token (pooling `{emb.get('pooling_mode')}`), "
        f"max length {emb.get('max_length')} tokens (template, instruction and anchor included), template "
        f"`{emb.get('template')}`"
        + (f", {emb['dimensions']} dimensions" if "dimensions" in emb else "")
        + (f", normalised: {emb['normalize']}" if "normalize" in emb else "")
        + (f", weights {emb['dtype']}" if "dtype" in emb else "")
    )
    lines.append("")
    for i, record in enumerate(inputs.history, 1):
        config = record.run_config
        stage = config.get("stage")
        where = f" (`{shown_path(record.folder)}`)" if record.folder else " (this run)"
        lines += [f"## Training, step {i}: {STAGE_TITLES.get(stage, f'stage {stage}')}{where}", ""]
        lines += _stage_settings(config)
        if record.global_step is not None:
            lines.append(f"- optimizer steps done: {record.global_step}")
        lines += ["", "Loss curve:", ""] + render_loss_curve(record.log_history) + [""]
        lines += render_validation_curve(record.log_history)
        lines += render_retrieval_scores(record.log_history)
        lines += [
            "<details><summary>Resolved run configuration (run_config.json)</summary>",
            "",
            "```json",
            json.dumps(config, indent=2, sort_keys=True),
            "```",
            "",
            "</details>",
            "",
        ]
    if inputs.mteb_table:
        lines += [
            "## MTEB",
            "",
            "Main scores x 100 from the result folders "
            + ", ".join(f"`{p}`" for p in inputs.mteb_results)
            + " (the paper's Table 1 layout; `*`: fewer tasks than the category holds).",
            "",
            inputs.mteb_table,
            "",
        ]
    lines += _usage(inputs)
    if inputs.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in inputs.notes]
    return without_machine_paths("\n".join(lines).rstrip() + "\n")


def write_training_card(
    output_dir: str | os.PathLike,
    run_config: Mapping[str, Any],
    log_history: Sequence[Mapping[str, Any]],
    encoder,
    global_step: int | None = None,
) -> None:
    """Write ``README.md`` into a checkpoint or final save; a failure is logged, never raised."""
    try:
        card = render_model_card(
            ModelCardInputs.for_training(output_dir, run_config, log_history, encoder, global_step)
        )
        Path(output_dir, CARD_NAME).write_text(card, encoding="utf-8")
    except Exception as e:  # noqa: BLE001 -- a card must never cost a checkpoint
        logger.warning("could not write the model card in %s: %s", output_dir, e)
