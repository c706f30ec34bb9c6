"""The package docstring corpus (experiments/demo/package_data.py): the demo's example layout read from installed
third-party packages, split by module, copies kept once, the same bytes from another process, the installed
versions recorded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from demo import package_data
from demo.package_data import build_package_dataset, public_modules
from demo.stdlib_data import CORPUS_FILE, PROVENANCE_FILE, QUERIES_FILE, STDLIB_MODULES, TRAIN_FILE

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("jinja2", "click", "no_such_package_here")  # small, pure-Python, installed with the test extra


def _read(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("packages") / "data"
    manifest = build_package_dataset(
        out, packages=PACKAGES, eval_target=40, val_target=30, max_eval_queries=25, verbose=False
    )
    return out, manifest


def test_layout_sizes_and_what_was_read(built):
    out, manifest = built
    sizes = manifest["sizes"]
    assert sizes["train"] == len(_read(out / TRAIN_FILE)) > 100
    assert sizes["eval_queries"] == len(_read(out / QUERIES_FILE)) == 25
    assert manifest["skipped_modules"]["no_such_package_here"] == "not installed"
    from importlib.metadata import version

    assert manifest["package_versions"] == {"jinja2": version("jinja2"), "click": version("click")}
    assert manifest["environment"]["distributions"]["jinja2"] == version("jinja2")
    # every example's module belongs to a package that was read
    modules = set(manifest["train_modules"]) | set(manifest["eval_modules"]) | set(manifest["val_modules"])
    assert modules and all(m.split(".")[0] in ("jinja2", "click") for m in modules)


def test_splits_are_disjoint_by_module_and_copies_are_kept_once(built):
    out, manifest = built
    train, evaluation, validation = (set(manifest[k]) for k in ("train_modules", "eval_modules", "val_modules"))
    assert train.isdisjoint(evaluation) and train.isdisjoint(validation) and evaluation.isdisjoint(validation)
    provenance = _read(out / PROVENANCE_FILE)
    assert {p["module"] for p in provenance} == train
    rows = _read(out / TRAIN_FILE) + [
        {"query": q["text"], "positive": c["text"]} for q, c in zip(_read(out / QUERIES_FILE), _read(out / CORPUS_FILE))
    ]
    queries = [" ".join(r["query"].split()).lower() for r in _read(out / TRAIN_FILE)]
    assert len(queries) == len(set(queries))
    bodies = [" ".join(r["positive"].split("\n", 1)[-1].split()).lower() for r in _read(out / TRAIN_FILE)]
    assert len(bodies) == len(set(bodies))
    for row in rows:  # the query is never a copy of its own positive's text
        assert " ".join(row["query"].split()).lower() not in " ".join(row["positive"].split()).lower()


def test_the_same_bytes_from_a_fresh_process_and_the_build_is_reused(built, tmp_path):
    out, manifest = built
    other = tmp_path / "again"
    code = (
        "import sys; sys.path[:0] = [sys.argv[1]]; from demo.package_data import build_package_dataset; "
        "build_package_dataset(sys.argv[2], packages=('jinja2', 'click', 'no_such_package_here'), eval_target=40, "
        "val_target=30, max_eval_queries=25, verbose=False)"
    )
    env = dict(os.environ, PYTHONHASHSEED="777", PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code, str(REPO / "experiments"), str(other)], check=True, env=env)
    for rel in manifest["files"] + ["manifest.json"]:
        assert (out / rel).read_bytes() == (other / rel).read_bytes(), rel
    stamp = (out / "manifest.json").stat().st_mtime_ns
    again = build_package_dataset(
        out, packages=PACKAGES, eval_target=40, val_target=30, max_eval_queries=25, verbose=False
    )
    assert again == manifest and (out / "manifest.json").stat().st_mtime_ns == stamp


def test_public_modules_leave_out_private_and_test_modules():
    names = public_modules("jinja2")
    assert "jinja2" in names and "jinja2.environment" in names
    assert not [n for n in names if any(p.startswith("_") for p in n.split(".")[1:])]


def test_the_standard_library_is_read_whole_less_what_acts_on_import():
    """The stdlib pseudo-package: every public module of the interpreter's standard library (a superset of the
    small demo's hand-picked modules), none private or of a test suite, and none of the packages whose import
    opens a browser, prints, writes into the installation or needs a display."""
    names = public_modules(package_data.STDLIB)
    assert names == sorted(set(names)) and set(STDLIB_MODULES) < set(names)
    assert {"email.mime.text", "xml.etree.ElementTree", "multiprocessing.pool", "json.decoder"} <= set(names)
    assert not [n for n in names if any(p.startswith("_") for p in n.split("."))]
    tops = {n.split(".")[0] for n in names}
    assert not tops & package_data.STDLIB_LEFT_OUT and {"antigravity", "this", "lib2to3", "idlelib"} <= (
        package_data.STDLIB_LEFT_OUT
    )
    assert tops <= set(sys.stdlib_module_names) and "numpy" not in tops


def test_a_standard_library_package_that_does_not_import_is_named_not_fatal(monkeypatch):
    """One package that fails to import (curses without its C part) leaves the rest of the library read; its name
    is kept, so that its reader records the failure in the manifest."""
    real = package_data.public_modules

    def failing(package):
        if package == "curses":
            raise ImportError("No module named '_curses'")
        return real(package)

    monkeypatch.setattr(package_data, "public_modules", failing)
    names = package_data.stdlib_modules()
    assert "curses" in names and "curses.textpad" not in names and "email.mime.text" in names


def test_a_package_whose_reader_fails_is_named_not_fatal(monkeypatch, tmp_path):
    """A package whose child process dies is skipped with the reason in the manifest."""
    real = package_data._collect_in_child

    def failing(package, settings, timeout):
        if package == "click":
            return {"objects": [], "used": [], "skipped": {"click": "the reader exited 1: boom"}}
        return real(package, settings, timeout)

    monkeypatch.setattr(package_data, "_collect_in_child", failing)
    manifest = build_package_dataset(
        tmp_path / "d", packages=("jinja2", "click"), eval_target=20, val_target=20, verbose=False
    )
    assert manifest["skipped_modules"]["click"].endswith("boom")
    assert all(m.startswith("jinja2") for m in manifest["train_modules"])
