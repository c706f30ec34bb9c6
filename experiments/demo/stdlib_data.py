"""The demo's retrieval dataset from the docstrings of standard-library modules, and the corpus writer that
:mod:`demo.package_data` shares: what an example is, how modules are split and why, and the sizes are in
``docs/demo.md`` (The data).

Each example is one documented public object (function, class, method): query, its docstring's first sentence;
positive, its signature and the rest of the docstring; hard negative, another object of its module. The modules
(:data:`STDLIB_MODULES`, from ``stdlib_modules.json``) are split, shuffled with the seed, into eval (test), then
validation, then train (:func:`split_by_module`). The output folder:

- ``train/stdlib.jsonl``: ``{"query", "positive", "negative"}`` per line (the E5 layout);
- ``eval/`` and ``val/``: ``corpus.jsonl`` (``{"_id", "title", "text"}``), ``queries.jsonl`` (``{"_id", "text"}``),
  ``qrels.jsonl`` (``{"query-id", "corpus-id", "score"}``): BEIR-style tasks, each query with one relevant
  document among all the split's documents;
- ``provenance/train.jsonl``: for line i of the train file, the module and the dotted names of the query's and
  the negative's objects (kept out of ``train/`` so that data loaders never read it);
- ``manifest.json``: parameters, environment, module lists, sizes and the SHA-256 of every file; written last,
  so its presence (with matching hashes) marks a complete build.
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
    boundary = max(cut.rfind(" ", max_chars // 2), cut.rfind("\n", max_chars // 2))
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
    signature = _ADDRESS.sub("", signature or name)
    query, rest = split_first_sentence(doc)
    if not query or len(query) > max_query_chars or len(query.split()) < 3 or len(rest) < min_rest_chars:
        return None
    if not query[0].isalpha() or _SIGNATURE_LINE.match(query):  # a doctest or a signature, not prose
        return None
    text = _trim(signature + "\n" + rest, max_chars)
    return None if _squash(query).lower() in _squash(text).lower() else DocObject(module, name, owner, query, text)


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
) -> list[DocObject]:
    """The :class:`DocObject` of every usable public function, class and method of ``module``, sorted by name.

    Public means listed in ``__all__`` when the module has one, otherwise not starting with ``_``;
    an object is taken only from the module that defines it (no re-exports), and an object reachable
    under two names (an alias) is taken once, under the first name in sorted order. ``properties`` adds the
    documented properties of its classes, ``module_docstring`` the module itself (both under their dotted name,
    with no signature); the standard-library dataset uses neither.
    """
    with warnings.catch_warnings():  # e.g. typing.io warns when its attributes are read
        warnings.simplefilter("ignore")
        return _collect(module, (min_rest_chars, max_query_chars, max_chars), properties, module_docstring)


def _collect(module: str, limits: tuple[int, int, int], properties: bool, module_docstring: bool) -> list[DocObject]:
    mod = importlib.import_module(module)
    names = sorted(set(getattr(mod, "__all__", ())) | {n for n in vars(mod) if not n.startswith("_")})
    found: list[DocObject] = []
    seen: set[int] = set()
    if module_docstring and (item := _describe(mod, module, module, module, *limits)) is not None:
        found.append(item)
    alive = []  # keeps bound methods alive, so that no id() is reused while collecting

    def take(obj, name, owner):
        target = getattr(obj, "__func__", obj)  # a bound method and its function are one object
        alive.append(target)
        if id(target) in seen:
            return
        seen.add(id(target))
        if (item := _describe(obj, name, module, owner, *limits)) is not None:
            found.append(item)

    for attr in names:
        obj = getattr(mod, attr, None)
        if obj is None or not (inspect.isclass(obj) or inspect.isroutine(obj)) or not _defined_here(obj, module):
            continue
        name = f"{module}.{attr}"
        take(obj, name, module)
        for meth_name in sorted(vars(obj)) if inspect.isclass(obj) else ():
            raw = vars(obj)[meth_name]
            raw = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            if not meth_name.startswith("_") and (inspect.isroutine(raw) or properties and isinstance(raw, property)):
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


def read_modules(modules, limits: tuple[int, int, int], **options) -> tuple[list[DocObject], list[str], dict]:
    """:func:`collect_module` of each of ``modules`` (with ``limits``: min_rest_chars, max_query_chars, max_chars,
    and ``options``), in order: the objects, the modules read, and those that failed to import, with why."""
    objects, used, skipped = [], [], {}
    for module in modules:
        try:
            objects += collect_module(module, *limits, **options)
        except (Exception, SystemExit) as exc:  # a module missing from this build, or needing an optional dependency
            skipped[module] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        used.append(module)
    return objects, used, skipped


NOT_PARAMETERS = ("out_dir", "fresh", "verbose", "workers", "timeout")  # a builder's arguments that leave its output


def build_corpus(tag: str, format_version: int, arguments: dict, environment: dict, read) -> dict:
    """What both corpus builders do with their ``arguments`` (their ``locals()``; all but :data:`NOT_PARAMETERS`
    are the dataset's parameters): reuse the complete build in ``out_dir`` made with these parameters in
    ``environment`` (same file hashes; never with ``fresh``), else ``read(say)`` gives the objects, the manifest's
    header and the modules read and skipped, written by :func:`write_retrieval_dataset`; returns the manifest."""
    say = (lambda text: print(f"[{tag}] {text}")) if arguments["verbose"] else (lambda text: None)
    out = Path(arguments["out_dir"])
    params = {"format_version": format_version}
    params.update((k, list(v) if isinstance(v, tuple) else v) for k, v in arguments.items() if k not in NOT_PARAMETERS)
    try:
        manifest = None if arguments["fresh"] else json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        manifest = None
    if (
        manifest is not None
        and (manifest.get("parameters"), manifest.get("environment")) == (params, environment)
        and all((out / f).is_file() and file_digest([out / f]) == d for f, d in manifest.get("sha256", {}).items())
    ):
        s = manifest["sizes"]
        say(f"reusing the complete build in {out} ({s['train']} train pairs, {s['eval_queries']} eval queries)")
        return manifest
    start = time.perf_counter()
    manifest = write_retrieval_dataset(out, *read(say), params, say)
    say(f"wrote {out} in {time.perf_counter() - start:.1f} s")
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
    arguments, environment = dict(locals()), python_environment()

    def read(say):
        say(f"reading the docstrings of {len(modules)} standard-library modules (Python {platform.python_version()})")
        objects, used, skipped = read_modules(sorted(set(modules)), (min_rest_chars, max_query_chars, max_chars))
        return objects, {"name": "stdlib-docstrings", "environment": environment, **environment}, used, skipped

    return build_corpus("stdlib-data", FORMAT_VERSION, arguments, environment, read)


def split_by_module(objects: list[DocObject], seed: int, eval_target: int, val_target: int) -> tuple[list, list]:
    """The eval (test) and validation modules: the modules, shuffled with ``seed``, are taken into the eval split
    in that order until it holds ``eval_target`` objects, then into the validation split until it holds
    ``val_target``; every other module is train."""
    per_module: dict[str, int] = {}
    for d in objects:
        per_module[d.module] = per_module.get(d.module, 0) + 1
    order = sorted(per_module)
    random.Random(seed).shuffle(order)
    splits: list[list[str]] = []
    for target in (eval_target, val_target):
        taken, count = [], 0
        for module in order[sum(map(len, splits)) :]:
            if count >= target:
                break
            taken.append(module)
            count += per_module[module]
        splits.append(taken)
    return splits[0], splits[1]


def write_retrieval_dataset(
    out: Path, objects: list[DocObject], header: dict, used_modules: list, skipped_modules: dict, params: dict, say
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
    train_available = len(train_objs)

    def sample(items: list[DocObject], count: int | None, name: str) -> list[DocObject]:
        if count is None or len(items) <= count:
            return items
        keep = set(random.Random(f"{seed}:{name}").sample(range(len(items)), count))
        return [d for i, d in enumerate(items) if i in keep]

    train_objs, query_objs = sample(train_objs, max_train, "train"), sample(eval_objs, max_eval_queries, "eval")
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
            "train_available": train_available,
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
        "modules_without_examples": sorted(set(used_modules) - {d.module for d in objects}),
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


def corpus_parser(description: str, default_out: str) -> argparse.ArgumentParser:
    """A corpus builder's command line: ``--out_dir`` (default ``default_out`` in the repository) and ``--fresh``."""
    parser = argparse.ArgumentParser(description=description)
    out = Path(__file__).resolve().parents[2] / default_out
    parser.add_argument("--out_dir", default=str(out), help=f"output folder (default: {default_out} in the repository)")
    parser.add_argument("--fresh", action="store_true", help="rebuild even if a complete build exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python experiments/demo/stdlib_data.py [--out_dir DIR] [--fresh]``: build (or reuse) the dataset."""
    args = corpus_parser("Build the standard-library docstring dataset of the demo.", DEFAULT_OUT_DIR).parse_args(argv)
    build_stdlib_dataset(args.out_dir, fresh=args.fresh)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
