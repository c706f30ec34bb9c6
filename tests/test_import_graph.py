"""The package's imports, read from its source with ``ast`` (module-level and function-level imports alike):
no import cycle, and saving a checkpoint (which writes a model card) reaches nothing of the export or evaluation,
statically and in a fresh interpreter that really saves a model."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llm2vec"
SAVING_MODULES = ("llm2vec.trainer", "llm2vec.run.saves")  # the trainer's _save / _save_checkpoint; the staging
FORBIDDEN = ("llm2vec.export", "llm2vec.evaluation")


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def import_graph(with_parents: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its source. ``with_parents``: importing ``a.b.c``
    also runs the subpackage ``a.b``'s ``__init__`` (the top package's own is left out: it is always loaded)."""
    modules = module_names()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                submodules = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
                targets.update(submodules if len(submodules) == len(node.names) else [module, *submodules])
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    if with_parents:
        for name in list(graph):
            for target in list(graph[name]):
                parts = target.split(".")
                graph[name].update(".".join(parts[:k]) for k in range(2, len(parts)))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "llm2vec.model_card" in graph["llm2vec.export.writer"]  # the graph sees the imports it must see
    assert cycles(graph) == []


def test_a_planted_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_saving_a_checkpoint_reaches_no_export_or_evaluation_module():
    graph = import_graph(with_parents=True)
    reached, todo = set(), list(SAVING_MODULES)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert "llm2vec.model_card" in reached
    assert not [m for m in reached if m.startswith(FORBIDDEN)]


def test_a_fresh_interpreter_saves_a_checkpoint_without_export_or_evaluation(tmp_path):
    """Import the saving modules, save a tiny model and write its card as the trainer's ``_save`` does; then no
    ``llm2vec.export`` or ``llm2vec.evaluation`` module is loaded."""
    script = textwrap.dedent(
        f"""
        import json, sys
        import {", ".join(SAVING_MODULES)}
        from llm2vec import LLM2Vec
        from llm2vec.model_card import write_training_card
        from llm2vec.testing import build_tiny_model

        causal_lm, tokenizer = build_tiny_model("llama3")
        encoder = LLM2Vec(causal_lm.model, tokenizer)
        out = sys.argv[1]
        encoder.save(out)
        write_training_card(out, {{"stage": "I", "model_name_or_path": "tiny"}}, [{{"step": 1, "loss": 2.0}}], encoder, 1)
        print(json.dumps(sorted(sys.modules)))
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "saved")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert "llm2vec.trainer" in loaded and (tmp_path / "saved" / "README.md").is_file()
    assert not [m for m in loaded if m.startswith(FORBIDDEN)]


def test_the_run_folder_is_reached_through_the_run_package_alone():
    """Every module outside ``llm2vec.run`` that touches a run's output folder imports the package's face
    (``llm2vec.run``: RunManager and what the trainer needs), never one of its parts; the one exception is the
    model loaders' check of a folder a live run holds (``llm2vec.model_files`` reads ``llm2vec.run.lock``, which
    imports nothing of the package: the face would be an import cycle through ``llm2vec.arguments``)."""
    graph = import_graph()
    parts = {m for m in graph if m.startswith("llm2vec.run.")}
    assert {"llm2vec.run.folder", "llm2vec.run.lock", "llm2vec.run.plan", "llm2vec.run.saves"} <= parts
    assert not graph["llm2vec.run.lock"]
    outside = {m: sorted(graph[m] & parts) for m in graph if not m.startswith("llm2vec.run")}
    assert {m: p for m, p in outside.items() if p} == {"llm2vec.model_files": ["llm2vec.run.lock"]}
    assert {m for m in graph if "llm2vec.run" in graph[m]} == {
        "llm2vec.trainer",
        "llm2vec.training",
        "llm2vec.export.writer",
        "llm2vec.st_training",
        "llm2vec.evaluation.paths",
    }


def test_the_encoder_loads_without_transformers_trainer_or_training_arguments():
    """``from llm2vec import LLM2Vec`` (what encoding, evaluation and the export load of this package) in a fresh
    interpreter leaves transformers' Trainer and TrainingArguments unimported: they cost seconds (accelerate,
    datasets) and only training needs them (``llm2vec.compat`` reads them on first use). (mteb 2.20 imports the
    Trainer itself, so evaluation pays for it there whatever this package does.)"""
    code = textwrap.dedent(
        """
        import sys
        from llm2vec import LLM2Vec
        print([m for m in ("transformers.trainer", "transformers.training_args") if m in sys.modules])
        from llm2vec.compat import TrainingArguments
        print("transformers.training_args" in sys.modules, TrainingArguments.__name__)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "True TrainingArguments"]


def test_the_training_arguments_pickle_as_the_trainer_saves_them(tmp_path):
    """The Trainer writes ``training_args.bin`` with ``torch.save``: the class :mod:`llm2vec.compat` gives (on releases
    before 5.23 its own subclass) is found again by its module and name."""
    import pickle

    from llm2vec import compat

    args = compat.TrainingArguments(output_dir=str(tmp_path), activation_checkpointing=True, report_to="none")
    again = pickle.loads(pickle.dumps(args))
    assert type(again) is compat.TrainingArguments and again.activation_checkpointing is True
    with pytest.raises(AttributeError, match="no attribute 'NOT_A_NAME'"):
        compat.NOT_A_NAME  # noqa: B018
