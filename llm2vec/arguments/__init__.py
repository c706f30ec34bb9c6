"""Run configuration: one argument dataclass per concern, validated where it is defined, parsed per stage."""

from ..config_values import ConfigError
from .fields import STAGE_ARGUMENTS, DataArguments, ModelArguments, StageIArguments, StageIIArguments, argument_classes
from .run_config import RunConfig, flag_groups, help_text, load_config, parse_config

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
