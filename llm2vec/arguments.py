"""Argument dataclasses shared by the Stage I and Stage II drivers, and the config parser.

A run is configured by one JSON file (``run_stage_I.py train_configs/stage_I/<model>.json``), by the same
fields as CLI flags (``--model_name_or_path ... --max_steps ...``), or by a JSON file followed by flags
that override it (``config.json --max_steps 2``). Every field is validated; an unknown field or a bad
value names the config file and the field.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from transformers import HfArgumentParser, TrainingArguments


class ConfigError(ValueError):
    """A bad configuration: the message names the file or flag, the field, and what to do."""


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Hub id or local folder of the base causal LM (or a Stage I checkpoint)."})
    peft_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A LoRA adapter to merge into the base before training (Stage II)."})
    pooling_mode: str = field(default="eos_token", metadata={"help": "eos_token (the paper's), last_token, mean, weighted_mean."})
    max_seq_length: int = field(default=512, metadata={"help": "Most tokens per text, template and anchor included."})
    template: str | None = field(default=None, metadata={"help": "Prompt template name; default: detected from the model."})
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "flash_attention_2 (the paper's; needs the flash extra), sdpa or eager."})
    torch_dtype: str = field(default="auto", metadata={"help": "Weights dtype: auto (bf16 if --bf16, else fp32), bfloat16, float32."})

    def __post_init__(self):
        if self.pooling_mode not in ("eos_token", "last_token", "mean", "weighted_mean"):
            raise ConfigError(f"pooling_mode={self.pooling_mode!r}: choose eos_token, last_token, mean or weighted_mean")
        if self.max_seq_length < 8:
            raise ConfigError(f"max_seq_length={self.max_seq_length}: must be at least 8")


@dataclass
class DataArguments:
    dataset_name: str = field(default="E5", metadata={"help": "E5 (the paper's data, one file per source) or jsonl (your own)."})
    dataset_file_path: str = field(
        default="cache/echo-data", metadata={"help": "E5: the folder of <source>.jsonl files; jsonl: a file, or files joined by ','."})
    max_examples_per_source: int | None = field(default=None, metadata={"help": "Keep at most this many pairs per source."})
    e5_sources: list[str] | None = field(default=None, metadata={"help": "E5 sources to use (default: all of Table 6)."})
    default_instruction: str = field(
        default="", metadata={"help": "jsonl: the query instruction of lines that have no 'instruction' field."})

    def __post_init__(self):
        if self.dataset_name not in ("E5", "jsonl"):
            raise ConfigError(f"dataset_name={self.dataset_name!r}: choose 'E5' or 'jsonl'")


@dataclass
class ExperimentArguments:
    stage: str = field(default="I", metadata={"help": "Which stage this config is for: I or II (checked by the driver)."})
    total_batch_size: int | None = field(
        default=None, metadata={"help": "Expected per_device_train_batch_size x processes x gradient_accumulation_steps; "
                                        "checked at start-up."})
    # Stage I
    alpha: float = field(default=0.2, metadata={"help": "Stage I weight: L = alpha * L_Q2D + (1 - alpha) * L_D2Q (paper: 0.2)."})
    reconstruction_targets: str = field(
        default="text", metadata={"help": "Stage I targets: text (the paper's equations) or all (the authors' code)."})
    # Stage II
    loss_scale: float = field(default=20.0, metadata={"help": "Stage II InfoNCE scale = 1 / tau (paper: tau = 0.05, scale 20)."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={"help": "Module names that get LoRA adapters."})
    require_negative: bool = field(default=True, metadata={"help": "Stage II: every example must have a hard negative."})

    def __post_init__(self):
        if self.stage not in ("I", "II"):
            raise ConfigError(f"stage={self.stage!r}: must be 'I' or 'II'")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha={self.alpha}: must be in [0, 1]")
        if self.reconstruction_targets not in ("text", "all"):
            raise ConfigError(f"reconstruction_targets={self.reconstruction_targets!r}: choose 'text' or 'all'")
        if self.loss_scale <= 0:
            raise ConfigError(f"loss_scale={self.loss_scale}: must be positive")


ARGUMENT_CLASSES = (ModelArguments, DataArguments, ExperimentArguments, TrainingArguments)


def _parse_flags(argv: list[str]) -> dict[str, Any]:
    """``--key value`` pairs to a dict; values are read as JSON where they parse (numbers, true, lists)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        key = argv[i]
        if not key.startswith("--"):
            raise ConfigError(f"command line: expected --field, got {key!r} (a JSON config must come first)")
        values = []
        i += 1
        while i < len(argv) and not argv[i].startswith("--"):
            values.append(argv[i])
            i += 1
        parsed = []
        for v in values:
            try:
                parsed.append(json.loads(v))
            except json.JSONDecodeError:
                parsed.append(v)
        out[key[2:]] = True if not parsed else parsed[0] if len(parsed) == 1 else parsed
    return out


def load_config(argv: list[str]) -> tuple[dict[str, Any], str]:
    """The merged raw config: a JSON file (if the first argument is one) overridden by flags."""
    source = "command line"
    config: dict[str, Any] = {}
    if argv and argv[0].endswith(".json"):
        source = argv[0]
        if not os.path.isfile(source):
            raise ConfigError(f"{source}: config file not found")
        try:
            with open(source) as f:
                config = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{source}: not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{source}: the config must be a JSON object of field: value")
        argv = argv[1:]
    config.update(_parse_flags(argv))
    return config, source


def parse_args(argv: list[str] | None = None):
    """(model_args, data_args, experiment_args, training_args, raw_config, source) from argv."""
    config, source = load_config(sys.argv[1:] if argv is None else argv)
    known = {f.name for cls in ARGUMENT_CLASSES for f in fields(cls)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {unknown}. See `python experiments/run_stage_I.py --help` "
                          "for the fields (and the README's config section).")
    if "model_name_or_path" not in config or "output_dir" not in config:
        raise ConfigError(f"{source}: 'model_name_or_path' and 'output_dir' are required")
    config.setdefault("remove_unused_columns", False)
    config.setdefault("report_to", "none")
    config.setdefault("ddp_find_unused_parameters", False)
    if config.get("activation_checkpointing") or config.get("gradient_checkpointing"):
        config.setdefault("activation_checkpointing_kwargs", {"use_reentrant": False})
    try:
        parsed = HfArgumentParser(ARGUMENT_CLASSES).parse_dict(config, allow_extra_keys=False)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: {e}") from None
    return (*parsed, config, source)


def print_help(stage: str) -> None:
    parser = HfArgumentParser(ARGUMENT_CLASSES)
    parser.prog = f"run_stage_{stage}.py"
    parser.usage = f"run_stage_{stage}.py CONFIG.json [--field value ...]  |  run_stage_{stage}.py --field value ..."
    parser.print_help()


def resolved_config(*arg_objects) -> dict[str, Any]:
    """Every field of the parsed dataclasses, JSON-serialisable, to save beside each checkpoint."""
    out: dict[str, Any] = {}
    for obj in arg_objects:
        values = obj.to_dict() if isinstance(obj, TrainingArguments) else asdict(obj)
        out.update({k: v for k, v in values.items() if not k.startswith("_")})
    return json.loads(json.dumps(out, default=str))
