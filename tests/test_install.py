"""The package works installed, without the repository: a regular (not editable) install into a fresh
virtual environment, used from another folder, evaluates a model through ``llm2vec.evaluation``.

The wheel is built with the running environment's own pip and setuptools (``pip wheel --no-build-isolation``:
nothing is downloaded), so the test behaves alike in a fresh ``python -m venv`` set up as the README says and
in a system interpreter. It is installed into a new, empty virtual environment, which reaches the running
environment's dependencies (torch, transformers, mteb) through a ``.pth`` file that lists its site-packages
folders. Those folders are added as plain paths: their own ``.pth`` files, an editable install of the
checkout among them, are not run, so only the wheel can provide ``llm2vec``. The wheel is built from a copy of
the repository in ``tmp_path``, because building writes ``build/`` and ``*.egg-info`` next to ``setup.py`` and
the checkout must stay untouched.

Also: no file of the package names the repository's folders (or finds the
repository root as ``Path(__file__).parents[2]``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "llm2vec"
FORBIDDEN = ("cache/", "test_configs", "experiments", "parents[2]")

# Runs with the environment's interpreter, in a folder outside the repository. argv: the folders that must
# not provide any imported module (the checkout, its copy), the working folder.
SNIPPET = r'''
import json, math, sys
from importlib.metadata import distribution
from pathlib import Path

checkouts = [Path(p).resolve() for p in sys.argv[1:-1]]
work = Path(sys.argv[-1])

import llm2vec
from llm2vec.evaluation import benchmark, tables  # noqa: F401 -- every module of the package is installed
from llm2vec.evaluation.local_task import local_retrieval_task
from llm2vec.evaluation.mteb_wrapper import LLM2VecMTEBEncoder, evaluate
from llm2vec.testing import save_tiny_model

TEXTS = ["Return the number of items in a container.", "Open a file and read its lines.",
         "Paris is the capital of France.", "The quick brown fox jumps over the lazy dog.",
         "Embeddings are vectors that capture meaning.", "Large language models are trained on text."]
PAIRS = {"qa": 3, "qb": 0, "qc": 5, "qd": 1}  # query id -> the document whose text the query repeats


def write_beir(folder, relevant):
    """Documents d0..d5; query q repeats the text of document PAIRS[q] and is judged relevant to relevant[q]."""
    folder.mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "title": "", "text": t}) + "\n"
                                                 for i, t in enumerate(TEXTS)))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": TEXTS[d]}) + "\n"
                                                  for q, d in PAIRS.items()))
    (folder / "qrels.jsonl").write_text("".join(json.dumps({"query-id": q, "corpus-id": f"d{d}", "score": 1}) + "\n"
                                                for q, d in relevant.items()))


model = save_tiny_model("llama3", work / "tiny-llama3")
write_beir(work / "oracle", PAIRS)
shifted = {q: (d + 1) % len(TEXTS) for q, d in PAIRS.items()}
write_beir(work / "shifted", shifted)
names = {"OracleRetrieval": work / "oracle", "ShiftedRetrieval": work / "shifted"}
encoder = LLM2VecMTEBEncoder.from_pretrained(str(model), instructions={name: "" for name in names},
                                             devices="cpu", batch_size=4)
tasks = [local_retrieval_task(folder, name=name) for name, folder in names.items()]
evaluate(encoder, tasks, work / "mteb", show_progress_bar=False, raise_error=True)
folder = encoder.results_folder(work / "mteb")
scores = {name: json.loads((folder / f"{name}.json").read_text())["scores"]["test"][0]["ndcg_at_10"]
          for name in names}

# nDCG@10 of the shifted qrels computed here from the embeddings: one relevant document per query, 6 documents
docs = encoder.encode_items([["", t] for t in TEXTS], show_progress_bar=False)
queries = encoder.encode_items([["", TEXTS[d]] for d in PAIRS.values()], show_progress_bar=False)
docs /= (docs ** 2).sum(1, keepdims=True) ** 0.5
queries /= (queries ** 2).sum(1, keepdims=True) ** 0.5
gains = []
for row, q in zip(queries @ docs.T, PAIRS):
    rank = 1 + sum(1 for s in row if s > row[shifted[q]])
    gains.append(1 / math.log2(rank + 1))

loaded = sorted({str(Path(m.__file__).resolve()) for m in list(sys.modules.values())
                 if getattr(m, "__file__", None)
                 and any(Path(m.__file__).resolve().is_relative_to(c) for c in checkouts)})
print(json.dumps({
    "llm2vec_file": llm2vec.__file__,
    "direct_url": json.loads(distribution("llm2vec").read_text("direct_url.json") or "{}"),
    "scores": scores,
    "shifted_expected": sum(gains) / len(gains),
    "modules_from_checkout": loaded,
}))
'''


def _clean_env() -> dict[str, str]:
    """This environment without anything that would put the checkout on the path or reach the network."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(
        PYTHONNOUSERSITE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _run(cmd: list[str], cwd: Path, timeout: int) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _copy_checkout(dest: Path) -> Path:
    """The repository's files as a fresh clone has them (no .git, caches or build outputs)."""
    top_level = {".git", "cache", "output", "results", "build", "dist"}

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in ("__pycache__", ".pytest_cache") or n.endswith(".egg-info")}
        return skip | (top_level & set(names) if Path(folder) == REPO else set())

    return Path(shutil.copytree(REPO, dest, ignore=ignore))


