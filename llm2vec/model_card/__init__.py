"""Model cards: the ``README.md`` written into every saved model (checkpoints, final saves) and every export.

A card says what the model is and how it was made, from what the run left on disk: the base model and the stages
run (following ``model_name_or_path`` and ``peft_model_name_or_path`` of each ``run_config.json`` back to the
first), each stage's resolved config and a summary of its loss curve, MTEB scores when the caller hands in a
rendered table, and how to load the model. The card receives everything it prints as data
(:class:`ModelCardInputs`) and imports nothing of the export or the evaluation, so that saving a checkpoint loads
neither. Its YAML header is the hub's model-card metadata (read by huggingface_hub without warnings); it names no
machine path (:func:`shown_path`); missing or unreadable history files leave a note, never stop a save.

:mod:`~llm2vec.model_card.history` gathers what a card shows; :mod:`~llm2vec.model_card.render` writes it as Markdown.
"""

from .history import ModelCardInputs, history_of, loss_curve
from .render import render_model_card, shown_path, without_machine_paths, write_training_card

__all__ = [
    "ModelCardInputs",
    "history_of",
    "loss_curve",
    "render_model_card",
    "shown_path",
    "without_machine_paths",
    "write_training_card",
]
