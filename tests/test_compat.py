"""The paths that differ between transformers releases (:mod:`llm2vec.compat`), on whichever release is installed:
CI runs this file at the newest releases and at setup.py's lower bounds (``tests/lower_bounds.txt``).

The loss scaling under gradient accumulation is judged by ``tests/test_trainer.py`` (the gradient of one big batch)
and ``tests/test_stage_I.py`` (one process with accumulation equals two processes), both in the same list.
"""

import json

import pytest
import torch
from _drivers import tiny_run_flags
from _tiny_data import write_tiny_e5

from llm2vec import LLM2Vec
from llm2vec.compat import disable_activation_checkpointing, enable_activation_checkpointing
from llm2vec.testing import build_tiny_model
from llm2vec.training import run


def layer_calls_in_one_step(encoder: LLM2Vec) -> int:
    """How often the first decoder layer's attention is entered in one forward and backward pass of a batch: twice
    when activation checkpointing recomputes the layer in the backward pass, once otherwise. (A pre-hook of a
    submodule: transformers 5.24 checkpoints the layer's ``forward`` (5.17 its ``__call__``), so the layer's own
    hooks may run once either way, and torch ends a recomputation once it has the tensors it needs, so a late
    post-hook may never run.)"""
    calls = []
    attention = next(m.self_attn for m in encoder.model.modules() if hasattr(m, "self_attn"))
    handle = attention.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        encoder.train()
        batch = encoder.tokenize(["Paris is the capital of France.", "The quick brown fox."])
        encoder.embed(batch).pow(2).sum().backward()
    finally:
        handle.remove()
    return len(calls)


@pytest.mark.parametrize("on", [True, False])
def test_activation_checkpointing_of_a_config_reaches_the_layers(tmp_path, tiny_checkpoints, on):
    """``activation_checkpointing`` (a training argument only since transformers 5.23) is accepted on every
    supported release, saved under its name, and the training run's model recomputes its decoder layers."""
    data = write_tiny_e5(tmp_path / "data", n=8, sources=("nq",))
    out = tmp_path / "out"
    flags = tiny_run_flags(
        tiny_checkpoints["llama3"],
        data,
        out,
        stage="II",
        e5_sources='["nq"]',
        max_steps=1,
        save_strategy="no",
        max_seq_length=64,
        attn_implementation="sdpa",
        activation_checkpointing=str(on).lower(),
    )
    trainer = run("II", flags)
    assert trainer.args.activation_checkpointing is on
    resolved = json.loads((out / "run_config.json").read_text())
    assert resolved["activation_checkpointing"] is on
    assert resolved["activation_checkpointing_kwargs"] == ({"use_reentrant": False} if on else None)
    assert layer_calls_in_one_step(trainer.model) == (2 if on else 1)


def test_the_encoder_enables_checkpointing_by_either_name():
    """``LLM2Vec.activation_checkpointing_enable`` (what transformers >= 5.23 calls) and
    ``gradient_checkpointing_enable`` (what older Trainers call) both checkpoint the wrapped model's layers."""
    for method in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        model, tokenizer = build_tiny_model("llama3")
        encoder = LLM2Vec(model, tokenizer, max_length=32)
        getattr(encoder, method)({"use_reentrant": False})
        assert layer_calls_in_one_step(encoder) == 2, method


def test_checkpointing_keeps_the_gradients():
    """The recomputation changes memory, not results: the same gradients with and without it."""
    grads = []
    for on in (False, True):
        model, tokenizer = build_tiny_model("llama3")
        encoder = LLM2Vec(model, tokenizer, max_length=32)
        if on:
            encoder.activation_checkpointing_enable({"use_reentrant": False})
        layer_calls_in_one_step(encoder)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_bare_model_is_switched_on_and_off_by_the_compat_helpers():
    """What a script does to a transformers model without the encoder: on, then off again, on any release."""
    model, tokenizer = build_tiny_model("llama3")
    encoder = LLM2Vec(model, tokenizer, max_length=32)
    enable_activation_checkpointing(model, {"use_reentrant": False})
    assert layer_calls_in_one_step(encoder) == 2
    disable_activation_checkpointing(model)
    assert layer_calls_in_one_step(encoder) == 1