def test_no_package_file_names_the_repository_folders():
    offenders = []
    for path in sorted(PACKAGE.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        for line_no, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            if any(word in line for word in FORBIDDEN):
                offenders.append(f"{path.relative_to(REPO)}:{line_no}: {line.strip()}")
    assert not offenders, "the package must not name the repository's folders:\n" + "\n".join(offenders)


def _site_folders() -> list[str]:
    """The running environment's site-packages folders (a venv's own, or a system interpreter's several)."""
    import site

    folders = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return [f for f in dict.fromkeys(folders) if Path(f).is_dir() and not Path(f).resolve().is_relative_to(REPO)]


def test_non_editable_install_evaluates_outside_the_checkout(tmp_path):
    source = _copy_checkout(tmp_path / "source")
    work = tmp_path / "work"
    work.mkdir()
    # the wheel, with this environment's pip and setuptools (no isolated build environment to download);
    # setuptools has bdist_wheel built in since 70.1, and torch 2.13 requires setuptools >= 77.0.3
    import importlib.util

    assert importlib.util.find_spec("wheel") or importlib.util.find_spec("setuptools.command.bdist_wheel"), (
        f"{sys.executable} cannot build wheels: pip install 'setuptools>=70.1' (or wheel) in this environment"
    )
    wheels = tmp_path / "wheels"
    build = ["wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)]
    _run([sys.executable, "-m", "pip", *build], work, 180)
    (wheel,) = wheels.glob("llm2vec-*.whl")

    # a new, empty environment (no pip of its own) that sees this one's dependencies, not their .pth files
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_packages = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work, 60).strip()
    )
    assert site_packages.is_relative_to(venv)
    (site_packages / "running_environment.pth").write_text("".join(f + "\n" for f in _site_folders()))
    # pip itself comes from the running environment; --ignore-installed: its llm2vec (an editable install of
    # the checkout, say) is neither uninstalled nor taken as already satisfying the wheel
    _run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
        work,
        180,
    )
    installed = site_packages / "llm2vec"
    # a regular install: every module of the package copied into the environment
    assert sorted(p.relative_to(installed) for p in installed.rglob("*.py")) == sorted(
        p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
    )
    # and the published facts and chat templates that llm2vec.testing reads
    published = sorted(p.name for p in (PACKAGE / "published").iterdir())
    assert sorted(p.name for p in (installed / "published").iterdir()) == published and "models.json" in published

    (tmp_path / "check_install.py").write_text(SNIPPET)
    out = _run([str(python), str(tmp_path / "check_install.py"), str(REPO), str(source), str(work)], work, 240)
    report = json.loads(out.strip().splitlines()[-1])

    # the environment's copy wins over the checkout (and over an editable install of it, if the system has one)
    assert Path(report["llm2vec_file"]).resolve() == (installed / "__init__.py").resolve()
    assert not report["direct_url"].get("dir_info", {}).get("editable", False)
    assert report["modules_from_checkout"] == []
    # the oracle: each query is the text of its relevant document, no instruction on either side
    assert report["scores"]["OracleRetrieval"] == pytest.approx(1.0)
    shifted = report["scores"]["ShiftedRetrieval"]
    assert isinstance(shifted, float) and shifted < 0.9
    assert shifted == pytest.approx(report["shifted_expected"], abs=1e-4)
