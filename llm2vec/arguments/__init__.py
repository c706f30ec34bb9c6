"""Run configuration: one argument dataclass per concern, validated where it is defined, parsed per stage."""

from ..config_values import ConfigError  # noqa: F401  (the package's face)
from .fields import STAGE_ARGUMENTS, DataArguments, ModelArguments, StageIArguments, StageIIArguments, argument_classes  # noqa: F401
from .run_config import RunConfig, flag_groups, help_text, load_config, parse_config  # noqa: F401
