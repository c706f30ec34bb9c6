"""Shared fixtures: tiny random Llama-3 / SmolLM2 / Qwen2 / Mistral models and tokenizers, built offline."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Two threads a process; one a worker when pytest-xdist runs the suite in several processes (the README's
# command: two workers on two cores), so that the workers do not fight over the cores. A test that asks for
# a thread count sets it itself.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

from llm2vec.testing import FAMILIES, build_tiny_model, save_tiny_model, write_tiny_e5  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models():
    """family -> (causal LM, tokenizer); built once per test session."""
    return {family: build_tiny_model(family) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> folder of a saved tiny causal LM checkpoint (safetensors + tokenizer)."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_tiny_model(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def llama_checkpoint(tiny_checkpoints):
    """The tiny Llama-3 checkpoint's folder, as a string."""
    return str(tiny_checkpoints["llama3"])


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """(tiny Llama-3 model folder, E5-layout data folder of 24 examples a source): what the run tests train on."""
    root = tmp_path_factory.mktemp("assets")
    return save_tiny_model("llama3", root / "model"), write_tiny_e5(root / "data", n=24)


@pytest.fixture
def keep_thread_count():
    """A test that trains (``num_threads`` sets torch's thread count) leaves the count as it found it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
