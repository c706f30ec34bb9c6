"""Stage II through sentence-transformers: this project's model, data and run folder, ST's trainer and losses.

``trainer: sentence_transformers`` in a Stage II config (:func:`llm2vec.training.train` dispatches here); the
steps (model, data, loss, run) are in docs/design.md. Refused in one line: resuming, ``validation_file`` /
``validation_size``, ``embedding_token_budget`` and ``use_packing: true``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .arguments import ConfigError, RunConfig

logger = logging.getLogger("llm2vec")

DEFAULT_LOSS = "CachedMultipleNegativesRankingLoss"
TRAINABLE_LOSSES = (
    "MultipleNegativesRankingLoss",
    "CachedMultipleNegativesRankingLoss",
    "MultipleNegativesSymmetricRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
    "GISTEmbedLoss",
    "CachedGISTEmbedLoss",
)
"""The losses this path trains: in-batch negatives over (query, positive[, negative]) rows without labels."""
WRAPPING_LOSSES = ("MatryoshkaLoss",)
"""Losses that modify another loss: ``loss_kwargs["loss"]`` names it, ``loss_kwargs["loss_kwargs"]`` its arguments."""
GUIDED_LOSSES = ("GISTEmbedLoss", "CachedGISTEmbedLoss")
SIMILARITIES = ("cos_sim", "dot_score", "euclidean_sim", "manhattan_sim")
"""The ``similarity_fct`` names of ``sentence_transformers.util`` a loss may take (JSON holds no functions)."""


# ---------------------------------------------------------------------------------------------- the losses


def loss_names() -> list[str]:
    """The loss classes of ``sentence_transformers.sentence_transformer.losses``, by name."""
    from sentence_transformers.sentence_transformer import losses

    names = getattr(losses, "__all__", None) or dir(losses)
    return sorted(
        n
        for n in names
        if isinstance(getattr(losses, n, None), type)
        and issubclass(getattr(losses, n), torch.nn.Module)
        and n.endswith("Loss")
    )


def check_loss_name(name: str, field_name: str = "loss", wrapped: bool = False) -> None:
    """``name`` is a sentence-transformers loss this path trains; else one :class:`ConfigError` line naming them."""
    choices = TRAINABLE_LOSSES if wrapped else (*TRAINABLE_LOSSES, *WRAPPING_LOSSES)
    if name not in choices:
        what = "a loss this path trains" if name in loss_names() else "a sentence-transformers loss"
        raise ConfigError(
            f"{field_name}={name!r}: not {what} (its rows are query, positive[, negative], without labels); choose "
            f"one of {', '.join(choices)}"
        )


def _check_value(loss: str, key: str, value: Any, default: Any) -> None:
    """A ``loss_kwargs`` value of the type its default (or name) implies; else one :class:`ConfigError` line."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    number = (whole or isinstance(value, float)) and math.isfinite(value)
    if key.startswith("mini_batch") or key == "n_dims_per_step":
        ok = (whole and value >= 1) or (value is None and default is None) or (value == -1 == default)
        want = "a whole number of at least 1" + (" (or null)" if default is None else "")
    elif key == "matryoshka_dims":
        ok = isinstance(value, list) and bool(value) and all(isinstance(d, int) and d >= 1 for d in value)
        want = "a list of whole numbers of at least 1"
    elif callable(default):
        ok, want = value in SIMILARITIES, f"one of {', '.join(SIMILARITIES)}"
    elif isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, (int, float)):
        ok = number and (value > 0 or key not in ("scale", "temperature"))
        want = "a positive number" if key in ("scale", "temperature") else "a finite number"
    else:
        return
    if not ok:
        raise ConfigError(f"loss_kwargs.{key} of {loss}: {json.dumps(value, default=str)[:60]}; give {want}")


