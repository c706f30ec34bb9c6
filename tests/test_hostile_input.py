"""Configs, values, files and names a user gives: every hostile or mistaken case is refused in one line naming the
file, field or flag (before anything is written or loaded), or read as documented.

- config values: true/false fields take true or false only, every type is read strictly, numbers have ranges and
  NaN or infinity is refused anywhere in a config;
- files: a config, instructions or tasks file in another encoding or giving one key twice, a data line that
  tokenization rejects or that gives a field twice, a path that is a folder where a file belongs or the reverse, a
  model that cannot be loaded, a pickled adapter, a retrieval folder whose ids or grades cannot give a meaningful
  score;
- names that become path components (``--local_task_name``, ``--revision``, ``--model_name``) cannot put a file
  outside ``--output_dir``, and an unreadable, unwritable or misplaced evaluation output folder is refused before
  the model loads;
- a model folder's code never runs unless ``trust_remote_code`` says so (training, evaluation, export);
- the Python API: every keyword annotated ``bool`` takes ``True`` or ``False`` only (``trust_remote_code="false"``
  ran a folder's code), ``encode`` takes a list of texts or pairs, a ``prompt`` is a string and ``truncate_dim`` is
  not beyond the embedding.

References are independent of the code under test: file trees listed before and after, marker files that the
hostile code writes, values and line numbers written literally here, scores of a folder with the meaningless
queries removed by hand, embeddings of the same texts given as a plain list.
"""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import mteb_eval_custom
import numpy as np
import pytest
from _drivers import GOOD, eval_argv, one_line_error, subprocess_env, tiny_run_flags, write_beir
from _drivers import run_flags as flags
from _tiny_data import write_tiny_e5

import llm2vec.dataset
import llm2vec.export
import llm2vec.model_files
from llm2vec import LLM2Vec, training
from llm2vec.arguments import ConfigError, parse_config
from llm2vec.evaluation import mteb_wrapper
from llm2vec.evaluation.benchmark import BenchmarkError, load_benchmark
from llm2vec.evaluation.local_task import local_retrieval_task
from llm2vec.evaluation.mteb_wrapper import InstructionsFileError, LLM2VecMTEBEncoder, evaluate, load_instructions
from llm2vec.model_files import ModelFilesError
from llm2vec.testing import build_tokenizer
from llm2vec.training import main as train_main
from llm2vec.training import run

ROOT = Path(__file__).resolve().parents[1]
eval_main = mteb_eval_custom.main


@pytest.fixture(autouse=True)
def _threads(keep_thread_count):
    """Every test here leaves torch's thread count as it found it."""


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return str(tiny_checkpoints["llama3"])


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def one_line(err: str) -> str:
    """The one line of ``err`` holding ``error:``, with no traceback anywhere."""
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------- config values


BASE = ["--model_name_or_path", "m", "--output_dir", "o"]


def test_booleans_take_true_or_false_only(tmp_path):
    read = {
        "False": False,
        "false": False,
        "FALSE": False,
        "0": False,
        "True": True,
        "true": True,
        "1": True,
    }
    for text, value in read.items():
        config = parse_config("I", BASE + ["--overwrite_output_dir", text, "--query_instructions", text])
        assert config.stage.overwrite_output_dir is value and config.data.query_instructions is value, text
    assert parse_config("I", BASE + ["--disable_tqdm"]).training.disable_tqdm is True  # a flag alone means true
    path = tmp_path / "c.json"
    for raw, value in (("false", False), (False, False), (0, False), ("true", True)):
        path.write_text(json.dumps({"model_name_or_path": "m", "output_dir": "o", "query_instructions": raw}))
        assert parse_config("I", [str(path)]).data.query_instructions is value, raw
    for raw in ("no", "yes", "", 2, None, [True]):
        path.write_text(json.dumps({"model_name_or_path": "m", "output_dir": "o", "query_instructions": raw}))
        with pytest.raises(ConfigError, match=f"{path}: query_instructions"):
            parse_config("I", [str(path)])
    with pytest.raises(ConfigError, match="overwrite_output_dir='nope': a true/false field takes true or false"):
        parse_config("I", BASE + ["--overwrite_output_dir", "nope"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "6.7"], "max_steps=6.7: expected a whole number"),
        (["--max_steps", "ten"], "max_steps='ten': expected a whole number"),
        (["--max_steps", "true"], "max_steps='true': expected a whole number"),
        (["--learning_rate", "fast"], "learning_rate='fast': expected a number"),
        (["--learning_rate", "nan"], "learning_rate=nan: expected a finite number"),
        (["--max_seq_length", "null"], "max_seq_length='null': expected a whole number"),
        (["--max_steps"], "--max_steps is given without a value"),
        (["--seed", "1", "2"], "--seed is given 2 values"),
        (["--template", "5", "--alpha", "0.5"], None),  # a string field keeps "5" as text
    ],
)
def test_every_type_is_read_strictly(argv, message):
    if message is None:
        config = parse_config("I", BASE + argv)
        assert config.model.template == "5" and config.stage.alpha == 0.5
        return
    with pytest.raises(ConfigError) as caught:
        parse_config("I", BASE + argv)
    assert str(caught.value).startswith(f"command line: {message}"), caught.value


