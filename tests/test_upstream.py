"""What the trainer relies on in transformers beyond its public API, checked against the installed version.

``LLM2VecTrainer`` overrides a few private methods of transformers' ``Trainer``, each listed once with the signature it
was written against and the reason no public hook does its work (``llm2vec.trainer.PRIVATE_OVERRIDES``). These tests
fail when transformers changes one of those signatures, when the trainer overrides a private method that is not
listed (or defines a helper whose name the Trainer has since taken), and when a tiny run shows the Trainer calling the
overrides otherwise than they assume. A tiny run of either stage must raise no FutureWarning or DeprecationWarning.
"""

import inspect
import math
import os
from pathlib import Path

import pytest
import torch
from _drivers import tiny_run_flags
from _tiny_data import write_tiny_e5
from transformers import Trainer

from llm2vec.testing import save_tiny_model
from llm2vec.trainer import PRIVATE_OVERRIDES, LLM2VecTrainer
from llm2vec.training import run


def plain_signature(function) -> str:
    """``(self, a, b=None, *args, **kwargs)``: the parameters' names, kinds and defaults; annotations left out."""
    parts = []
    for p in inspect.signature(function).parameters.values():
        star = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
        parts.append(star + p.name + ("" if p.default is p.empty else f"={p.default!r}"))
    return "(" + ", ".join(parts) + ")"


def unlisted_private_overrides(cls) -> list[str]:
    """The names ``cls`` (and its bases below ``Trainer``) define that are private methods of ``Trainer`` too but
    are not in ``PRIVATE_OVERRIDES``."""
    found = {
        name
        for klass in cls.__mro__[: cls.__mro__.index(Trainer)]
        for name in vars(klass)
        if name.startswith("_") and not name.startswith("__") and hasattr(Trainer, name)
    }
    return sorted(found - set(PRIVATE_OVERRIDES))


def test_every_private_override_is_listed_with_the_signature_it_was_written_against():
    assert unlisted_private_overrides(LLM2VecTrainer) == []
    for name, (signature, reason) in PRIVATE_OVERRIDES.items():
        assert name in vars(LLM2VecTrainer), f"{name} is listed but LLM2VecTrainer does not override it"
        assert hasattr(Trainer, name), f"transformers' Trainer has no {name} any more: see its reason: {reason}"
        assert plain_signature(getattr(Trainer, name)) == signature, (
            f"transformers' Trainer.{name} is now {plain_signature(getattr(Trainer, name))}, the override was "
            f"written against {signature}"
        )
        assert plain_signature(getattr(LLM2VecTrainer, name)) == signature, (
            f"the override of {name} takes other arguments"
        )


def test_the_sentence_transformers_private_override_meets_the_signature_it_was_written_against():
    """``llm2vec.st_model`` builds Stage II's model in memory through ``Transformer._load_model``; a change of that
    method's parameters fails here, and the model it returns is the one handed in (no weights read)."""
    from sentence_transformers.sentence_transformer.modules import Transformer

    from llm2vec.st_model import PRIVATE_OVERRIDE, _transformer_class

    name, signature, reason = PRIVATE_OVERRIDE
    assert hasattr(Transformer, name), f"sentence-transformers' Transformer has no {name} any more: {reason}"
    assert plain_signature(getattr(Transformer, name)) == signature, plain_signature(getattr(Transformer, name))
    given = object()
    assert getattr(_transformer_class(), name)(None, "folder", "feature-extraction", None, "torch", False,
                                               llm2vec_model=given) is given  # fmt: skip


def test_an_unlisted_private_override_is_found():
    class Sneaky(LLM2VecTrainer):
        def _get_train_sampler(self, train_dataset=None):  # a Trainer method, not listed
            return None

        def _a_helper_of_its_own(self):  # not the Trainer's: allowed
            return None

    assert unlisted_private_overrides(Sneaky) == ["_get_train_sampler"]


def test_peft_still_reads_the_deprecated_property_that_training_hides(tiny_models):
    """``llm2vec.compat.peft_reads_deprecated_property`` hides exactly this warning of peft's; once peft stops
    reading ``is_gradient_checkpointing``, this test fails and the filter can go."""
    from peft import LoraConfig, get_peft_model

    causal_lm, _ = tiny_models["llama3"]
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        get_peft_model(causal_lm.model, LoraConfig(r=2, target_modules=["q_proj"]))


