"""Run configuration: one argument dataclass per concern, validated where it is defined, parsed per stage.

A run is configured by one JSON file (``run_stage_I.py train_configs/stage_I/<model>.json``), by the same
fields as CLI flags (``--model_name_or_path ... --max_steps ...``), or by a JSON file followed by flags
that override it (``config.json --max_steps 2``). The fields of a stage are those of:

- :class:`ModelArguments` (both stages): the base model, pooling, lengths, template, attention, dtype;
- :class:`DataArguments` (both stages): the training data;
- :class:`StageIArguments` or :class:`StageIIArguments`: what only that stage has (the reconstruction
  loss; the contrastive loss and LoRA);
- ``transformers.TrainingArguments``: optimiser, schedule, batch, precision, saving, distribution (on
  transformers < 5.23 with the ``activation_checkpointing`` fields added, :mod:`llm2vec.compat`).

Every value is checked in its dataclass's ``__post_init__``; what depends on several classes or on the
machine (the global batch, FlashAttention) is checked once, in :meth:`RunConfig.validate`. A field that
does not belong to the stage (say ``alpha`` in a Stage II config) is an error naming the file and the
field. Allowed values are imported from the modules that define them, never copied. The repository's
field reference is generated from these classes (their ``help`` and ``choices`` metadata).

The package's modules, one concern each: :mod:`~llm2vec.arguments.shared` (the fields both stages share and
:class:`ConfigError`), :mod:`~llm2vec.arguments.stages` (each stage's fields), :mod:`~llm2vec.arguments.run_config`
(:class:`RunConfig`: the checks across classes and the machine) and :mod:`~llm2vec.arguments.parse` (JSON and
flags into a :class:`RunConfig`; ``--help``). Every name is importable from ``llm2vec.arguments``.
"""

from .parse import TRAINING_DEFAULTS, flag_groups, help_text, load_config, parse_config
from .run_config import RunConfig
from .shared import (
    ATTENTION,
    DATASETS,
    DTYPE_NAMES,
    MASTER_WEIGHTS,
    PACKING,
    STAGES,
    ConfigError,
    DataArguments,
    ModelArguments,
)
from .stages import STAGE_ARGUMENTS, StageIArguments, StageIIArguments, _StageArguments, argument_classes

__all__ = [
    "ATTENTION",
    "DATASETS",
    "DTYPE_NAMES",
    "MASTER_WEIGHTS",
    "PACKING",
    "STAGES",
    "STAGE_ARGUMENTS",
    "TRAINING_DEFAULTS",
    "ConfigError",
    "DataArguments",
    "ModelArguments",
    "RunConfig",
    "StageIArguments",
    "StageIIArguments",
    "_StageArguments",
    "argument_classes",
    "flag_groups",
    "help_text",
    "load_config",
    "parse_config",
]