@pytest.mark.parametrize(
    "field, value", [("max_steps", 6.7), ("learning_rate", "fast"), ("max_seq_length", None), ("template", 5)]
)
def test_a_json_value_of_the_wrong_type_is_refused(tmp_path, field, value):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_name_or_path": "m", "output_dir": "o", field: value}))
    with pytest.raises(ConfigError, match=f"^{path}: {field}"):
        parse_config("I", [str(path)])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_train_epochs", -1, "num_train_epochs=-1: must be > 0"),
        ("num_train_epochs", 0, "num_train_epochs=0: must be > 0"),
        ("max_steps", 0, "max_steps=0: must be >= 1, or -1"),
        ("max_steps", -5, "max_steps=-5: must be >= 1, or -1"),
        ("per_device_train_batch_size", 0, "per_device_train_batch_size=0: must be >= 1"),
        ("per_device_train_batch_size", -4, "per_device_train_batch_size=-4: must be >= 1"),
        ("gradient_accumulation_steps", 0, "gradient_accumulation_steps=0: must be >= 1"),
        ("learning_rate", -0.001, "learning_rate=-0.001: must be > 0"),
        ("save_steps", 0, "save_steps=0: must be > 0"),
        ("adam_beta2", 1, "adam_beta2=1: must be >= 0 and < 1"),
        ("warmup_steps", -3, "warmup_steps=-3: must be >= 0"),
    ],
)
def test_a_value_out_of_range_is_one_line_before_anything_is_written(assets, tmp_path, capsys, field, value, message):
    out = tmp_path / "run"
    assert train_main("I", flags(assets, out, **{"num_train_epochs": 1, field: value})) == 2
    assert one_line_error(capsys) == f"error: command line: {message}"
    assert not out.exists()


BIG = 10**30


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("per_device_train_batch_size", BIG, f"per_device_train_batch_size={BIG}: must be >= 1 and <= 2147483647"),
        ("max_steps", BIG, f"max_steps={BIG}: must be >= 1 and <= 2147483647, or -1"),
        (
            "gradient_accumulation_steps",
            2**31,
            "gradient_accumulation_steps=2147483648: must be >= 1 and <= 2147483647",
        ),
        ("save_steps", BIG, f"save_steps={BIG}: must be > 0 and <= 2147483647"),
        ("num_train_epochs", 1e30, "num_train_epochs=1e+30: must be > 0 and <= 2147483647"),
        ("max_seq_length", BIG, f"max_seq_length={BIG}: must be >= 8 and <= 2147483647"),
        ("max_seq_length", -BIG, f"max_seq_length={-BIG}: must be >= 8"),
        ("num_threads", BIG, f"num_threads={BIG}: must be >= 1 and <= 1024"),
    ],
)
def test_an_absurd_number_is_refused_by_field_with_its_range(assets, tmp_path, capsys, field, value, message):
    """Measured before this check: num_threads 10**30 ended in a traceback, max_steps 10**30 was refused by the
    disk check for 10**21 TB of checkpoints, and max_seq_length 10**30 trained."""
    out = tmp_path / "run"
    assert train_main("I", flags(assets, out, **{field: value})) == 2
    assert one_line_error(capsys) == f"error: command line: {message}"
    assert not out.exists()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_threads", 5000, "num_threads=5000: must be >= 1 and <= 1024"),
        ("dataloader_num_workers", 5000, "dataloader_num_workers=5000: must be >= 0 and <= 1024"),
    ],
)
def test_more_threads_or_workers_than_any_machine_has_are_refused(field, value, message):
    """Read, not run: without the check, 2**31 - 1 threads abort in the OpenMP runtime (it allocates their stacks)
    and 5000 workers are 5000 processes."""
    with pytest.raises(ConfigError) as caught:
        parse_config("I", BASE + [f"--{field}", str(value)])
    assert str(caught.value) == f"command line: {message}"


@pytest.mark.parametrize(
    "text, where",
    [
        ('"lr_scheduler_kwargs": {"min_lr": NaN}', "lr_scheduler_kwargs.min_lr=nan"),
        ('"lr_scheduler_kwargs": {"min_lr": -Infinity}', "lr_scheduler_kwargs.min_lr=-inf"),
        ('"lr_scheduler_kwargs": {"min_lr": 1e999}', "lr_scheduler_kwargs.min_lr=inf"),
        ('"fsdp_config": {"limits": [1, {"x": NaN}]}', "fsdp_config.limits[1].x=nan"),
        ('"learning_rate": Infinity', "learning_rate=inf"),
    ],
)
def test_nan_or_infinity_anywhere_in_a_config_is_refused(tmp_path, text, where):
    path = tmp_path / "config.json"
    path.write_text('{"model_name_or_path": "m", "output_dir": "o", ' + text + "}")
    with pytest.raises(ConfigError) as caught:
        parse_config("I", [str(path)])
    assert str(caught.value) == f"{path}: {where}: expected a finite number", caught.value
    key, value = text.split(": ", 1)
    with pytest.raises(ConfigError) as caught:
        parse_config("I", BASE + [f"--{json.loads(key)}", value])
    assert str(caught.value) == f"command line: {where}: expected a finite number", caught.value


