"""A small real retrieval dataset built from the documentation that ships with Python.

Every example comes from one documented public object of a standard-library module: a module-level
function or class, or a public method of such a class.

- query: the first sentence of the object's docstring;
- positive: the object's signature line (``module.name(args)``) followed by the rest of its
  docstring, without that first sentence;
- negative (hard): the positive-style text of another object of the same module (a method of the
  same class when there is one, otherwise any other object of the module), picked with a seeded
  random generator.

Modules are a fixed, explicit list (:data:`STDLIB_MODULES`, read from ``stdlib_modules.json`` next to
this file) of modules that import without side effects or platform-specific content on CPython 3.11+;
one that fails to import is skipped and named in the manifest. The output depends only on the
docstrings, so it is the same on machines with the same Python minor version (C accelerators such as
``_decimal`` or ``_datetime`` are assumed present, as on every standard CPython build). Memory addresses
in default values (``<object object at 0x...>``) are removed from signatures.

The splits are by module: the modules are shuffled with the seed and taken into the eval (test)
split, in that order, until it holds ``eval_target`` examples, then, continuing in the same order, into
the validation split until it holds ``val_target``; all other modules are train. The validation split
is carved from what would otherwise be training modules: it is where the demo's hyperparameters are
chosen (``run_demo.py --validate``), so the test split is never looked at for that. The output folder:

- ``train/stdlib.jsonl``: ``{"query", "positive", "negative"}`` per line (the E5 layout);
- ``eval/corpus.jsonl`` (``{"_id", "title", "text"}``), ``eval/queries.jsonl`` (``{"_id", "text"}``),
  ``eval/qrels.jsonl`` (``{"query-id", "corpus-id", "score"}``): a BEIR-style retrieval task whose
  corpus is the positive of every eval-split object, so each query has one relevant document among
  all the eval modules' documents (its same-module siblings included);
- ``val/corpus.jsonl``, ``val/queries.jsonl``, ``val/qrels.jsonl``: the validation task, the same
  layout (every query of the validation modules is kept);
- ``provenance/train.jsonl``: for line i of the train file, the module and the dotted names of the
  query's and the negative's objects (kept out of ``train/`` so that data loaders never read it);
- ``manifest.json``: parameters, Python version, module lists, sizes and the SHA-256 of every file;
  written last, so its presence (with matching hashes) marks a complete build.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
import random
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from llm2vec.io import atomic_write, file_digest, write_jsonl

FORMAT_VERSION = 2  # 2: the validation split

MODULES_FILE = Path(__file__).with_name("stdlib_modules.json")


def read_module_list(path: str | Path = MODULES_FILE) -> tuple[str, ...]:
    """The modules to read, in the order of ``path`` (a JSON object whose ``"modules"`` is a list of names).

    The list is a parameter of the dataset: it is recorded in the manifest, and another list gives another
    dataset. ``stdlib_modules.json`` says why each kind of module was left out.
    """
    modules = json.loads(Path(path).read_text(encoding="utf-8")).get("modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) and m for m in modules):
        raise ValueError(f'{path}: expected {{"modules": [module names]}}, a non-empty list of strings')
    if len(set(modules)) != len(modules):
        raise ValueError(f"{path}: a module is listed twice")
    return tuple(modules)


STDLIB_MODULES: tuple[str, ...] = read_module_list()

DEFAULT_OUT_DIR = "cache/demo-data"
TRAIN_FILE = "train/stdlib.jsonl"
PROVENANCE_FILE = "provenance/train.jsonl"
CORPUS_FILE = "eval/corpus.jsonl"
QUERIES_FILE = "eval/queries.jsonl"
QRELS_FILE = "eval/qrels.jsonl"
SPLIT_DIRS = {"test": "eval", "validation": "val"}  # the retrieval splits, by the folder that holds each
MANIFEST_FILE = "manifest.json"

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# A sentence ends at . ! or ? followed by white space and an upper-case letter, a quote or a bracket
# (so "e.g. the" and "3.5 of" do not end one); or at the end of the first paragraph.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'`(\[])")
# A first line that is a hand-written signature, as in many C docstrings: "name(args) -> result".
_SIGNATURE_LINE = re.compile(r"^(async\s+)?[A-Za-z_][\w.]*\(.*\)(\s*->\s*.*)?$")


@dataclass(frozen=True)
class DocObject:
    """One documented public object: ``query`` is its first sentence, ``text`` its positive."""

    module: str
    name: str  # dotted, starting with the module, e.g. "json.JSONDecoder.decode"
    owner: str  # the class for a method, the module otherwise
    query: str
    text: str


def _squash(text: str) -> str:
    return " ".join(text.split())


class _Shown:
    """A stand-in default value whose repr is a fixed text."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