def check_loss_arguments(name: str, kwargs: Mapping[str, Any], wrapped: bool = False) -> None:
    """``name`` and its ``loss_kwargs`` (a wrapper's inner loss and arguments too) as this path trains them, before any
    model loads; one :class:`ConfigError` line naming the field and what to give."""
    from sentence_transformers.sentence_transformer import losses

    check_loss_name(name, "loss_kwargs.loss" if wrapped else "loss", wrapped)
    params = inspect.signature(getattr(losses, name).__init__).parameters
    accepted = [p for p in params if p not in ("self", "model")]
    extra = ("loss_kwargs",) if name in WRAPPING_LOSSES else ()
    unknown = [k for k in kwargs if (k not in params and k not in extra) or k == "model"]
    if unknown:
        raise ConfigError(
            f"loss_kwargs: {name} takes no argument {', '.join(map(repr, unknown))}; its arguments: {', '.join(accepted)}"
        )
    for key, value in kwargs.items():
        if key in params and key not in ("loss", "guide"):
            _check_value(name, key, value, params[key].default)
    if name in WRAPPING_LOSSES:
        inner, inner_kwargs = kwargs.get("loss", DEFAULT_LOSS), kwargs.get("loss_kwargs") or {}
        if not isinstance(inner, str) or not isinstance(inner_kwargs, Mapping):
            raise ConfigError(f"loss_kwargs of {name}: loss is the name of the loss it wraps, loss_kwargs an object")
        check_loss_arguments(inner, inner_kwargs, wrapped=True)
    elif "loss_kwargs" in kwargs:
        raise ConfigError(f"loss_kwargs: {name} wraps no other loss, so it takes no loss_kwargs of its own")
    guide = kwargs.get("guide")
    if guide is not None and not isinstance(guide, str):
        raise ConfigError(f"loss_kwargs.guide of {name}: give a model folder or a cached hub id")


def model_paths(kwargs: Mapping[str, Any], prefix: str = "loss_kwargs") -> Iterator[tuple[str, str]]:
    """``(field, value)`` of every text in ``kwargs`` (at any depth) that names a model: a guide, a
    ``*name_or_path`` argument, or any existing folder."""
    for key, value in kwargs.items():
        if isinstance(value, Mapping):
            yield from model_paths(value, f"{prefix}.{key}")
        elif isinstance(value, str) and (key == "guide" or key.endswith("name_or_path") or os.path.isdir(value)):
            yield f"{prefix}.{key}", value


def check_model_paths(config: RunConfig) -> None:
    """Each model ``loss_kwargs`` names (:func:`model_paths`) is a folder here or a model in the local hub cache, not
    ``output_dir``'s, not in use, and runs no code of its own without ``trust_remote_code``; one line each."""
    from .fingerprints import model_folder
    from .model_files import ModelFilesError, check_exists, check_not_in_use, check_remote_code

    out = Path(config.training.output_dir).expanduser().resolve()
    for field_name, path in model_paths(config.stage.loss_kwargs or {}):
        if os.path.isfile(path):
            raise ConfigError(f"{field_name} {path}: a file; give a model folder (or a cached hub id)")
        try:
            check_exists(path, field_name)
            folder = model_folder(path)
            if folder is None:
                raise ModelFilesError(
                    f"{field_name} {path}: not a folder here, nor a model in the local hub cache; run `hf download "
                    f"{path}` first, or give a folder"
                )
            check_not_in_use(path, field_name)
            check_remote_code(path, config.model.trust_remote_code, field_name)
        except ModelFilesError as e:
            raise ConfigError(str(e)) from None
        read = folder.resolve()
        if read == out or read in out.parents or out in read.parents:
            raise ConfigError(f"{field_name} {path} and output_dir {out} overlap: a run never writes where it reads")