def test_a_nan_in_the_scheduler_settings_stops_the_run_before_it_trains(assets, tmp_path, capsys):
    """Measured before this check: the run trained at learning rate 0 (transformers' cosine_with_min_lr rate is
    ``max(0, nan)``, which is 0) and exited 0 with a finished model."""
    out = tmp_path / "run"
    argv = flags(assets, out, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr": NaN}')
    assert train_main("I", argv) == 2
    assert one_line_error(capsys) == "error: command line: lr_scheduler_kwargs.min_lr=nan: expected a finite number"
    assert not out.exists()


# -------------------------------------------------------------------------------------------- start-up checks


def tiny_gpt2(path: Path) -> Path:
    """A GPT-2 model (no registered family) whose tokenizer has no chat template to derive a family from."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_tokenizer("llama3")
    tokenizer.chat_template = None
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=64)
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_startup_checks_fail_before_data_and_weights(assets, tmp_path, monkeypatch):
    from llm2vec import training

    def no_build(stage):
        raise AssertionError("the model was loaded before the start-up checks")

    monkeypatch.setattr(training, "model_class", no_build)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="a_file/out: cannot write there"):
        run("I", flags(assets, blocker / "out"))
    with pytest.raises(ConfigError, match="model .*missing_model: no such folder"):
        run("I", flags(assets, tmp_path / "o1", model_name_or_path=tmp_path / "missing_model"))
    with pytest.raises(ConfigError, match="no prompt template for this model: model_type='gpt2'"):
        run(
            "I",
            flags(
                assets,
                tmp_path / "o2",
                model_name_or_path=tiny_gpt2(tmp_path / "gpt2"),
                dataset_file_path=tmp_path / "no_data",
            ),
        )  # before the data is read


def test_a_library_error_caused_by_the_user_is_one_line_and_debug_shows_it(assets, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(assets[0], model)
    os.truncate(model / "model.safetensors", 3000)
    argv = flags((model, assets[1]), tmp_path / "run")
    assert train_main("I", argv) == 2
    err = one_line_error(capsys)
    assert f"cannot load the model {model}" in err and "traceback: " in err, err
    trace = Path(err.split("traceback: ")[1].split(";")[0])
    assert "Traceback" in trace.read_text()
    with pytest.raises(ConfigError, match="cannot load the model"):
        train_main("I", argv + ["--debug"])


# ------------------------------------------------------------------------------------------------- data lines


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def good_line(i: int, **extra) -> str:
    return json.dumps({"query": f"the quick fox {i}", "positive": f"jumps over the dog {i}", **extra})


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"query": "a lone \\ud800 half", "positive": "fine text"}', "field \"query\" holds '\\ud800' at character 7"),
        (good_line(3, instruction=" ".join(["retrieve passages"] * 40)), "leaves no room for text"),
    ],
)
def test_a_line_that_tokenization_rejects_is_found_while_loading(
    assets, tmp_path, monkeypatch, capsys, bad_line, message
):
    """Measured before this check: both lines passed loading and crashed the step that drew them (every resume
    again), with an 80-line traceback and no file:line."""
    data = write_jsonl(
        tmp_path / "mine.jsonl", [good_line(1), good_line(2), bad_line] + [good_line(i) for i in range(4, 9)]
    )

    def no_model(stage):
        raise AssertionError("the weights were loaded before the data was checked")

    monkeypatch.setattr(training, "model_class", no_model)
    argv = flags(assets, tmp_path / "run", dataset_name="jsonl", dataset_file_path=data, max_seq_length=32)
    argv = [a for a in argv if a not in ("--e5_sources", '["nq","fever"]')]
    assert train_main("I", argv) == 2
    err = one_line_error(capsys)
    assert f"{data}:3: " in err and message in err, err


# ------------------------------------------------------------------------------------------------------ paths


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--local_task_name", "../../../../x"),
        ("--local_task_name", ".."),
        ("--local_task_name", "{abs}/x"),
        ("--local_task_name", "a\nb"),
        ("--revision", "../.."),
        ("--revision", ".."),
        ("--revision", "{abs}"),
        ("--model_name", "org/.."),
        ("--model_name", "../x/.."),
        ("--model_name", ".."),
    ],
)
def test_a_name_that_is_no_plain_file_name_is_refused_and_nothing_is_written(model, tmp_path, capsys, flag, value):
    data = write_beir(tmp_path / "data", **GOOD)
    out = tmp_path / "a" / "b" / "out"
    value = value.format(abs=tmp_path / "elsewhere")
    before = tree(tmp_path)
    assert eval_main(eval_argv(model, data, out, flag, value)) == 2
    line = one_line(capsys.readouterr().err)
    assert flag in line and repr(value) in line, line
    assert tree(tmp_path) == before  # nothing written, inside --output_dir or out of it


def test_plain_names_write_inside_output_dir_where_the_printed_path_says(model, tmp_path, capsys):
    data = write_beir(tmp_path / "data", **GOOD)
    out = tmp_path / "a" / "b" / "out"
    before = tree(tmp_path)
    argv = ["--local_task_name", "My.Task-1", "--revision", "v1.0", "--model_name", "my org/tiny model"]
    assert eval_main(eval_argv(model, data, out, *argv)) == 0
    printed = Path(capsys.readouterr().out.split("results: ")[1].strip())
    assert printed == out / "results" / "my_org__tiny_model" / "v1.0"
    assert {"My.Task-1.json", "model_meta.json", "run_settings.jsonl"} <= {p.name for p in printed.iterdir()}
    new = {tmp_path / p for p in tree(tmp_path) - before}
    assert all(out in p.parents or p == out or p in out.parents for p in new), sorted(new)


# ----------------------------------------------------------------------------- the evaluation's output folder


def test_an_output_folder_that_is_a_file_is_refused_before_the_model_loads(tmp_path, capsys):
    data = write_beir(tmp_path / "data", **GOOD)
    (tmp_path / "taken").write_text("a file")
    # the model does not exist: had it been loaded first, the error would be about the model
    for out in (tmp_path / "taken", tmp_path / "taken" / "out"):
        assert eval_main(eval_argv(tmp_path / "no-model", data, out)) == 2
        line = one_line(capsys.readouterr().err)
        assert f"--output_dir {out}: {tmp_path / 'taken'} is a file, not a folder" in line, line


def _without_root_powers() -> list[str]:
    """A prefix that runs a command without the capabilities that let root ignore file permissions."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file permissions cannot be enforced")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