def test_loading_an_adapter_shows_no_warning_of_peft(tiny_checkpoints, tmp_path):
    """Encoding with a Stage II adapter (``LLM2Vec.load(..., peft_model_name_or_path)``, as the evaluation and the
    demo's scorer do) wraps the model in peft too: the same read of peft's is hidden there, and only there."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    from llm2vec import LLM2Vec

    base = tiny_checkpoints["llama3"]
    adapted = get_peft_model(AutoModel.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj"]))
    adapted.save_pretrained(tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LLM2Vec.load(str(base), str(tmp_path / "adapter"), merge_peft=True)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream")
    return save_tiny_model("llama3", root / "model"), write_tiny_e5(root / "data", n=24)


# The Trainer's own loaders of a checkpoint's training state, not overridden: a resume must still call each once.
STATE_LOADERS = ("_load_optimizer_and_scheduler", "_load_rng_state")


def spy_on_overrides(monkeypatch) -> list[dict]:
    """Wrap every listed override of LLM2VecTrainer (and the Trainer's state loaders); each call appends what the
    Trainer passed and saw."""
    calls = []
    for name in [*PRIVATE_OVERRIDES, *STATE_LOADERS]:
        original = getattr(LLM2VecTrainer, name)

        def wrapped(self, *args, _name=name, _original=original, **kwargs):
            bound = inspect.signature(_original).bind(self, *args, **kwargs)
            bound.apply_defaults()
            passed = {k: v for k, v in bound.arguments.items() if k != "self"}
            call = {"name": _name, "passed": passed, "step": self.state.global_step}
            if _name == "_get_grad_norm":
                grads = [p.grad for p in self.model.parameters() if p.requires_grad]
                call["grads_set"] = all(g is not None for g in grads)
                call["grads_norm"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
                call["weights"] = [p.detach().clone() for p in self.model.parameters() if p.requires_grad]
            result = _original(self, *args, **kwargs)
            if _name == "_get_grad_norm":
                call["result"] = float(result)
            calls.append(call)
            return result

        monkeypatch.setattr(LLM2VecTrainer, name, wrapped)
    return calls


@pytest.mark.filterwarnings("error::FutureWarning", "error::DeprecationWarning")
def test_a_tiny_run_warns_of_nothing_deprecated_and_calls_the_overrides_as_they_assume(assets, tmp_path, monkeypatch):
    model, data = assets
    n = torch.get_num_threads()
    out = tmp_path / "run"
    common = {"num_threads": 1, "disable_tqdm": "true", "max_seq_length": 64, "lr_scheduler_type": "constant"}
    calls = spy_on_overrides(monkeypatch)
    try:
        trainer = run("I", tiny_run_flags(model, data, out, max_steps=2, save_steps=1, max_grad_norm=0, **common))
        first = list(calls)
        calls.clear()
        # a finished run trained further: resumed from its newest checkpoint
        run(
            "I",
            tiny_run_flags(model, data, out, max_steps=3, save_steps=1, max_grad_norm=0, **common)
            + ["--resume_from_checkpoint", "true"],
        )
        resumed = list(calls)
        stage_II = run(
            "II",
            tiny_run_flags(model, data, tmp_path / "II", stage="II", lora_r=4, lora_alpha=8, max_steps=1, **common),
        )
    finally:
        torch.set_num_threads(n)
    assert stage_II is not None

    # the data order is the dataset's: the public train_sampling_strategy gives the sequential sampler
    assert isinstance(trainer._get_train_sampler(), torch.utils.data.SequentialSampler)

    # _get_grad_norm: once per optimizer step, after its backward (every gradient set) and before optimizer.step()
    # (the weights still those the step started from), returning the norm of the gradients (no clipping here)
    norms = [c for c in first if c["name"] == "_get_grad_norm"]
    assert [c["step"] for c in norms] == [0, 1]
    for call in norms:
        assert call["grads_set"] and math.isclose(call["result"], call["grads_norm"], rel_tol=1e-5), call["result"]
    assert not all(torch.equal(a, b) for a, b in zip(norms[0]["weights"], norms[1]["weights"]))  # step 1 applied

    # _save_checkpoint writes checkpoint-<step> under args.output_dir, the staging folder while it saves; the final
    # model is saved by save_model -> _save(output_dir) into its staging folder (llm2vec.run.saves), with no gathered
    # state dict on one process
    assert [c["passed"]["trial"] for c in first if c["name"] == "_save_checkpoint"] == [None, None]
    saves = [Path(c["passed"]["output_dir"]) for c in first if c["name"] == "_save"]
    assert [str(p.relative_to(out)) for p in saves] == [
        os.path.join(".checkpoint-1.staging.tmp", "checkpoint-1"),
        os.path.join(".checkpoint-2.staging.tmp", "checkpoint-2"),
        os.path.join(".final-model.staging.tmp", out.name),
    ]
    assert all(c["passed"]["state_dict"] is None for c in first if c["name"] == "_save")

    # a resume loads the weights, the optimizer and scheduler, and the RNG state of the checkpoint, once each
    checkpoint = str(out / "checkpoint-2")
    loads = [(c["name"], str(next(iter(c["passed"].values())))) for c in resumed if c["name"].startswith("_load")]
    assert sorted(loads) == [
        ("_load_from_checkpoint", checkpoint),
        ("_load_optimizer_and_scheduler", checkpoint),
        ("_load_rng_state", checkpoint),
    ]
    assert [c["step"] for c in resumed if c["name"] == "_get_grad_norm"] == [2]
