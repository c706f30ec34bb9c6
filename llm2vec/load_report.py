"""transformers' load report where a decoder body is read from a causal-LM checkpoint."""

from __future__ import annotations

import logging
import os
import re
from typing import Any

REPORT_LOGGER = "transformers.modeling_utils"  # where transformers' load report goes (log_state_dict_report)
LM_HEAD = re.compile(r"^lm_head\.")  # the keys of a causal LM's head, which a decoder body does not have


class _HeldReports(logging.Filter):
    """Holds back the load reports of one checkpoint; lets every other record through."""

    def __init__(self, name_or_path: str):
        super().__init__()
        self.source = f"from: {name_or_path}"
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" in message and self.source in message:
            self.held.append(record)
            return False
        return True


def only_the_lm_head(info: dict[str, Any]) -> bool:
    """Whether a load's ``output_loading_info`` left out the LM head's keys and nothing else went wrong."""
    unexpected = info.get("unexpected_keys") or ()
    return (
        bool(unexpected)
        and all(LM_HEAD.match(key) for key in unexpected)
        and not info.get("missing_keys")
        and not info.get("mismatched_keys")
        and not info.get("error_msgs")
    )


def load_backbone(model_class, name_or_path: str | os.PathLike, **kwargs):
    """``model_class.from_pretrained(name_or_path, **kwargs)`` without transformers' load report when the report is
    only the LM head of a causal-LM checkpoint left out of a decoder body."""
    logger = logging.getLogger(REPORT_LOGGER)
    held = _HeldReports(os.fspath(name_or_path))
    expected = False
    logger.addFilter(held)
    try:
        model, info = model_class.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
        expected = only_the_lm_head(info)
    finally:
        logger.removeFilter(held)
        for record in [] if expected else held.held:
            logger.handle(record)
    return model