def test_an_unreadable_or_unwritable_output_folder_is_refused_before_the_model_loads(tmp_path):
    data = write_beir(tmp_path / "data", **GOOD)
    locked = {"unwritable": 0o555, "unreadable": 0o333}
    for name, mode in locked.items():
        (tmp_path / name).mkdir()
        (tmp_path / name).chmod(mode)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT / "experiments")!r})
        import mteb_eval_custom
        for name in {list(locked)!r}:
            argv = {eval_argv(tmp_path / "no-model", data, "OUT")!r}
            argv[argv.index("OUT")] = {str(tmp_path)!r} + "/" + name
            print(name, mteb_eval_custom.main(argv), flush=True)
        """
    )
    try:
        proc = subprocess.run(
            [*_without_root_powers(), sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            timeout=300,
        )
    finally:
        for name in locked:
            (tmp_path / name).chmod(0o755)
    assert proc.stdout.split() == ["unwritable", "2", "unreadable", "2"], proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert "Traceback" not in proc.stderr and len(lines) == 2, proc.stderr
    assert f"--output_dir {tmp_path}/unwritable: cannot write in the folder {tmp_path}/unwritable" in lines[0]
    assert f"--output_dir {tmp_path}/unreadable: cannot read the folder {tmp_path}/unreadable" in lines[1]


# ------------------------------------------------------------------------------------------------ remote code


EVIL_CODE = """
from pathlib import Path

Path({marker!r}).write_text("the model folder's code ran")

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel


class EvilConfig(LlamaConfig):
    model_type = "evil_llama"


class EvilModel(LlamaModel):
    config_class = EvilConfig


class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
"""


@pytest.fixture
def evil_model(model, tmp_path):
    """A tiny model folder whose config.json maps the Auto classes to its own code, which writes ``marker``."""
    folder = tmp_path / "evil"
    shutil.copytree(model, folder)
    marker = tmp_path / "code-ran.txt"
    (folder / "evil_code.py").write_text(EVIL_CODE.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evil_llama"  # no class of transformers' own: only the folder's code can load it
    config["auto_map"] = {
        "AutoConfig": "evil_code.EvilConfig",
        "AutoModel": "evil_code.EvilModel",
        "AutoModelForCausalLM": "evil_code.EvilForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def test_a_model_folder_s_code_never_runs_in_training_evaluation_or_export(evil_model, tmp_path):
    """The probe's case: each command gets "y" on standard input, which transformers' prompt would take as a yes.
    The control at the end loads the folder with trust_remote_code=True: its code runs then, so the fixture's
    code is live and its absence above is the refusal's doing."""
    folder, marker = evil_model
    data = write_tiny_e5(tmp_path / "e5", n=8)
    beir = write_beir(tmp_path / "beir", **GOOD)
    commands = {
        "training": ("llm2vec.training", "main", ["I", tiny_run_flags(folder, data, tmp_path / "run", max_steps=1)]),
        "evaluation": ("mteb_eval_custom", "main", [eval_argv(folder, beir, tmp_path / "results")]),
        "export": (
            "export_sentence_transformers",
            "main",
            [["--base_model_name_or_path", str(folder), "--output_dir", str(tmp_path / "st")]],
        ),
    }
    script = textwrap.dedent(
        f"""
        import importlib, os, sys
        sys.path.insert(0, {str(ROOT / "experiments")!r})
        for name, (module, function, args) in {commands!r}.items():
            rc = getattr(importlib.import_module(module), function)(*args)
            print(name, rc, os.path.exists({str(marker)!r}), flush=True)
            print("---", file=sys.stderr, flush=True)
        from llm2vec import LLM2Vec
        try:
            LLM2Vec.load({str(folder)!r}, trust_remote_code=True)
        except Exception:
            pass
        print("trusted", os.path.exists({str(marker)!r}), flush=True)
        """
    )
    proc = answering_yes(script, tmp_path)
    report = proc.stdout.split("\n")
    assert report[:3] == ["training 2 False", "evaluation 2 False", "export 2 False"], proc.stdout + proc.stderr
    for err in proc.stderr.split("---")[:3]:
        line = one_line(err)
        assert f"model {folder}: its config.json names custom code to run" in line, line
        assert "evil_code.EvilModel" in line and "--trust_remote_code" in line, line
    assert report[3] == "trusted True", proc.stdout + proc.stderr


