"""Run configuration: one argument dataclass per concern, validated where it is defined, parsed per stage."""

from ..config_values import ConfigError
from .parse import flag_groups, help_text, load_config, parse_config
from .run_config import RunConfig
from .shared import DataArguments, ModelArguments
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
