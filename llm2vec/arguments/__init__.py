"""Run configuration: one argument dataclass per concern, validated where it is defined, parsed per stage.

A run is configured by one JSON file (``run_stage_I.py train_configs/stage_I/<model>.json``), by the same
fields as CLI flags (``--model_name_or_path ... --max_steps ...``), or by a JSON file followed by flags
that override it (``config.json --max_steps 2``). A stage's fields are those of :class:`ModelArguments` and
:class:`DataArguments` (:mod:`~llm2vec.arguments.shared`, both stages), :class:`StageIArguments` or
:class:`StageIIArguments` (:mod:`~llm2vec.arguments.stages`) and transformers' ``TrainingArguments``
(:mod:`llm2vec.compat`); a field of another stage is an error naming the file and the field.

Every value is checked in its dataclass's ``__post_init__``; what depends on several classes or on the machine
is checked once, in :meth:`RunConfig.validate` (:mod:`~llm2vec.arguments.run_config`). :mod:`~llm2vec.arguments.parse`
reads JSON and flags into a :class:`RunConfig` and writes ``--help``. ``docs/configuration.md`` is generated from the
classes' ``help`` and ``choices`` metadata.
"""

from .parse import flag_groups, help_text, load_config, parse_config
from .run_config import RunConfig
from .shared import ConfigError, DataArguments, ModelArguments
from .stages import STAGE_ARGUMENTS, StageIArguments, StageIIArguments, argument_classes

__all__ = [
    "STAGE_ARGUMENTS",
    "ConfigError",
    "DataArguments",
    "ModelArguments",
    "RunConfig",
    "StageIArguments",
    "StageIIArguments",
    "argument_classes",
    "flag_groups",
    "help_text",
    "load_config",
    "parse_config",
]
