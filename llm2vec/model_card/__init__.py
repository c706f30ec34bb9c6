"""Model cards: the ``README.md`` written into every saved model (checkpoints, final saves) and every export."""

from .history import ModelCardInputs, history_of, loss_curve  # noqa: F401  (the package's face)
from .render import render_model_card, shown_path, without_machine_paths, write_training_card  # noqa: F401
