"""Shared fixtures: tiny random Llama-3 / SmolLM2 / Qwen2 / Mistral models and tokenizers, built offline, and the
finished runs and adapters that the run-folder, checkpoint, resume and adapter tests compare against."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Two threads a process; one a worker when pytest-xdist runs the suite in several processes (the README's
# command: two workers on two cores), so that the workers do not fight over the cores. A test that asks for
# a thread count sets it itself.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

from _drivers import quick, run_flags, six_step_flags  # noqa: E402
from _tiny_data import write_tiny_e5  # noqa: E402

from llm2vec.testing import FAMILIES, build_tiny_model, save_tiny_model  # noqa: E402


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


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """An uninterrupted 4-step Stage I run (:func:`_drivers.run_flags`: checkpoints 2 and 4, the final model, its
    marker): the reference of every resumed 4-step run."""
    from llm2vec.training import run

    out = tmp_path_factory.mktemp("reference") / "run"
    n = torch.get_num_threads()
    try:
        run("I", run_flags(assets, out))
    finally:
        torch.set_num_threads(n)
    return out


@pytest.fixture(scope="module")
def references(assets, tmp_path_factory):
    """Uninterrupted 6-step runs of both stages (:func:`_drivers.six_step_flags`), the reference of every resumed
    6-step run, and their trainers."""
    from llm2vec.training import run

    root, n = tmp_path_factory.mktemp("references"), torch.get_num_threads()
    try:
        trainers = {stage: run(stage, six_step_flags(assets, root / stage, stage)) for stage in ("I", "II")}
    finally:
        torch.set_num_threads(n)
    return {stage: root / stage for stage in trainers}, trainers


@pytest.fixture(scope="module")
def adapters(assets, tmp_path_factory):
    """A Stage II adapter of the tiny model, a base of the same shape with other weights, a wider base, a folder
    with no adapter_config.json."""
    from llm2vec.training import run

    root = tmp_path_factory.mktemp("adapters")
    adapter = root / "adapter"
    n = torch.get_num_threads()
    try:
        run("II", quick(assets, adapter, "II"))
    finally:
        torch.set_num_threads(n)
    other = save_tiny_model("llama3", root / "other_base", seed=1)
    wider = save_tiny_model("llama3", root / "wider", hidden_size=48)
    empty = root / "not_an_adapter"
    empty.mkdir()
    (empty / "notes.txt").write_text("nothing here")
    return {"adapter": adapter, "other": other, "wider": wider, "empty": empty}
