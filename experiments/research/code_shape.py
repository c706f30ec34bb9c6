"""The shape of a checkout's code: lines per layer, docstring share, ``raise`` count, the largest modules and
the package's import graph (floors, imports that climb, circles).

    python experiments/research/code_shape.py [CHECKOUT]      # default: this checkout

Counts every line (``wc -l``) of the Python files git tracks. The layers:

- method: the losses, the encoder, both stage models, the collator, packing, pooling, the prompt templates and
  the chunked steps (what the paper defines);
- training: the training driver, the Trainer subclass, schedule, distributed set-up, data loading and the
  sentence-transformers Stage II path;
- support: every other module of ``llm2vec/`` (run folder, evaluation, export, arguments, model card, I/O, ...).

Import graph: a room is a subpackage of ``llm2vec`` or a top-level module; an arrow is any import (module or
function level) from one room to another. Floors are given bottom-up (a room sits one floor above the highest
room it imports); an arrow that closes a loop between rooms climbs, and is listed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

METHOD = (
    "llm2vec/loss/", "llm2vec/llm2vec.py", "llm2vec/encode_inputs.py", "llm2vec/llm2vec_q2d_d2q.py",
    "llm2vec/llm2vec_contrastive.py", "llm2vec/collator.py", "llm2vec/packing.py", "llm2vec/pooling.py",
    "llm2vec/templates.py", "llm2vec/template_encoding.py", "llm2vec/chat_turn.py", "llm2vec/chunked_steps.py",
)  # fmt: skip
TRAINING = (
    "llm2vec/training.py", "llm2vec/trainer.py", "llm2vec/schedule.py", "llm2vec/distributed.py",
    "llm2vec/compat.py", "llm2vec/devices.py", "llm2vec/dataset/", "llm2vec/metrics_file.py",
    "llm2vec/st_training.py", "llm2vec/st_model.py", "llm2vec/st_losses.py",
)  # fmt: skip


def layer(path: str) -> str:
    if path.startswith(METHOD):
        return "method"
    if path.startswith(TRAINING):
        return "training"
    return "support" if path.startswith("llm2vec/") else path.split("/")[0]


def docstring_lines(tree: ast.AST) -> int:
    """Lines of the module's, classes' and functions' docstrings."""
    total = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant):
                if isinstance(first.value.value, str):
                    total += first.end_lineno - first.lineno + 1
    return total


def room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def imports(path: Path, module: str, is_package: bool) -> set[str]:
    package = module if is_package else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {n for n in found if n.startswith("llm2vec.")}


def import_graph(root: Path, paths: list[str]) -> dict[str, set[str]]:
    modules = {}
    for path in paths:
        if path.startswith("llm2vec/") and path.endswith(".py"):
            parts = path[:-3].split("/")
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (root / path, is_package)
    rooms: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        if module == "llm2vec":
            continue
        source = room(module)
        targets = {room(t) for t in imports(path, module, is_package) if t in modules and t != "llm2vec"}
        rooms.setdefault(source, set()).update(t for t in targets if t != source)
    return rooms


def floors(graph: dict[str, set[str]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Floors by a depth-first walk in name order; the arrows the walk finds closing a loop climb."""
    state: dict[str, int] = {}
    climbs: list[tuple[str, str]] = []
    floor: dict[str, int] = {}

    def visit(v: str) -> int:
        state[v] = 1
        top = 0
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                climbs.append((v, w))
                continue
            top = max(top, visit(w) if w not in state else floor[w])
        state[v] = 2
        floor[v] = top + 1
        return floor[v]

    for v in sorted(graph):
        if v not in state:
            visit(v)
    return floor, climbs


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph.get(start, ()))
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += graph.get(v, ())
    return seen


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[2])
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True, check=True)
    paths = listed.stdout.split()
    lines: dict[str, int] = {}
    package = {"lines": 0, "docstring lines": 0, "raise": 0}
    largest = []
    for path in paths:
        text = (root / path).read_text(encoding="utf-8")
        n = len(text.splitlines())
        lines[layer(path)] = lines.get(layer(path), 0) + n
        if path.startswith("llm2vec/"):
            tree = ast.parse(text)
            package["lines"] += n
            package["docstring lines"] += docstring_lines(tree)
            package["raise"] += sum(isinstance(node, ast.Raise) for node in ast.walk(tree))
            largest.append((n, path))
    for name in ("method", "training", "support", "experiments", "tests"):
        print(f"{name:14} {lines.get(name, 0):6}")
    print(f"package        {package['lines']:6}")
    share = package["docstring lines"] / package["lines"]
    print(f"docstring lines {package['docstring lines']} ({share:.1%} of the package)")
    print(f"raise statements {package['raise']} ({1000 * package['raise'] / package['lines']:.1f} per 1,000 lines)")
    print("modules over 450 lines:", ", ".join(f"{p} {n}" for n, p in sorted(largest, reverse=True) if n > 450))
    floor, climbs = floors(import_graph(root, paths))
    print(f"floors {max(floor.values())}; arrows that climb {len(climbs)}")
    for source, target in climbs:
        print(f"  climbs: {source} -> {target}")
    graph = import_graph(root, paths)
    reach = {v: reachable(graph, v) for v in graph}
    loops = sorted({tuple(sorted(w for w in reach[v] if v in reach.get(w, ()))) for v in graph if v in reach[v]})
    print(f"circles between rooms {len(loops)}" + "".join(f"\n  circle: {', '.join(loop)}" for loop in loops))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