def build_loss(name: str, kwargs: Mapping[str, Any], model, loss_scale: float = 20.0, guide_loader=None):
    """The loss ``name`` of ``sentence_transformers.sentence_transformer.losses`` on ``model`` (module docstring),
    after :func:`check_loss_arguments`. ``guide_loader(path, max_length)`` loads a GIST guide given as a folder
    (default: :func:`sentence_transformer` without LoRA, at the model's length); a ``SentenceTransformer`` guide is
    used as it is."""
    from sentence_transformers import util
    from sentence_transformers.sentence_transformer import losses

    check_loss_arguments(name, {k: v for k, v in (kwargs or {}).items() if k != "guide" or isinstance(v, str)})
    cls, kwargs = getattr(losses, name), dict(kwargs or {})
    params = inspect.signature(cls.__init__).parameters
    if isinstance(kwargs.get("similarity_fct"), str):
        kwargs["similarity_fct"] = getattr(util, kwargs["similarity_fct"])
    if name in WRAPPING_LOSSES:
        inner, inner_kwargs = kwargs.pop("loss", DEFAULT_LOSS), kwargs.pop("loss_kwargs", {})
        kwargs["loss"] = build_loss(inner, inner_kwargs, model, loss_scale, guide_loader)
    if "scale" in params and "scale" not in kwargs:
        kwargs["scale"] = loss_scale
    if name in GUIDED_LOSSES:
        if "temperature" not in kwargs:
            kwargs["temperature"] = 1.0 / loss_scale
        guide = kwargs.get("guide")
        if guide is None:
            kwargs["guide"] = model  # self-guided: the model being trained, without gradient, picks the negatives
        elif isinstance(guide, (str, os.PathLike)):
            kwargs["guide"] = (guide_loader or _load_guide)(str(guide), model.max_seq_length)
    try:
        return cls(model, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"loss_kwargs of {name}: {str(e).splitlines()[0]}") from None


def _load_guide(path: str, max_length: int | None = None):
    from sentence_transformers import SentenceTransformer

    if (Path(path) / "modules.json").exists():  # a sentence-transformers folder (an export)
        return SentenceTransformer(path, device="cpu", local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="llm2vec-st-guide-") as work:  # loaded, the export is not read again
        return sentence_transformer(path, Path(work) / "guide", max_length=max_length)


# ---------------------------------------------------------------------------------------------- the model


def sentence_transformer(
    base_model_name_or_path: str,
    work_dir: str | os.PathLike,
    peft_model_name_or_path: str | None = None,
    *,
    lora=None,
    max_length: int | None = None,
    template: str | None = None,
    instruction_separator: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    trust_remote_code: bool = False,
    accept_other_base: bool = False,
    seed: int | None = None,
):
    """This project's model as a ``SentenceTransformer`` (module docstring, point 1), written to ``work_dir``
    (a new or empty folder) by the export and loaded from there; with ``lora`` (a ``peft.LoraConfig``) the decoder
    body gets trainable LoRA adapters (seeded with ``seed`` when given), everything else frozen.
    ``instruction_separator`` rebuilds the chat template with that separator (the training one)."""
    from sentence_transformers import SentenceTransformer

    from .export import export_sentence_transformers

    if os.path.isdir(work_dir) and os.listdir(work_dir):  # the export would refuse it naming its --overwrite
        raise ValueError(
            f"work_dir {work_dir} is not empty; give a new or empty folder (a tempfile.TemporaryDirectory)"
        )
    export_sentence_transformers(
        base_model_name_or_path,
        work_dir,
        peft_model_name_or_path,
        query_instruction="",  # the prompts are not used here: the training data carries the instructions
        max_length=max_length,
        template=template,
        normalize=False,  # the raw anchor state, as LLM2Vec.embed (a loss normalises where it needs to)
        dtype=dtype,
        device="cpu",
        trust_remote_code=trust_remote_code,
        accept_other_base=accept_other_base,
    )
    model = SentenceTransformer(str(work_dir), device=device, local_files_only=True, trust_remote_code=False)
    model.default_prompt_name = None
    model.prompts = {}
    _spec_of(model, "")  # the template read while the folder is there
    if instruction_separator is not None:
        set_separator(model, instruction_separator)
    if lora is not None:
        from .llm2vec_contrastive import add_lora

        if seed is not None:
            import transformers

            transformers.set_seed(seed)
        model[0].model = add_lora(model[0].model, lora)
    return model


def _spec_of(model, separator: str):
    """The model's template with ``separator``; read from its folder once (the folder may be gone later)."""
    from transformers import AutoConfig

    from . import templates
    from .llm2vec import read_llm2vec_config

    if not hasattr(model, "_llm2vec_template"):
        folder = str(model[0].model.name_or_path)
        name = read_llm2vec_config(folder)["template"]
        model._llm2vec_template = templates.named_template(name, AutoConfig.from_pretrained(folder), model.tokenizer)
    return model._llm2vec_template.with_separator(separator)


