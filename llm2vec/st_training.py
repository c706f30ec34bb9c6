"""Stage II through sentence-transformers: this project's model, data and run folder, ST's trainer and losses.

``trainer: sentence_transformers`` in a Stage II config (:func:`llm2vec.training.train` dispatches here); the
steps (model, data, loss, run) are in docs/design.md. Refused in one line: resuming, ``validation_file`` /
``validation_size``, ``embedding_token_budget`` and ``use_packing: true``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from .arguments import ConfigError, RunConfig
from .llm2vec_contrastive import lora_config  # noqa: F401
from .st_losses import DEFAULT_LOSS, build_loss, check_loss_arguments, check_model_paths
from .st_model import sentence_transformer, separator  # noqa: F401  (the path's public names import from here)

logger = logging.getLogger("llm2vec")


def st_dataset(examples: Sequence, with_negative: bool, query_instructions: bool = True):
    """``datasets.Dataset`` of (query, positive[, negative]) in the order of ``examples``; a query is the conversation
    (instruction as system message) the export's chat template renders as ``LLM2Vec.encode([instruction, query])``."""
    import datasets

    def query(e) -> list[dict[str, str]]:
        instruction, turn = e.query_instruction if query_instructions else "", [{"role": "user", "content": e.query}]
        return [{"role": "system", "content": instruction}, *turn] if instruction else turn

    columns = {"query": [query(e) for e in examples], "positive": [e.positive for e in examples]}
    if with_negative:
        columns["negative"] = [e.negative for e in examples]
    return datasets.Dataset.from_dict(columns)


def retrieval_evaluators(retrieval, batch_size: int):
    """One ``InformationRetrievalEvaluator`` per folder of ``retrieval`` (the run's :class:`~llm2vec.retrieval.
    RetrievalEvaluation`, as read at start-up; queries with the folder's instruction as prompt, documents bare,
    cosine), run by one evaluator that returns the scores under the names it logs; ``None`` for no folder."""
    from sentence_transformers.base.evaluation import BaseEvaluator
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    from sentence_transformers.util import cos_sim

    from .retrieval import LOGGED, MEAN, logged_scores

    at_k = dict(ndcg_at_k=[10], mrr_at_k=[10], accuracy_at_k=[10], precision_recall_at_k=[100], map_at_k=[10])
    out = []
    for beir, instruction in ((f.data, f.instruction) for f in (retrieval.folders if retrieval else [])):
        corpus = {d: beir.document_text(d) for d in beir.corpus}
        relevant = {q: {d for d, g in docs.items() if g > 0} for q, docs in beir.relevant.items()}
        settings = dict(name=beir.name, query_prompt=instruction or None, batch_size=batch_size, **at_k)
        out.append(
            InformationRetrievalEvaluator(
                dict(beir.queries), corpus, relevant, score_functions={"cosine": cos_sim}, **settings
            )
        )

    class RetrievalFoldersEvaluator(BaseEvaluator):
        def __init__(self, evaluators):
            super().__init__()
            self.evaluators = list(evaluators)
            self.primary_metric = f"{MEAN}_ndcg_at_10"
            self.fresh = set()  # the output folders whose CSV files this run started

        def __call__(self, model, output_path=None, epoch=-1, steps=-1) -> dict[str, float]:
            if output_path is not None and output_path not in self.fresh:  # this path never resumes: a run's CSVs
                self.fresh.add(output_path)  # start fresh; a replaced run's are moved aside, never appended to
                for old in (Path(output_path) / e.csv_file for e in self.evaluators):
                    if old.is_file():
                        logger.warning("%s is a replaced run's: moved to %s.before-run", old, old.name)
                        os.replace(old, old.with_name(f"{old.name}.before-run"))
            scores = {}
            for evaluator in self.evaluators:
                metrics = evaluator(model, output_path, epoch, steps)
                scores[evaluator.name] = {m: float(metrics[f"{evaluator.name}_{ST_METRIC[m]}"]) for m in LOGGED}
            return logged_scores(scores)

    return RetrievalFoldersEvaluator(out) if out else None


# sentence-transformers' name (after the folder's) of each metric the project's trainer logs per folder
ST_METRIC = {"ndcg_at_10": "cosine_ndcg@10", "mrr_at_10": "cosine_mrr@10", "recall_at_100": "cosine_recall@100"}


def st_training_arguments(args):
    """transformers' ``TrainingArguments`` of a run config as ``SentenceTransformerTrainingArguments``."""
    import dataclasses

    from sentence_transformers import SentenceTransformerTrainingArguments

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init and hasattr(args, f.name)}
    known = {f.name for f in dataclasses.fields(SentenceTransformerTrainingArguments)}
    return SentenceTransformerTrainingArguments(**{k: v for k, v in values.items() if k in known})


