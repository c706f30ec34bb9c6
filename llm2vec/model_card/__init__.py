"""Model cards: the ``README.md`` written into every saved model (checkpoints, final saves) and every export.

A card says what the model is and how it was made, from what the run left on disk:

- the base model and the stages run, found by following ``model_name_or_path`` and
  ``peft_model_name_or_path`` of each ``run_config.json`` back to the first one (a Stage II run on a
  Stage I output folder lists Stage I, then Stage II);
- the resolved run config of each stage (``run_config.json``), its training data and main settings;
- a summary of each stage's loss curve (``trainer_state.json``'s log history, or the trainer's history in
  memory for the run being saved): a few evenly spaced logged points, the minimum and the last value,
  with any loss parts (``loss_q2d``, ``loss_d2q``) beside the loss;
- MTEB scores when the caller hands in a rendered table (an export renders the paper's Table 1 layout with
  :mod:`llm2vec.evaluation.tables`);
- how to load the model with this package and, for an export, with sentence-transformers.

The card receives everything it prints as data (:class:`ModelCardInputs`): it imports nothing of the export or
the evaluation, so that saving a checkpoint, which writes a card, loads neither.

The YAML header follows the hub's model-card metadata (``base_model``: the hub id the weights came from, when
known, :func:`llm2vec.provenance.base_model_hub_id`; ``library_name``, ``pipeline_tag``, ``tags``), and
huggingface_hub's ``ModelCard`` reads it without warnings. A card names no machine path: every absolute path (a
folder of the run, a data file, the run configs' fields) is shown by its last two parts after ``.../``
(:func:`shown_path`). Missing or unreadable history files leave their section out with a note; they never stop
a save.

Two modules, one concern each: :mod:`~llm2vec.model_card.history` gathers what a card shows (the run's history off
disk, the loss-curve summary, :class:`ModelCardInputs`); :mod:`~llm2vec.model_card.render` writes it as Markdown.
Every name is importable from ``llm2vec.model_card``.
"""

from .history import (
    CURVE_POINTS,
    MAX_CHAIN,
    RUN_CONFIG_NAME,
    TRAINER_STATE_NAME,
    ModelCardInputs,
    StageRecord,
    history_of,
    loss_curve,
    read_stage,
)
from .render import (
    CARD_NAME,
    STAGE_TITLES,
    render_loss_curve,
    render_model_card,
    render_validation_curve,
    shown_path,
    without_machine_paths,
    write_training_card,
)

__all__ = [
    "CARD_NAME",
    "CURVE_POINTS",
    "MAX_CHAIN",
    "RUN_CONFIG_NAME",
    "STAGE_TITLES",
    "TRAINER_STATE_NAME",
    "ModelCardInputs",
    "StageRecord",
    "history_of",
    "loss_curve",
    "read_stage",
    "render_loss_curve",
    "render_model_card",
    "render_validation_curve",
    "shown_path",
    "without_machine_paths",
    "write_training_card",
]