def answering_yes(script: str, tmp_path):
    """``python -c script`` with "y" on standard input to every prompt (transformers' "run the custom code?")."""
    env = subprocess_env(HF_MODULES_CACHE=str(tmp_path / "modules"))
    return subprocess.run(
        [sys.executable, "-c", script], input="y\n" * 20, capture_output=True, text=True, env=env, timeout=600
    )


def test_a_model_folder_named_in_loss_kwargs_runs_no_code(evil_model, model, tmp_path):
    """A model path inside ``loss_kwargs`` (a decoder, a guide) is checked as the base is: a folder whose config names
    code is refused in one line before anything loads, though standard input says "y" to transformers' prompt."""
    folder, marker = evil_model
    data = write_tiny_e5(tmp_path / "e5", n=8)
    argv = tiny_run_flags(model, data, tmp_path / "run", max_steps=1, trainer="sentence_transformers")
    for loss, kwargs in [
        ("DenoisingAutoEncoderLoss", {"decoder_name_or_path": str(folder), "tie_encoder_decoder": False}),
        ("CachedGISTEmbedLoss", {"guide": str(folder)}),
    ]:
        script = (
            f"import sys; from llm2vec.training import main; "
            f"sys.exit(main('II', {argv!r} + ['--loss', {loss!r}, '--loss_kwargs', {json.dumps(kwargs)!r}]))"
        )
        proc = answering_yes(script, tmp_path)
        line = one_line(proc.stderr)
        assert proc.returncode == 2 and not marker.exists(), proc.stderr
        key = "decoder_name_or_path" if "decoder_name_or_path" in kwargs else "guide"
        assert f"loss_kwargs.{key} {folder}: its config.json names custom code to run" in line, line


def test_library_loading_refuses_custom_code_before_running_it(evil_model):
    folder, marker = evil_model
    with pytest.raises(ModelFilesError, match="names custom code to run"):
        LLM2Vec.load(str(folder))
    with pytest.raises(ModelFilesError, match="names custom code to run"):
        LLM2VecMTEBEncoder.from_pretrained(str(folder), instructions={}, devices="cpu")
    assert not marker.exists()


@pytest.mark.parametrize("value", ["false", "no", "0", 0, None])
def test_trust_remote_code_that_is_not_true_or_false_is_refused_before_any_code_runs(evil_model, value):
    """A string is true in Python (``bool("false")``): ``from_pretrained`` passed ``"false"`` on as it was, and
    transformers ran the folder's code. The marker file the code writes is the reference."""
    folder, marker = evil_model
    with pytest.raises(TypeError, match=f"^trust_remote_code={re.escape(repr(value))}: .*takes True or False") as info:
        LLM2Vec.from_pretrained(str(folder), device="cpu", trust_remote_code=value)
    assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match="^trust_remote_code="):
        LLM2VecMTEBEncoder.from_pretrained(str(folder), instructions={}, devices="cpu", trust_remote_code=value)
    assert not marker.exists()


def _boolean_keywords() -> list[tuple[str, object, str]]:
    """``(name, function, keyword)`` for each parameter annotated ``bool`` (or ``bool | None``) of the public Python
    API: ``LLM2Vec``, the export, the mteb wrapper, the data loaders and the model-file checks; read from the
    annotations here, independently of the code under test."""
    functions = {}
    for module in (llm2vec.export, llm2vec.dataset, mteb_wrapper, llm2vec.model_files):
        names = getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")])
        for name in names:
            obj = getattr(module, name)
            if getattr(obj, "__module__", "").startswith("llm2vec") and (
                inspect.isfunction(obj) or inspect.isclass(obj)
            ):
                functions[f"{obj.__module__}.{obj.__qualname__}"] = obj
    functions["llm2vec.llm2vec.LLM2Vec"] = LLM2Vec
    for key, obj in list(functions.items()):
        if inspect.isclass(obj):
            del functions[key]
            for name, member in vars(obj).items():
                member = getattr(member, "__func__", member)  # classmethod, staticmethod
                if inspect.isfunction(member) and (name == "__init__" or not name.startswith("_")):
                    functions[f"{key}.{name}"] = member
    found = []
    for key, function in sorted(functions.items()):
        hints = typing.get_type_hints(inspect.unwrap(function))
        for name, hint in hints.items():
            if name != "return" and (hint is bool or hint == bool | None):
                found.append((key, function, name))
    return found


BOOLEAN_KEYWORDS = _boolean_keywords()