def _trainer_class():
    from sentence_transformers import SentenceTransformerTrainer

    from .run import staged_checkpoint
    from .trainer import LLM2VecTrainer, save_run

    class AnchorSentenceTransformerTrainer(SentenceTransformerTrainer):
        """``SentenceTransformerTrainer`` reading the project's batches in order, checking and saving as the
        project's trainer does (``encoder``: the project's encoder over the same LoRA modules)."""

        check_weights_finite, _diverged = LLM2VecTrainer.check_weights_finite, LLM2VecTrainer._diverged

        def __init__(self, *a, run_config=None, encoder=None, evaluation_separator=None, **kw):
            super().__init__(*a, **kw)
            self.run_config, self.encoder, self.evaluation_separator = run_config or {}, encoder, evaluation_separator

        def get_batch_sampler(self, dataset, batch_size, drop_last, valid_label_columns=None, generator=None, seed=0):
            from torch.utils.data import BatchSampler, SequentialSampler

            return BatchSampler(SequentialSampler(range(len(dataset))), batch_size, drop_last)

        def evaluate(self, *a, **kw):
            if self.evaluation_separator is None:
                return super().evaluate(*a, **kw)
            with separator(self.model, self.evaluation_separator):
                return super().evaluate(*a, **kw)

        def _save_checkpoint(self, model, trial) -> None:
            with staged_checkpoint(self):
                super()._save_checkpoint(model, trial)

        def _save(self, output_dir=None, state_dict=None):
            save_run(self, self.encoder, output_dir)

    return AnchorSentenceTransformerTrainer


# the one way out of a run folder this path cannot continue: the Ctrl-C message, the refusals, a finished run
NO_RESUME = "the trainer sentence_transformers path does not resume: pass --overwrite_output_dir true to start anew"


def check_config(config: RunConfig) -> str | None:
    """What this path does not do, refused in one line naming the field; its run folder as this path reads it:
    ``None`` to go on, the "nothing to do" line of a finished run of the same training length, or a refusal naming
    :data:`NO_RESUME` for any other run there (a live run's folder is left to :class:`llm2vec.run.RunManager`)."""
    stage, data, args = config.stage, config.data, config.training
    where = f"{config.source}: " if config.source else ""
    instead = "drop it and use retrieval_eval_dirs (an InformationRetrievalEvaluator)"
    refused = {
        "embedding_token_budget": (
            stage.embedding_token_budget,
            "drop it and use the cached losses' loss_kwargs.mini_batch_size",
        ),
        "validation_file": (data.validation_file, instead),
        "validation_size": (data.validation_size, instead),
        "use_packing true": (str(config.model.use_packing).lower() == "true", "set it to auto or false"),
    }
    resume = args.resume_from_checkpoint
    if resume is not None:  # parse_config made it None, True or a folder
        raise ConfigError(f"{where}resume_from_checkpoint {resume}: {NO_RESUME}")
    if not config.stage.loss:
        raise ConfigError(f"{where}loss is empty: name a sentence-transformers loss, e.g. {DEFAULT_LOSS}")
    check_model_paths(config)  # before the loss's own checks: a folder that would run code is named as such
    check_loss_arguments(config.stage.loss, config.stage.loss_kwargs or {})
    for name, (value, advice) in refused.items():
        if value:
            raise ConfigError(f"{where}{name}: not on the trainer sentence_transformers path; {advice}")
    from .run import without_resume

    return without_resume(config, NO_RESUME)


def build_trainer(config: RunConfig, dataset, run_config: dict, callbacks: list, tokenizer, template, retrieval):
    """The trainer of a Stage II run through sentence-transformers (docs/design.md), for
    :func:`llm2vec.training.train`, which runs it in the run's folder as it runs the project's trainer."""
    from .llm2vec import LLM2Vec

    args, stage = config.training, config.stage
    model = sentence_transformer(
        config.model.model_name_or_path,
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
    # the same modules under the project's encoder: its save
    encoder = LLM2Vec(model[0].model, tokenizer, max_length=model.max_seq_length, template=model.llm2vec_template.name)
    loss = build_loss(stage.loss, stage.loss_kwargs or {}, model, stage.loss_scale)
    trainer = _trainer_class()(
        model=model,
        args=st_training_arguments(args),
        train_dataset=st_dataset(dataset.examples, stage.require_negative, config.data.query_instructions),
        loss=loss,
        evaluator=retrieval_evaluators(retrieval, args.per_device_eval_batch_size),
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
