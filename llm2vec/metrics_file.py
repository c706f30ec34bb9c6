"""The run's log as it is written: every logged entry appended to a JSON-lines file (``metrics_file``)."""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback


class MetricsFile(TrainerCallback):
    """Appends every entry the Trainer logs to ``path`` as one JSON line (main process only)."""

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and logs):
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")