_LITERALS = (type(None), bool, int, float, complex, str, bytes)


def _is_literal(value) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_is_literal(v) for v in value)
    return isinstance(value, _LITERALS)


def _signature(obj, name: str) -> str | None:
    """``name(parameters)``, with default values that are not literals shown by name or type.

    A default such as ``sys.stdout`` or a sentinel ``object()`` has a repr that depends on the
    machine or the run (encodings, memory addresses); it is shown as its qualified name for
    functions and classes, and as ``<TypeName>`` otherwise.
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = []
    for p in sig.parameters.values():
        d = p.default
        if d is not inspect.Parameter.empty and not _is_literal(d):
            label = getattr(d, "__qualname__", None) if (inspect.isclass(d) or inspect.isroutine(d)) else None
            p = p.replace(default=_Shown(label or f"<{type(d).__name__}>"))
        params.append(p)
    try:
        sig = sig.replace(parameters=params)
    except ValueError:
        return None
    return name + _ADDRESS.sub("", str(sig))


def split_first_sentence(doc: str) -> tuple[str, str]:
    """Split a cleaned docstring into (first sentence, rest), both with normalised white space.

    The first sentence never runs past the first paragraph (blank line); the rest keeps the
    remaining paragraphs separated by blank lines and the other lines' breaks.
    """
    paragraphs = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)
    first_paragraph = _squash(paragraphs[0])
    later = paragraphs[1].strip() if len(paragraphs) > 1 else ""
    parts = _SENTENCE_END.split(first_paragraph, maxsplit=1)
    sentence = parts[0].strip()
    rest_of_paragraph = parts[1].strip() if len(parts) > 1 else ""
    rest = "\n\n".join(p for p in (rest_of_paragraph, later) if p)
    return sentence, rest


def _trim(text: str, max_chars: int) -> str:
    """Cut ``text`` to at most ``max_chars`` characters, at a white-space boundary when there is one."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    space = cut.rfind(" ", max_chars // 2)
    newline = cut.rfind("\n", max_chars // 2)
    boundary = max(space, newline)
    return (cut[:boundary] if boundary > 0 else cut).rstrip()


def _describe(obj, name: str, module: str, owner: str, min_rest_chars: int, max_query_chars: int, max_chars: int):
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else None
    if not doc or not doc.strip():
        return None
    doc = inspect.cleandoc(doc)
    lines = doc.split("\n")
    signature = _signature(obj, name)
    # C docstrings often start with hand-written signature lines: move them to the signature.
    hand_written = []
    while lines and _SIGNATURE_LINE.match(lines[0].strip()):
        hand_written.append(lines.pop(0).strip())
    if hand_written:
        doc = "\n".join(lines).strip()
        if signature is None:
            # "[async ]short.name(args) -> result": keep the arguments and result, under the full name
            signature = "\n".join(name + line[line.index("(") :] for line in hand_written)
    if signature is None:
        signature = name
    signature = _ADDRESS.sub("", signature)
    query, rest = split_first_sentence(doc)
    if not query or len(query) > max_query_chars or len(query.split()) < 3:
        return None
    if not query[0].isalpha() or _SIGNATURE_LINE.match(query):  # a doctest or a signature, not prose
        return None
    if len(rest) < min_rest_chars:
        return None
    text = _trim(signature + "\n" + rest, max_chars)
    if _squash(query).lower() in _squash(text).lower():
        return None
    return DocObject(module=module, name=name, owner=owner, query=query, text=text)


def _defined_here(obj, module: str) -> bool:
    origin = getattr(obj, "__module__", None)
    if origin in (module, "_" + module.rsplit(".", 1)[-1], "_" + module):
        return True  # defined in the module or in its C accelerator (io.StringIO is "_io")
    # or in a private submodule of a package (concurrent.futures._base)
    return isinstance(origin, str) and origin.startswith(module + "._")


def collect_module(
    module: str,
    min_rest_chars: int = 40,
    max_query_chars: int = 300,
    max_chars: int = 1500,
    properties: bool = False,
    module_docstring: bool = False,
):
    """The :class:`DocObject` of every usable public function, class and method of ``module``, sorted by name.

    Public means listed in ``__all__`` when the module has one, otherwise not starting with ``_``;
    an object is taken only from the module that defines it (no re-exports), and an object reachable
    under two names (an alias) is taken once, under the first name in sorted order. ``properties`` adds the
    documented properties of its classes, ``module_docstring`` the module itself (both under their dotted name,
    with no signature); the standard-library dataset uses neither.
    """
    with warnings.catch_warnings():  # e.g. typing.io warns when its attributes are read
        warnings.simplefilter("ignore")
        return _collect(module, min_rest_chars, max_query_chars, max_chars, properties, module_docstring)


def _collect(
    module: str,
    min_rest_chars: int,
    max_query_chars: int,
    max_chars: int,
    properties: bool = False,
    module_docstring: bool = False,
) -> list[DocObject]:
    mod = importlib.import_module(module)
    names = sorted(set(getattr(mod, "__all__", ())) | {n for n in vars(mod) if not n.startswith("_")})
    found: list[DocObject] = []
    seen: set[int] = set()
    if module_docstring:
        item = _describe(mod, module, module, module, min_rest_chars, max_query_chars, max_chars)
        if item is not None:
            found.append(item)
    alive = []  # keeps bound methods alive, so that no id() is reused while collecting

    def take(obj, name, owner):
        target = getattr(obj, "__func__", obj)  # a bound method and its function are one object
        alive.append(target)
        if id(target) in seen:
            return
        seen.add(id(target))
        item = _describe(obj, name, module, owner, min_rest_chars, max_query_chars, max_chars)
        if item is not None:
            found.append(item)

    for attr in names:
        obj = getattr(mod, attr, None)
        if obj is None or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if not _defined_here(obj, module):
            continue
        name = f"{module}.{attr}"
        take(obj, name, module)
        if inspect.isclass(obj):
            for meth_name in sorted(vars(obj)):
                if meth_name.startswith("_"):
                    continue
                raw = vars(obj)[meth_name]
                if isinstance(raw, (staticmethod, classmethod)):
                    raw = raw.__func__
                if isinstance(raw, property):
                    if properties:
                        take(raw, f"{name}.{meth_name}", name)
                    continue
                if not inspect.isroutine(raw):
                    continue
                take(raw, f"{name}.{meth_name}", name)
    found.sort(key=lambda d: d.name)
    return found


def _dedupe(objects: list[DocObject]) -> list[DocObject]:
    """Keep the first object (in the given order) of each query text and of each positive text.

    Aliases (``random.choice`` and ``random.Random.choice``) and copied docstrings would otherwise
    give one query two relevant documents, or one document to two queries.
    """
    queries: set[str] = set()
    texts: set[str] = set()
    kept = []
    for d in objects:
        q, t = _squash(d.query).lower(), _squash(d.text.split("\n", 1)[-1]).lower()
        if q in queries or t in texts:
            continue
        queries.add(q)
        texts.add(t)
        kept.append(d)
    return kept


def _pick_negatives(objects: list[DocObject], seed: int) -> dict[str, DocObject]:
    """For each object, another object of its module: a sibling of the same class when there is one."""
    by_module: dict[str, list[DocObject]] = {}
    for d in objects:
        by_module.setdefault(d.module, []).append(d)
    negatives: dict[str, DocObject] = {}
    for module, items in sorted(by_module.items()):
        rng = random.Random(f"{seed}:{module}")
        for d in items:
            siblings = [o for o in items if o.name != d.name and o.owner == d.owner and d.owner != module]
            candidates = siblings or [o for o in items if o.name != d.name]
            if candidates:
                negatives[d.name] = rng.choice(candidates)
    return negatives


def complete_build(out: Path, params: dict, environment: dict, fresh: bool, say, tag: str) -> dict | None:
    """The manifest of a complete build in ``out`` made with ``params`` in ``environment`` (said reused), else None
    (always with ``fresh``)."""
    if fresh:
        return None
    try:
        manifest = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if manifest.get("parameters") != params or manifest.get("environment") != environment:
        return None
    for rel, digest in manifest.get("sha256", {}).items():
        p = out / rel
        if not p.is_file() or file_digest([p]) != digest:
            return None
    sizes = manifest["sizes"]
    say(
        f"[{tag}] reusing the complete build in {out} ({sizes['train']} train pairs, {sizes['eval_queries']} eval queries)"
    )
    return manifest


def python_environment() -> dict:
    """What the standard-library docstrings depend on: the interpreter."""
    return {"python_version": platform.python_version(), "python_implementation": platform.python_implementation()}


def build_stdlib_dataset(
    out_dir: str = DEFAULT_OUT_DIR,
    max_train: int | None = None,
    max_eval_queries: int = 300,
    eval_target: int = 350,
    val_target: int = 200,
    seed: int = 42,
    min_rest_chars: int = 40,
    max_query_chars: int = 300,
    max_chars: int = 1500,
    modules: tuple[str, ...] = STDLIB_MODULES,
    fresh: bool = False,
    verbose: bool = True,
) -> dict:
    """Build (or reuse: same parameters, same interpreter, same file hashes) the standard-library dataset in
    ``out_dir`` (the module docstring's layout) and return its manifest. ``max_train`` and ``max_eval_queries``
    keep seeded samples (the corpus keeps every eval-split document); ``eval_target`` and ``val_target`` size the
    splits (:func:`split_by_module`); an object is used when the rest of its docstring has ``min_rest_chars`` and
    its first sentence at most ``max_query_chars``; texts are cut to ``max_chars``."""
    say = print if verbose else (lambda *a, **k: None)
    out = Path(out_dir)
    params = {
        "format_version": FORMAT_VERSION,
        "max_train": max_train,
        "max_eval_queries": max_eval_queries,
        "eval_target": eval_target,
        "val_target": val_target,
        "seed": seed,
        "min_rest_chars": min_rest_chars,
        "max_query_chars": max_query_chars,
        "max_chars": max_chars,
        "modules": list(modules),
    }
    environment = python_environment()
    if (manifest := complete_build(out, params, environment, fresh, say, "stdlib-data")) is not None:
        return manifest

    start = time.perf_counter()
    say(
        f"[stdlib-data] reading the docstrings of {len(modules)} standard-library modules "
        f"(Python {platform.python_version()})"
    )
    objects: list[DocObject] = []
    used, skipped = [], {}
    for module in sorted(set(modules)):
        try:
            found = collect_module(module, min_rest_chars, max_query_chars, max_chars)
        except Exception as exc:  # an optional module missing from this build
            skipped[module] = f"{type(exc).__name__}: {exc}"
            continue
        used.append(module)
        objects.extend(found)
    manifest = write_retrieval_dataset(
        out,
        objects,
        params,
        {"name": "stdlib-docstrings", "environment": environment, **environment},
        used_modules=used,
        skipped_modules=skipped,
        say=lambda text: say(f"[stdlib-data] {text}"),
    )
    say(f"[stdlib-data] wrote {out} in {time.perf_counter() - start:.1f} s")
    return manifest


def split_by_module(objects: list[DocObject], seed: int, eval_target: int, val_target: int) -> tuple[list, list]:
    """The eval (test) and validation modules: the modules, shuffled with ``seed``, are taken into the eval split
    in that order until it holds ``eval_target`` objects, then into the validation split until it holds
    ``val_target``; every other module is train."""
    per_module: dict[str, int] = {}
    for d in objects:
        per_module[d.module] = per_module.get(d.module, 0) + 1
    order = sorted(per_module)
    random.Random(seed).shuffle(order)
    eval_modules: list[str] = []
    n_eval = 0
    for module in order:
        if n_eval >= eval_target:
            break
        eval_modules.append(module)
        n_eval += per_module[module]
    val_modules: list[str] = []
    n_val = 0
    for module in order[len(eval_modules) :]:
        if n_val >= val_target:
            break
        val_modules.append(module)
        n_val += per_module[module]
    return eval_modules, val_modules


def write_retrieval_dataset(
    out: Path,
    objects: list[DocObject],
    params: dict,
    header: dict,
    used_modules: list[str],
    skipped_modules: dict[str, str],
    say=print,
) -> dict:
    """Deduplicate ``objects``, pick their hard negatives, split them by module and write the layout of the module
    docstring into ``out``; returns the manifest (``header`` first, then ``params`` and what was built), written
    last. ``params`` holds ``seed``, ``eval_target``, ``val_target``, ``max_train`` and ``max_eval_queries``."""
    seed = params["seed"]
    max_train, max_eval_queries = params["max_train"], params["max_eval_queries"]
    objects = _dedupe(objects)
    negatives = _pick_negatives(objects, seed)
    objects = [d for d in objects if d.name in negatives]  # a module with a single object has no negative
    eval_modules, val_modules = split_by_module(objects, seed, params["eval_target"], params["val_target"])
    eval_set, val_set = set(eval_modules), set(val_modules)
    train_objs = [d for d in objects if d.module not in eval_set | val_set]
    eval_objs = [d for d in objects if d.module in eval_set]
    val_objs = [d for d in objects if d.module in val_set]
    with_examples = {d.module for d in objects}

    if max_train is not None and len(train_objs) > max_train:
        keep = set(random.Random(f"{seed}:train").sample(range(len(train_objs)), max_train))
        train_objs = [d for i, d in enumerate(train_objs) if i in keep]
    query_objs = eval_objs
    if max_eval_queries is not None and len(eval_objs) > max_eval_queries:
        keep = set(random.Random(f"{seed}:eval").sample(range(len(eval_objs)), max_eval_queries))
        query_objs = [d for i, d in enumerate(eval_objs) if i in keep]

    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # the old build is incomplete from here on
    write_jsonl(
        out / TRAIN_FILE,
        ({"query": d.query, "positive": d.text, "negative": negatives[d.name].text} for d in train_objs),
    )
    write_jsonl(
        out / PROVENANCE_FILE,
        ({"module": d.module, "query_object": d.name, "negative_object": negatives[d.name].name} for d in train_objs),
    )
    val_files = [f.replace("eval/", "val/", 1) for f in (CORPUS_FILE, QUERIES_FILE, QRELS_FILE)]
    for (corpus, queries, qrels), documents, asked in (
        ((CORPUS_FILE, QUERIES_FILE, QRELS_FILE), eval_objs, query_objs),
        (val_files, val_objs, val_objs),
    ):
        write_jsonl(out / corpus, ({"_id": d.name, "title": "", "text": d.text} for d in documents))
        write_jsonl(out / queries, ({"_id": "q:" + d.name, "text": d.query} for d in asked))
        write_jsonl(out / qrels, ({"query-id": "q:" + d.name, "corpus-id": d.name, "score": 1} for d in asked))

    files = [TRAIN_FILE, PROVENANCE_FILE, CORPUS_FILE, QUERIES_FILE, QRELS_FILE, *val_files]
    train_modules = sorted({d.module for d in train_objs})
    manifest = {
        **header,
        "parameters": params,
        "sizes": {
            "objects": len(objects),
            "train_available": sum(1 for d in objects if d.module not in eval_set | val_set),
            "train": len(train_objs),
            "eval_objects": len(eval_objs),
            "eval_corpus": len(eval_objs),
            "eval_queries": len(query_objs),
            "eval_qrels": len(query_objs),
            "train_modules": len(train_modules),
            "eval_modules": len(eval_modules),
            "val_queries": len(val_objs),
            "val_corpus": len(val_objs),
            "val_modules": len(val_modules),
        },
        "train_modules": train_modules,
        "eval_modules": sorted(eval_modules),
        "val_modules": sorted(val_modules),
        "modules_without_examples": sorted(set(used_modules) - with_examples),
        "skipped_modules": skipped_modules,
        "files": files,
        "sha256": {rel: file_digest([out / rel]) for rel in files},
    }
    with atomic_write(out / MANIFEST_FILE) as f:
        f.write(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    s = manifest["sizes"]
    say(
        f"{s['objects']} documented objects from {len(used_modules)} modules -> "
        f"train {s['train']} pairs ({s['train_available']} available, {s['train_modules']} modules); "
        f"eval {s['eval_queries']} queries over a corpus of {s['eval_corpus']} ({s['eval_modules']} modules); "
        f"validation {s['val_queries']} queries ({s['val_modules']} modules)"
    )
    if skipped_modules:
        say(f"skipped {len(skipped_modules)} modules that did not import: {', '.join(sorted(skipped_modules)[:20])}")
    return manifest


def main(argv: list[str] | None = None) -> int:
    """``python experiments/demo/stdlib_data.py [--out_dir DIR] [--fresh]``: build (or reuse) the dataset."""
    parser = argparse.ArgumentParser(description="Build the standard-library docstring dataset of the demo.")
    parser.add_argument(
        "--out_dir",
        default=str(Path(__file__).resolve().parents[2] / DEFAULT_OUT_DIR),
        help=f"output folder (default: {DEFAULT_OUT_DIR} in the repository)",
    )
    parser.add_argument("--fresh", action="store_true", help="rebuild even if a complete build exists")
    args = parser.parse_args(argv)
    build_stdlib_dataset(args.out_dir, fresh=args.fresh)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
