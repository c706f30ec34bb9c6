"""transformers' load report where a decoder body is read from a causal-LM checkpoint.

A Stage I model is saved as a causal LM: the decoder body and its LM head (``lm_head.weight`` where the head is not
tied to the input embeddings). The encoder (:class:`llm2vec.LLM2Vec`, and so Stage II, the export and the evaluation)
loads only the body (``AutoModel``), which leaves the head's weights unread. That is expected, and transformers 5
reports it at every load as a ``LOAD REPORT`` table of ``UNEXPECTED`` keys. :func:`load_backbone` leaves that report
out where the head is all it reports; a report of any other unexpected, missing or mismatched key is logged as
transformers logs it.

The mechanism: ``from_pretrained(..., output_loading_info=True)`` (transformers' documented argument) says which keys
the load left out or lacked; while the load runs, a :class:`logging.Filter` on transformers' ``modeling_utils``
logger holds back its report of this checkpoint (the record whose text has ``LOAD REPORT`` and ``from: <path>``),
which is logged afterwards unless the unexpected keys are the LM head's alone. Should transformers word its report
otherwise, the filter holds nothing and the report shows (``tests/test_encoder.py`` would fail).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

REPORT_LOGGER = "transformers.modeling_utils"
"""The logger transformers' load report goes to (``transformers.utils.loading_report.log_state_dict_report``)."""

LM_HEAD = re.compile(r"^lm_head\.")
"""The keys of a causal LM's head, which a decoder body does not have."""


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
    only the LM head of a causal-LM checkpoint left out of a decoder body (module docstring)."""
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