def set_separator(model, separator: str) -> None:
    """Rebuild the export's chat template of ``model`` with ``separator`` between instruction and text."""
    from .export.tokenizer import fitting_chat_template

    model.tokenizer.chat_template = fitting_chat_template(_spec_of(model, separator), model.tokenizer)


@contextlib.contextmanager
def separator(model, value: str) -> Iterator[None]:
    """``model``'s chat template joins instruction and text with ``value`` inside the block."""
    before = model.tokenizer.chat_template
    set_separator(model, value)
    try:
        yield
    finally:
        model.tokenizer.chat_template = before


def lora_config(stage):
    """The LoRA of :meth:`LLM2VecContrastive.build` from a Stage II config's fields."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        r=stage.lora_r,
        lora_alpha=stage.lora_alpha,
        lora_dropout=stage.lora_dropout,
        target_modules=list(stage.lora_target_modules),
        bias="none",
        task_type=TaskType.FEATURE_EXTRACTION,
    )


# ---------------------------------------------------------------------------------------------- the data


def query_message(instruction: str, query: str) -> list[dict[str, str]]:
    """A query as the conversation the export's chat template renders as ``LLM2Vec.encode([instruction, query])``."""
    turn = [{"role": "user", "content": query}]
    return [{"role": "system", "content": instruction}, *turn] if instruction else turn


def st_dataset(examples: Sequence, with_negative: bool, query_instructions: bool = True):
    """``datasets.Dataset`` of (query conversation, positive[, negative]) in the order of ``examples``."""
    import datasets

    columns: dict[str, list] = {
        "query": [query_message(e.query_instruction if query_instructions else "", e.query) for e in examples],
        "positive": [e.positive for e in examples],
    }
    if with_negative:
        columns["negative"] = [e.negative for e in examples]
    return datasets.Dataset.from_dict(columns)


def retrieval_evaluators(data, batch_size: int):
    """The evaluator of the folders of ``retrieval_eval_dirs`` (:func:`_retrieval_evaluator_class`:
    sentence-transformers' ``InformationRetrievalEvaluator`` per folder, queries with the folder's instruction as prompt, documents bare,
    cosine, logged under the project trainer's names), or ``None`` when there are none."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    from sentence_transformers.util import cos_sim

    from .beir import read_beir_folder

    out = []
    for folder, instruction in data.retrieval_folders():
        beir = read_beir_folder(folder, queries_without_relevant="refuse")
        out.append(
            InformationRetrievalEvaluator(
                queries=dict(beir.queries),
                corpus={d: beir.document_text(d) for d in beir.corpus},
                relevant_docs={q: {d for d, g in docs.items() if g > 0} for q, docs in beir.relevant.items()},
                name=beir.name,
                query_prompt=instruction or None,
                batch_size=batch_size,
                show_progress_bar=False,
                ndcg_at_k=[10],
                mrr_at_k=[10],
                accuracy_at_k=[10],
                precision_recall_at_k=[100],
                map_at_k=[10],
                score_functions={"cosine": cos_sim},
            )
        )
    return _retrieval_evaluator_class()(out) if out else None


ST_METRIC = {"ndcg_at_10": "cosine_ndcg@10", "mrr_at_10": "cosine_mrr@10", "recall_at_100": "cosine_recall@100"}
"""sentence-transformers' name (after the folder's) of each metric the project's trainer logs per folder."""


def _retrieval_evaluator_class():
    """The class of :func:`retrieval_evaluators`' evaluator (defined on first use: sentence-transformers is an extra):
    it runs each folder's ``InformationRetrievalEvaluator`` and returns the scores under the names the project's
    trainer logs (:class:`llm2vec.retrieval.RetrievalEvaluation`): ``<folder>_ndcg_at_10``, ``<folder>_mrr_at_10``,
    ``<folder>_recall_at_100`` and their means over the folders, ``beir_mean_<metric>``; so both Stage II trainers
    log ``eval_<folder>_ndcg_at_10``."""
    from sentence_transformers.base.evaluation import BaseEvaluator

    from .retrieval import LOGGED, MEAN

    class RetrievalFoldersEvaluator(BaseEvaluator):
        def __init__(self, evaluators):
            super().__init__()
            self.evaluators = list(evaluators)
            self.primary_metric = f"{MEAN}_ndcg_at_10"

        def __call__(self, model, output_path=None, epoch=-1, steps=-1) -> dict[str, float]:
            scores = {}
            for evaluator in self.evaluators:
                metrics = evaluator(model, output_path, epoch, steps)
                scores[evaluator.name] = {m: float(metrics[f"{evaluator.name}_{ST_METRIC[m]}"]) for m in LOGGED}
            out = {f"{name}_{m}": values[m] for name, values in scores.items() for m in LOGGED}
            out.update({f"{MEAN}_{m}": sum(v[m] for v in scores.values()) / len(scores) for m in LOGGED})
            return out

    return RetrievalFoldersEvaluator


