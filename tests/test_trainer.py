"""The stage-agnostic trainer: step-wide counts, its own loss scaling, generic loss parts in the logs."""

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from llm2vec.trainer import LLM2VecTrainer


@dataclass
class Output:
    loss: torch.Tensor
    loss_parts: dict = field(default_factory=dict)


class Toy(nn.Module):
    """loss = w * sum(x) / counts["n"] (a sum divided by a count, as the Stage I loss is), with one part."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x, target_counts=None):
        total = self.w * x.sum()
        loss = total / target_counts["n"] if target_counts is not None else total / x.numel()
        return Output(loss, {"loss_half": loss / 2})


@pytest.fixture
def make_trainer(tmp_path):
    from transformers import TrainingArguments

    def make(accumulation=1):
        args = TrainingArguments(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to="none",
            gradient_accumulation_steps=accumulation,
            per_device_train_batch_size=1,
            learning_rate=0.0,
            logging_steps=1,
            remove_unused_columns=False,
        )
        return LLM2VecTrainer(model=Toy(), args=args)

    return make


def test_step_counts_are_summed_over_the_micro_batches(make_trainer):
    trainer = make_trainer(accumulation=2)
    batches = [
        {"x": torch.ones(3), "target_counts": {"n": torch.tensor(3)}},
        {"x": torch.ones(5), "target_counts": {"n": torch.tensor(5)}},
    ]
    original = [dict(b) for b in batches]
    got, _ = trainer.get_batch_samples(iter(batches), 2, torch.device("cpu"))
    assert [int(b["target_counts"]["n"]) for b in got] == [8, 8]
    assert [int(b["target_counts"]["n"]) for b in batches] == [3, 5]  # the collated batches are not mutated
    assert all(a["x"] is b["x"] for a, b in zip(got, original))


@pytest.mark.parametrize("with_counts", [True, False])
def test_accumulated_gradient_is_the_gradient_of_one_big_batch(make_trainer, with_counts):
    """The Trainer must use our scaled loss as it is (``loss_is_scaled_for_ga``; before transformers 5.19
    ``model_accepts_loss_kwargs`` with a ``num_items_in_batch``, :mod:`llm2vec.compat`): if it divided by the
    accumulation steps again, this test would fail (as it did at 5.17 before the compat path)."""
    xs = [torch.arange(1.0, 4.0), torch.arange(4.0, 9.0)]  # 3 and 5 elements
    trainer = make_trainer(accumulation=2)
    if with_counts:
        batches = [{"x": x, "target_counts": {"n": torch.tensor(x.numel())}} for x in xs]
        batches, _ = trainer.get_batch_samples(iter(batches), 2, torch.device("cpu"))
        expected = sum(x.sum() for x in xs) / 8  # d/dw of the token mean over the whole step
    else:
        batches = [{"x": x} for x in xs]
        expected = sum(x.mean() for x in xs) / 2  # the mean of the per-micro-batch means
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    model = trainer.model
    model.train()
    for batch in batches:
        trainer.training_step(model, batch)
    torch.testing.assert_close(model.w.grad, expected)


def test_loss_parts_are_logged_by_name(make_trainer):
    trainer = make_trainer(accumulation=1)
    trainer.model.train()
    logged = {}
    trainer.callback_handler.on_log = lambda args, state, control, logs: logged.update(logs)
    batches, _ = trainer.get_batch_samples(iter([{"x": torch.ones(4) * 2}]), 1, torch.device("cpu"))
    trainer.compute_loss(trainer.model, batches[0])
    trainer.log({"loss": 2.0})
    assert logged["loss_half"] == pytest.approx(1.0)
