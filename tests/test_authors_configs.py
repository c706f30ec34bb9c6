"""The configs of train_configs/authors/ reproduce the authors' public runs as they were.

The reference is the tables below, written from the authors' public configs file by file (digested in the
project's paper notes, "The authors' configs, per model"; 8 processes, as in their README's command): their
per-device batch and gradient accumulation per model and stage; no Stage I ``stop_after_n_steps`` (their code's
default, 10000) with a checkpoint every 1000 steps; two kinds of Stage II config (:data:`THEIR_STAGE_II_STOPS`);
their code's loss scale 50. Each file is named as theirs is. Each authors' config must differ from the paper
config of the same run only in those fields, so a gap to the paper can be told from a gap to the authors' runs.
"""

import json
from pathlib import Path

import pytest

from llm2vec.arguments import parse_config

ROOT = Path(__file__).resolve().parents[1]
AUTHORS = ROOT / "train_configs" / "authors"
PROCESSES = 8

# model: ((Stage I per device, accumulation), (Stage II Anchor ...), (Stage II Baseline ...)), from their configs
THEIR_BATCHES = {
    "MetaLlama3.2_1b": ((32, 2), (128, 1), (64, 1)),
    "Qwen2.5_1.5b": ((32, 4), (128, 1), (128, 1)),
    "MetaLlama3.2_3b": ((16, 8), (64, 2), (64, 2)),
    "MetaLlama3.1_8b": ((1, 64), (32, 4), (32, 4)),
}
THEIR_GLOBAL_BATCHES = {  # the same facts as global batches: Stage I, Anchor Stage II, Baseline Stage II
    "MetaLlama3.2_1b": (512, 1024, 512),
    "Qwen2.5_1.5b": (1024, 1024, 1024),
    "MetaLlama3.2_3b": (1024, 1024, 1024),
    "MetaLlama3.1_8b": (512, 1024, 1024),
}
THEIR_DEFAULT_STOP = 10000  # their code's stop_after_n_steps where a config sets none
STAGE_I_STOP, STAGE_I_SAVE = THEIR_DEFAULT_STOP, 1000  # no stop_after_n_steps in their Stage I configs
# Stage II, file by file: (stop_after_n_steps, save_steps). Four set save_steps 200 and no stop (their default
# applies; the 3-epoch schedule ends before it): checkpoint-1000 is the paper's 1000-step model. The other four set
# save_steps 25 and stop at 200 (their output names end in "-ab"): the short runs of Table 9 / Figure 2.
LONG, SHORT = (THEIR_DEFAULT_STOP, 200), (200, 25)
THEIR_STAGE_II_STOPS = {
    "MetaLlama3.2_1b_stage1_2000steps_stage2": LONG,
    "Qwen2.5_1.5b_stage1_2000steps_stage2": LONG,
    "MetaLlama3.1_8b_stage1_2000steps_stage2": LONG,
    "Qwen2.5_1.5b_baseline_stage2": LONG,
    "MetaLlama3.2_3b_stage1_2000steps_stage2": SHORT,
    "MetaLlama3.2_1b_baseline_stage2": SHORT,
    "MetaLlama3.2_3b_baseline_stage2": SHORT,
    "MetaLlama3.1_8b_baseline_stage2": SHORT,
}
THEIR_SCALE = 50.0
# fields an authors' config may change relative to the paper config of the same run
ALLOWED = {
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "total_batch_size",
    "stop_after_n_steps",
    "save_steps",
    "output_dir",
    "model_name_or_path",
    "loss_scale",
}
# evaluation during training: the paper configs hold out validation pairs, the authors' runs held out none
EVALUATION = {"validation_size", "eval_steps", "per_device_eval_batch_size"}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def runs():
    """(authors' config, paper config of the same run, stage, (per device, accumulation))"""
    for model, (stage_I, anchor, baseline) in THEIR_BATCHES.items():
        yield AUTHORS / f"{model}_q2d_d2q.json", ROOT / f"train_configs/stage_I/{model}_q2d_d2q.json", "I", stage_I
        yield (
            AUTHORS / f"{model}_stage1_2000steps_stage2.json",
            ROOT / f"train_configs/stage_II/{model}_stage1_2000steps_stage2.json",
            "II",
            anchor,
        )
        yield (
            AUTHORS / f"{model}_baseline_stage2.json",
            ROOT / f"train_configs/baseline/{model}_baseline_stage2.json",
            "II",
            baseline,
        )