# ---------------------------------------------------------------------------------------------- the trainer


def st_training_arguments(args):
    """transformers' ``TrainingArguments`` of a run config as ``SentenceTransformerTrainingArguments``."""
    import dataclasses

    from sentence_transformers import SentenceTransformerTrainingArguments

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and hasattr(args, f.name)}
    known = {f.name for f in dataclasses.fields(SentenceTransformerTrainingArguments)}
    return SentenceTransformerTrainingArguments(**{k: v for k, v in values.items() if k in known})


def _trainer_class():
    from sentence_transformers import SentenceTransformerTrainer

    class AnchorSentenceTransformerTrainer(SentenceTransformerTrainer):
        """``SentenceTransformerTrainer`` reading the project's batches in order and saving a Stage II run's files."""

        def __init__(self, *a, run_config=None, encoder=None, evaluation_separator=None, **kw):
            super().__init__(*a, **kw)
            self.run_config = run_config or {}
            self.encoder = encoder  # LLM2Vec over the same (LoRA) modules: the project's save
            self.evaluation_separator = evaluation_separator

        def get_batch_sampler(self, dataset, batch_size, drop_last, valid_label_columns=None, generator=None, seed=0):
            from torch.utils.data import BatchSampler, SequentialSampler

            return BatchSampler(SequentialSampler(range(len(dataset))), batch_size, drop_last)

        def evaluate(self, *a, **kw):
            if self.evaluation_separator is None:
                return super().evaluate(*a, **kw)
            with separator(self.model, self.evaluation_separator):
                return super().evaluate(*a, **kw)

        def check_weights_finite(self, what: str) -> None:
            from .trainer import TrainingDiverged

            if not all(torch.isfinite(p).all() for p in self.model.parameters() if p.requires_grad):
                raise TrainingDiverged(
                    f"the LoRA weights hold NaN or infinite values at step {self.state.global_step}; {what}"
                )

        def _save_checkpoint(self, model, trial) -> None:  # staged and listed, as the project trainer's
            from .run import staged_checkpoint

            run_dir = self.args.output_dir
            with staged_checkpoint(self, run_dir) as staging:
                self.args.output_dir = str(staging)
                try:
                    super()._save_checkpoint(model, trial)
                finally:
                    self.args.output_dir = run_dir

        def _save(self, output_dir=None, state_dict=None):
            from .model_card import write_training_card
            from .trainer import RUN_CONFIG_NAME

            output_dir = output_dir if output_dir is not None else self.args.output_dir
            if not self.args.should_save:
                return
            self.encoder.save(output_dir)
            config_file = Path(output_dir) / "adapter_config.json"
            adapter = json.loads(config_file.read_text())
            adapter["base_model_name_or_path"] = self.run_config.get("model_name_or_path", "")
            config_file.write_text(json.dumps(adapter, indent=2) + "\n")
            with open(os.path.join(output_dir, RUN_CONFIG_NAME), "w") as f:
                json.dump(self.run_config, f, indent=2)
            write_training_card(
                output_dir, self.run_config, self.state.log_history, self.encoder, self.state.global_step
            )

    return AnchorSentenceTransformerTrainer


NO_RESUME = "the trainer sentence_transformers path does not resume: pass --overwrite_output_dir true to start anew"
"""The one way out of a run folder this path cannot continue: the Ctrl-C message, the refusals, a finished run."""