@pytest.mark.parametrize(
    ("name", "function", "keyword"), BOOLEAN_KEYWORDS, ids=[f"{n}:{k}" for n, _, k in BOOLEAN_KEYWORDS]
)
def test_every_boolean_keyword_of_the_python_api_takes_true_or_false_only(name, function, keyword):
    """Each is refused before the function does anything: the other arguments are ``None`` here (``True`` for a
    required true/false one)."""
    hints = typing.get_type_hints(inspect.unwrap(function))
    parameters = inspect.signature(inspect.unwrap(function)).parameters.values()
    required = [p for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional = [None for p in required if p.kind != p.KEYWORD_ONLY]
    keywords = {p.name: True if hints.get(p.name) is bool else None for p in required if p.kind == p.KEYWORD_ONLY}
    for value in ("false", 1, np.bool_(True)):
        with pytest.raises(
            TypeError, match=f"^{keyword}={re.escape(repr(value))}: .*takes True,? (or False|False or None) only"
        ) as info:
            function(*positional, **{**keywords, keyword: value})
        assert "\n" not in str(info.value)


def test_the_boolean_keywords_found_include_the_documented_ones():
    found = {(name.rsplit(".", 1)[-1], keyword) for name, _, keyword in BOOLEAN_KEYWORDS}
    assert {
        ("load", "trust_remote_code"),
        ("load", "merge_peft"),
        ("encode", "normalize_embeddings"),
        ("encode", "show_progress_bar"),
        ("export_sentence_transformers", "overwrite"),
        ("export_sentence_transformers", "trust_remote_code"),
        ("from_pretrained", "accept_other_base"),
        ("evaluate", "raise_error"),
        ("check_model_files", "trust_remote_code"),
        ("load_jsonl", "require_negative"),
    } <= found, sorted(found)


# -------------------------------------------------------------------------------------------- pickled adapter


@pytest.fixture(scope="module")
def pickled_adapter(model, tmp_path_factory):
    """A LoRA adapter of the tiny model saved as adapter_model.bin (a pickle), the way older peft saved them."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    folder = tmp_path_factory.mktemp("pickled") / "adapter"
    body = get_peft_model(AutoModel.from_pretrained(model), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    body.save_pretrained(folder, safe_serialization=False)
    assert (folder / "adapter_model.bin").is_file() and not (folder / "adapter_model.safetensors").exists()
    return folder


def test_a_pickled_adapter_is_refused_in_one_line_wherever_adapters_load(model, pickled_adapter, tmp_path, capsys):
    message = f"adapter {pickled_adapter}: its weights are adapter_model.bin, a pickle"
    with pytest.raises(ModelFilesError, match="a pickle"):
        LLM2Vec.load(model, str(pickled_adapter))

    beir = write_beir(tmp_path / "beir", **GOOD)
    assert eval_main(eval_argv(model, beir, tmp_path / "out", "--peft_model_name_or_path", str(pickled_adapter))) == 2
    assert message in one_line(capsys.readouterr().err)

    data = write_tiny_e5(tmp_path / "e5", n=8)
    argv = tiny_run_flags(
        model, data, tmp_path / "run", stage="II", max_steps=1, lora_r=2, peft_model_name_or_path=pickled_adapter
    )
    assert train_main("II", argv) == 2
    assert message in one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


# -------------------------------------------------------------------------------------------------- encodings


ENCODINGS = [
    ("utf-16", "UTF-16 LE (it starts with that byte order mark)"),
    ("utf-16-le", "UTF-16 or UTF-32 (every other byte is zero)"),
    ("latin-1", "a one-byte encoding such as Latin-1 or Windows-1252"),
]


@pytest.mark.parametrize(("encoding", "looks_like"), ENCODINGS)
def test_a_config_file_in_another_encoding_is_one_line(model, tmp_path, capsys, encoding, looks_like):
    config = tmp_path / "config.json"
    fields = {"model_name_or_path": model, "output_dir": str(tmp_path / "run"), "default_instruction": "Récupérer"}
    config.write_text(json.dumps(fields, ensure_ascii=False), encoding=encoding)
    with pytest.raises(ConfigError) as info:
        parse_config("I", [str(config)])
    assert str(info.value).startswith(f"config file {config}: not UTF-8 (byte "), info.value
    assert f"; it looks like {looks_like}. Save it as UTF-8" in str(info.value), info.value
    assert train_main("I", [str(config)]) == 2
    assert "Save it as UTF-8" in one_line(capsys.readouterr().err)


@pytest.mark.parametrize(("encoding", "looks_like"), ENCODINGS)
def test_instructions_and_tasks_files_in_another_encoding_are_one_line(model, tmp_path, capsys, encoding, looks_like):
    instructions = tmp_path / "instructions.json"
    instructions.write_text(json.dumps({"StdlibDocRetrieval": "Récupérer"}, ensure_ascii=False), encoding=encoding)
    beir = write_beir(tmp_path / "beir", **GOOD)
    argv = eval_argv(model, beir, tmp_path / "out", "--task_to_instructions_fp", str(instructions))
    assert eval_main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--task_to_instructions_fp: instructions file {instructions}: not UTF-8" in line, line
    assert looks_like in line, line

    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps({"categories": [], "tasks": {}, "note": "é"}, ensure_ascii=False), encoding=encoding)
    with pytest.raises(BenchmarkError, match=re.escape(f"tasks file {tasks}: not UTF-8")):
        load_benchmark(tasks)


# ------------------------------------------------------------------------------------------------- path kinds


def test_a_data_path_of_the_wrong_kind_gets_the_right_hint(model, tmp_path, capsys):
    data = write_tiny_e5(tmp_path / "e5", n=8)
    cases = [
        (dict(dataset_name="jsonl"), f"dataset_file_path {data} is a folder; a JSON-lines file is expected here"),
        (
            dict(dataset_file_path=data / "nq.jsonl"),
            f"dataset_file_path {data / 'nq.jsonl'} is a file; dataset_name E5",
        ),
        (dict(validation_file=data), f"validation_file {data} is a folder; a JSON-lines file is expected here"),
    ]
    for fields, message in cases:
        assert train_main("I", tiny_run_flags(model, data, tmp_path / "run", **fields)) == 2
        line = one_line(capsys.readouterr().err)
        assert message in line, line
    assert f"{data / 'fever.jsonl'},{data / 'nq.jsonl'}" in line  # the hint names the files in the folder
    assert not (tmp_path / "run").exists()


def test_evaluation_paths_of_the_wrong_kind_get_the_right_hint(model, tmp_path, capsys):
    beir = write_beir(tmp_path / "beir", **GOOD)
    cases = [
        (["--local_retrieval_dir", str(beir / "corpus.jsonl")], "is a file; give the folder that holds corpus.jsonl"),
        (["--task_to_instructions_fp", str(beir)], f"instructions file {beir} is a folder; give the path of a JSON"),
        (["--tasks_fp", str(beir)], f"tasks file {beir} is a folder; give the path of a JSON file"),
    ]
    for extra, message in cases:
        assert eval_main(eval_argv(model, beir, tmp_path / "out", *extra)) == 2
        line = one_line(capsys.readouterr().err)
        assert message in line, line
    folder_config = tmp_path / "config.json"
    folder_config.mkdir()
    with pytest.raises(ConfigError, match=re.escape(f"config file {folder_config} is a folder")):
        parse_config("I", [str(folder_config)])


# --------------------------------------------------------------------------------------------- duplicate keys


def test_a_config_that_gives_a_field_twice_is_refused(model, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(f'{{"model_name_or_path": "{model}", "output_dir": "o", "alpha": 0.2, "alpha": 0.9}}')
    with pytest.raises(ConfigError, match=re.escape(f"config file {config}: the key 'alpha' is given twice")):
        parse_config("I", [str(config)])
    nested = tmp_path / "nested.json"
    nested.write_text(
        f'{{"model_name_or_path": "{model}", "output_dir": "o", "fsdp_config": {{"min_num_params": 1, '
        '"min_num_params": 2}}'
    )
    with pytest.raises(ConfigError, match="the key 'min_num_params' is given twice"):
        parse_config("I", [str(nested)])


def test_an_instructions_file_that_gives_a_task_twice_is_refused(tmp_path):
    path = tmp_path / "instructions.json"
    path.write_text('{"ArguAna": "Given a claim, find documents", "ArguAna": "Retrieve"}')
    with pytest.raises(InstructionsFileError, match="the key 'ArguAna' is given twice"):
        load_instructions(path)


def test_a_data_line_that_gives_a_field_twice_is_refused(model, tmp_path, capsys):
    data = write_tiny_e5(tmp_path / "e5", n=8)
    with open(data / "nq.jsonl", "a") as f:
        f.write('{"query": "a", "positive": "b", "negative": "c", "query": "d"}\n')
    assert train_main("I", tiny_run_flags(model, data, tmp_path / "run")) == 2
    assert f"{data / 'nq.jsonl'}:9: the key 'query' is given twice" in one_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------------------ retrieval folders


def _with(**changes):
    return {**GOOD, **changes}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (_with(corpus=GOOD["corpus"] + [("d1", "another text")]), r"corpus.jsonl:5: _id 'd1' is also the id of line 2"),
        (_with(queries=GOOD["queries"] + [("q0", "again")]), r"queries.jsonl:5: _id 'q0' is also the id of line 1"),
        (_with(corpus=[(7, "a"), ("7", "b")], qrels=[("q0", "7", 1)]), r"corpus.jsonl:2: _id '7' is also the id"),
        (_with(corpus=[(None, "a")]), r"corpus.jsonl:1: _id None must be a string or an integer"),
        (_with(corpus=[(1.5, "a")]), r"corpus.jsonl:1: _id 1.5 must be a string or an integer"),
        (_with(qrels=GOOD["qrels"] + [("q0", "d0", 2)]), r"qrels.jsonl:5: query 'q0' and document 'd0' are graded"),
        (_with(qrels=[("q0", "d0", 1.5)]), r"qrels.jsonl:1: score 1.5 is not an integer"),
        (_with(qrels=[("q0", "d0", True)]), r"qrels.jsonl:1: score True is not an integer"),
        (_with(qrels=[("q0", "d0", -1)]), r"qrels.jsonl:1: score -1 is negative"),
        (_with(qrels=[("q0", "d0", 0), ("q1", "d1", 0)]), r"qrels.jsonl: no query has a relevant document"),
        (_with(corpus=GOOD["corpus"] + [("d9", 42)]), r"corpus.jsonl:5: text must be a string, got 42"),
    ],
)
def test_a_retrieval_folder_that_cannot_give_a_meaningful_score_is_refused(tmp_path, files, message):
    with pytest.raises(ValueError, match=message):
        local_retrieval_task(write_beir(tmp_path / "beir", **files))


def test_queries_with_nothing_relevant_are_left_out_with_a_warning(model, tmp_path, caplog):
    """A query whose documents are all graded 0, and one without any qrels line, score as if absent: the same
    nDCG@10 as the folder with both queries removed by hand."""
    encoder = LLM2VecMTEBEncoder.from_pretrained(model, instructions={}, devices="cpu", batch_size=4)
    extra = _with(
        queries=GOOD["queries"] + [("zero", "Sort items in place."), ("unjudged", "Join path parts.")],
        qrels=[("q0", "d1", 1), ("q1", "d0", 1), ("q2", "d2", 1), ("q3", "d3", 0), ("q3", "d2", 1), ("zero", "d2", 0)],
    )
    by_hand = _with(queries=GOOD["queries"], qrels=[q for q in extra["qrels"] if q[0] != "zero"])
    scores = []
    for name, files in (("Extra", extra), ("ByHand", by_hand)):
        task = local_retrieval_task(write_beir(tmp_path / name, **files), name=name, instruction="")
        encoder.add_instruction(name, "")
        result = evaluate(encoder, [task], tmp_path / "out", show_progress_bar=False, raise_error=True)
        scores.append(result.task_results[0].get_score())
    assert scores[0] == pytest.approx(scores[1])
    assert 0 < scores[1] < 1  # the wrong qrels of q0 and q1 keep the score off both ends
    assert "2 of 6 queries are left out: 1 without a qrels line, 1 whose documents are all graded 0" in caplog.text


# ----------------------------------------------------------------------------------------------- encode input


@pytest.fixture(scope="module")
def encoder(model):
    return LLM2Vec.from_pretrained(model, device="cpu", max_length=32)


@pytest.mark.parametrize(
    ("sentences", "message"),
    [
        (
            {"a": "first text", "b": "second text"},
            r"^sentences: .*got a mapping \(dict\), whose iteration gives its keys",
        ),
        ({"first text", "second text"}, r"^sentences: .*got a set, which has no order"),
        (b"some text", r"^sentences: .*got bytes, not text; decode it first"),
        (None, r"^sentences: .*got None$"),
        (7, r"^sentences: .*got int 7$"),
        (np.array([1, 2]), r"^sentences: .*got a numpy array of int64 values, not texts$"),
        (["fine", None], r"^input 1 is None"),
        (["fine", b"bytes"], r"^input 1 is bytes, not text; decode it first"),
        (["fine", 3], r"^input 1: expected a text or an \[instruction, text\] pair of strings, got int 3$"),
        ([["instruction", "text", "more"]], r"^input 0: a pair is \[instruction, text\], two strings; got 3 item"),
        ([["instruction", 3]], r"^input 0: the pair's text must be a string, got int 3$"),
        (np.array(["fine", None], dtype=object), r"^input 1 is None"),
    ],
)
def test_encode_refuses_what_is_not_texts_or_pairs(encoder, sentences, message):
    with pytest.raises(TypeError, match=message) as info:
        encoder.encode(sentences, show_progress_bar=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("prompt", [5, b"Retrieve", ["Retrieve", "passages"], {"query": "Retrieve"}])
def test_a_prompt_that_is_not_a_string_is_refused(encoder, prompt):
    for keyword in ("prompt", "prompt_name"):
        with pytest.raises(TypeError, match=f"^{keyword}={re.escape(repr(prompt))}: expected a string") as info:
            encoder.encode(["fine"], show_progress_bar=False, **{keyword: prompt})
        assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match="^prompt="):
        encoder.encode_query(["fine"], prompt=prompt)


def test_an_export_query_instruction_that_is_not_a_string_is_refused(model, tmp_path):
    with pytest.raises(llm2vec.export.ExportError, match=r"^query_instruction=5: expected a string"):
        llm2vec.export.export_sentence_transformers(model, tmp_path / "st", query_instruction=5)
    assert not (tmp_path / "st").exists()


def test_truncate_dim_larger_than_the_embedding_is_refused(model, encoder):
    hidden = encoder.encode("a text", show_progress_bar=False).shape[0]
    message = f"^truncate_dim={hidden + 1}: the model's embeddings have {hidden} dimensions"
    with pytest.raises(ValueError, match=message):
        encoder.encode(["a text"], truncate_dim=hidden + 1, show_progress_bar=False)
    with pytest.raises(ValueError, match=message):
        LLM2Vec.from_pretrained(model, device="cpu", truncate_dim=hidden + 1)
    assert encoder.encode(["a text"], truncate_dim=hidden, show_progress_bar=False).shape == (1, hidden)


def test_encode_reads_numpy_arrays_of_texts_and_pairs_as_lists(encoder):
    texts = ["Open a file.", "Sort a list in place.", "Join two paths."]
    pairs = [["Retrieve the documentation", t] for t in texts]
    as_list = encoder.encode(texts, show_progress_bar=False)
    np.testing.assert_array_equal(encoder.encode(np.array(texts), show_progress_bar=False), as_list)
    pairs_as_list = encoder.encode(pairs, show_progress_bar=False)
    np.testing.assert_array_equal(encoder.encode(np.array(pairs), show_progress_bar=False), pairs_as_list)
    assert not np.allclose(pairs_as_list, as_list)  # the instruction reached the model
    assert encoder.encode(texts[0], show_progress_bar=False).shape == as_list[0].shape  # a str: one vector