def test_the_set_is_complete():
    expected = {path.name for path, *_ in runs()}
    assert {p.name for p in AUTHORS.glob("*.json")} == expected
    assert {f"{name}.json" for name in THEIR_STAGE_II_STOPS} == {n for n in expected if "stage2" in n}
    assert sum(v == LONG for v in THEIR_STAGE_II_STOPS.values()) == 4  # four of each kind, as their files are
    for model, (stage_I, anchor, baseline) in THEIR_BATCHES.items():  # the two tables of facts agree
        assert tuple(d * a * PROCESSES for d, a in (stage_I, anchor, baseline)) == THEIR_GLOBAL_BATCHES[model]


@pytest.mark.parametrize("authors,paper,stage,batch", list(runs()), ids=lambda x: getattr(x, "stem", None))
def test_each_config_is_the_authors_run_and_differs_from_the_paper_only_there(authors, paper, stage, batch):
    raw, reference = load(authors), load(paper)
    changed = {k for k in set(raw) | set(reference) if raw.get(k) != reference.get(k)}
    assert changed <= ALLOWED | EVALUATION, f"{authors.name} also changes {sorted(changed - ALLOWED - EVALUATION)}"
    assert not EVALUATION & set(raw), "the authors' runs trained on all their data"
    config = parse_config(stage, [str(authors), "--use_cpu", "true"])  # every field valid (CI has no GPU)
    args, stage_args = config.training, config.stage
    per_device, accumulation = batch
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (per_device, accumulation)
    assert stage_args.total_batch_size == per_device * accumulation * PROCESSES
    assert args.num_train_epochs == 3 and args.max_steps <= 0  # their 3-epoch linear schedule
    assert raw["output_dir"] == f"output/authors/stage_{stage}/{authors.stem}"
    if stage == "I":
        assert (stage_args.stop_after_n_steps, args.save_steps) == (STAGE_I_STOP, STAGE_I_SAVE)
        assert stage_args.alpha == 0.2 and args.learning_rate == 4e-5
        # the "2000-step" model is a checkpoint of this run, which every Anchor Stage II starts from
        assert STAGE_I_STOP > 2000 and 2000 % STAGE_I_SAVE == 0
    else:
        stop, save = THEIR_STAGE_II_STOPS[authors.stem]
        assert (stage_args.stop_after_n_steps, args.save_steps) == (stop, save)
        if (stop, save) == LONG:  # the paper's 1000-step model is a checkpoint of this run
            assert 1000 % save == 0 and stop > 1000
        assert stage_args.loss_scale == THEIR_SCALE and args.learning_rate == 2e-4 and args.warmup_steps == 300
        if "baseline" in authors.stem:
            assert raw["model_name_or_path"] == reference["model_name_or_path"]  # the hub model
        else:
            model = authors.stem.split("_stage1")[0]
            assert raw["model_name_or_path"] == f"output/authors/stage_I/{model}_q2d_d2q/checkpoint-2000"


def test_the_papers_512_stays_the_default():
    """The paper configs keep the paper's global batch of 512 in both stages; only the authors' set departs."""
    for _, paper, _, _ in runs():
        assert load(paper)["total_batch_size"] == 512, paper.name


def test_reconstruction_targets_help_says_what_each_mode_and_the_authors_pass_do():
    """``all`` has the authors' targets but not their reconstruction pass: the help says what
    each mode predicts and how the authors' pass differs (their mask hides the prompt's head from attention, and
    their positions count the left padding), instead of calling ``all`` the authors' code."""
    from dataclasses import fields

    from llm2vec.arguments import StageIArguments

    (field,) = [f for f in fields(StageIArguments) if f.name == "reconstruction_targets"]
    text = field.metadata["help"]
    assert field.metadata["choices"] == ("text", "all")
    assert "Neither is the authors' pass" in text and "the authors' code" not in text
    for fact in (
        "EOS id",
        "instruction-skipping mask",
        "hides BOS",
        "no position ids",
        "left padding",
        "varies per row",
    ):
        assert fact in text, fact