def check_config(config: RunConfig) -> str | None:
    """What this path does not do, refused in one line naming the field; its run folder as this path reads it:
    ``None`` to go on, the "nothing to do" line of a finished run of the same training length, or a refusal naming
    :data:`NO_RESUME` for any other run there (a live run's folder is left to :class:`llm2vec.run.RunManager`)."""
    stage, data, args = config.stage, config.data, config.training
    where = f"{config.source}: " if config.source else ""
    refused = {
        "embedding_token_budget": (stage.embedding_token_budget, "the cached losses' loss_kwargs.mini_batch_size"),
        "validation_file": (data.validation_file, "retrieval_eval_dirs (an InformationRetrievalEvaluator)"),
        "validation_size": (data.validation_size, "retrieval_eval_dirs (an InformationRetrievalEvaluator)"),
    }
    resume = args.resume_from_checkpoint
    if resume not in (None, False, "", "false", "False"):
        raise ConfigError(f"{where}resume_from_checkpoint {resume}: {NO_RESUME}")
    if not config.stage.loss:
        raise ConfigError(f"{where}loss is empty: name a sentence-transformers loss, e.g. {DEFAULT_LOSS}")
    check_model_paths(config)  # before the loss's own checks: a folder that would run code is named as such
    check_loss_arguments(config.stage.loss, config.stage.loss_kwargs or {})
    for name, (value, instead) in refused.items():
        if value:
            raise ConfigError(
                f"{where}{name}: not on the trainer sentence_transformers path; drop it and use {instead}"
            )
    if str(config.model.use_packing).lower() == "true":
        raise ConfigError(
            f"{where}use_packing true: not on the trainer sentence_transformers path; set it to auto or false"
        )
    from .run import without_resume

    return without_resume(config, NO_RESUME)


def build_trainer(config: RunConfig, dataset, run_config: dict, callbacks: list, tokenizer, template):
    """The trainer of a Stage II run through sentence-transformers (module docstring), for
    :func:`llm2vec.training.train`, which runs it in the run's folder as it runs the project's trainer. The model is
    written to a temporary folder that lives as long as the trainer."""
    from .llm2vec import LLM2Vec

    args, stage = config.training, config.stage
    with tempfile.TemporaryDirectory(prefix="llm2vec-st-") as work:  # loaded, the export is not read again
        model = sentence_transformer(
            config.model.model_name_or_path,
            Path(work) / "model",
            stage.peft_model_name_or_path,
            lora=lora_config(stage),
            max_length=config.model.max_seq_length,
            template=config.model.template,
            instruction_separator=config.data.instruction_separator if config.data.query_instructions else None,
            dtype=config.dtype,
            trust_remote_code=config.model.trust_remote_code,
            accept_other_base=stage.accept_other_base,
            seed=args.seed,
        )
        settings = json.loads((Path(work) / "model" / "llm2vec_config.json").read_text())
    for peft_config in model[0].model.peft_config.values():  # not the removed copy (peft reads its config on save)
        peft_config.base_model_name_or_path = config.model.model_name_or_path
    settings.pop("prompts", None)
    encoder = LLM2Vec(model[0].model, tokenizer, **settings)  # the same modules: the project's save
    loss = build_loss(stage.loss, stage.loss_kwargs or {}, model, stage.loss_scale)
    st_args = st_training_arguments(args)
    evaluator = retrieval_evaluators(config.data, args.per_device_eval_batch_size)
    trainer = _trainer_class()(
        model=model,
        args=st_args,
        train_dataset=st_dataset(dataset.examples, stage.require_negative, config.data.query_instructions),
        loss=loss,
        evaluator=evaluator,
        callbacks=callbacks,
        run_config=run_config,
        encoder=encoder,
        evaluation_separator=template.separator if config.data.query_instructions else None,
    )
    logger.info("Stage II: %s, %s", config.model.model_name_or_path, describe(model, loss))
    return trainer


def describe(model, loss) -> str:
    trainable, total = model[0].model.get_nb_trainable_parameters()
    config = next(iter(model[0].model.peft_config.values()))
    return (
        f"sentence-transformers {type(loss).__name__}; LoRA r {config.r} / alpha {config.lora_alpha} / dropout "
        f"{config.lora_dropout} on {','.join(sorted(config.target_modules))}; trainable parameters {trainable} of "
        f"{total}"
    )
