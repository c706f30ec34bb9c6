"""The README's walk for a user's own chat model and data runs as printed, at tiny size.

The walk is the JSON config and the commands between ``<!-- adopter-walk: begin -->`` and
``<!-- adopter-walk: end -->`` in README.md ("Your own model and data"). The test writes the config as
``my_run.json`` into a fresh working folder and runs each command there, in order, as a subprocess, with only
this mapping from the printed walk to tiny size:

- the model id of the config (:data:`README_MODEL`) becomes a tiny random Qwen3 causal LM (2 layers, width 32)
  with Qwen3's published chat template (ChatML, with the thinking switch), built offline;
- ``data/my_pairs`` and ``data/NanoNQ`` are not replaced: the test writes a tiny ``save_to_disk`` folder
  (columns ``anchor``, ``positive``) and a tiny BEIR-layout folder at those very paths;
- ``experiments/`` is a link to the checkout's, so the printed script paths work from the working folder;
- ``python`` is this interpreter;
- each training command gets :data:`TINY_FLAGS` appended: smaller values of fields of ``my_run.json`` (steps,
  batch, evaluation interval, length, no bf16 on CPU), which a flag overrides, and CPU run settings the walk does
  not give. None of them is a flag of a printed command (a flag given twice is refused), so the printed flags
  all reach the drivers as written. The export and the evaluation run exactly as printed.

A printed command that fails, a flag renamed in the code or in the README, or a step that does not leave what
the next one reads (the Stage I model, the Stage II adapter, the export folder, an mteb result with nDCG@10)
fails the test.
"""

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers")

from _chat_families import save_chat_checkpoint  # noqa: E402
from _drivers import subprocess_env  # noqa: E402
from _tiny_data import write_tiny_beir, write_tiny_e5  # noqa: E402

from llm2vec.retrieval import split_log_key  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README_MODEL = "Qwen/Qwen3-1.7B"
TINY_FLAGS = [
    # fields of my_run.json, at tiny size
    "--stop_after_n_steps", "2",
    "--per_device_train_batch_size", "4",
    "--eval_steps", "2",
    "--max_seq_length", "64",
    "--bf16", "false",
    # CPU run settings the walk leaves to their defaults
    "--use_cpu", "true",
    "--num_threads", "1",
    "--disable_tqdm", "true",
    "--dataloader_num_workers", "0",
]  # fmt: skip
TRAINING = ("run_stage_I.py", "run_stage_II.py")
STEPS = [
    "run_stage_I.py",
    "run_stage_II.py",
    "run_stage_II.py",
    "export_sentence_transformers.py",
    "mteb_eval_custom.py",
]


def walk() -> tuple[str, list[list[str]]]:
    """The README's walk: the config's JSON text and the commands, each as its words (comments dropped, lines
    continued with a backslash joined)."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(r"<!-- adopter-walk: begin -->\n(.*?)<!-- adopter-walk: end -->", text, flags=re.S)
    assert len(found) == 1, "README.md needs exactly one adopter-walk block"
    blocks = dict((lang, body) for lang, body in re.findall(r"```(json|bash)\n(.*?)```", found[0], flags=re.S))
    assert set(blocks) == {"json", "bash"}, "the walk is one JSON config and one bash block"
    lines = [line for line in blocks["bash"].replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#")]
    return blocks["json"], [shlex.split(line) for line in lines if line.strip()]


def flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def log_history(folder: Path) -> list[dict]:
    return json.loads((folder / "trainer_state.json").read_text())["log_history"]


def test_readme_adopter_walk_runs_as_printed_from_own_chat_model_to_mteb_score(tmp_path):
    config_text, commands = walk()
    config = json.loads(config_text)
    assert [Path(c[1]).name for c in commands] == STEPS, [c[:2] for c in commands]
    assert all(c[0] == "python" for c in commands)
    assert "stage" not in config and config["dataset_name"] == "hf" and config["model_name_or_path"] == README_MODEL
    sizes = TINY_FLAGS[: TINY_FLAGS.index("--use_cpu")]
    assert all(name[2:] in config for name in sizes[::2]), "a size override names a field of my_run.json"
    printed = {w for c in commands for w in c if w.startswith("--")}
    assert not printed & set(TINY_FLAGS[::2]), "an override may not repeat a printed flag"

    work = tmp_path / "work"
    work.mkdir()
    (work / "experiments").symlink_to(ROOT / "experiments")
    model = save_chat_checkpoint("qwen3", tmp_path / "qwen3")
    (work / "my_run.json").write_text(config_text.replace(f'"{README_MODEL}"', json.dumps(str(model))))
    import datasets

    rows = [json.loads(line) for line in (write_tiny_e5(tmp_path / "rows", n=16, sources=("qa",)) / "qa.jsonl").open()]
    datasets.Dataset.from_dict(
        {"anchor": [r["query"] for r in rows], "positive": [r["positive"] for r in rows]}
    ).save_to_disk(str(work / config["dataset_file_path"]))
    (beir,) = config["retrieval_eval_dirs"]
    write_tiny_beir(work / beir, queries=8, documents=24)
    folder = Path(beir).name

    times, stage_II_names = [], []
    for words in commands:
        script = Path(words[1]).name
        argv = [sys.executable, *words[1:], *(TINY_FLAGS if script in TRAINING else [])]
        start = time.monotonic()
        done = subprocess.run(argv, cwd=work, env=subprocess_env(), capture_output=True, text=True, timeout=600)
        times.append(f"{script} {time.monotonic() - start:.1f} s")
        assert done.returncode == 0, f"{shlex.join(words)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"

        if script == "run_stage_I.py":  # the Stage I model, with the template derived from the chat template
            out = work / config["output_dir"]
            assert (out / "model.safetensors").is_file()
            assert json.loads((out / "llm2vec_config.json").read_text())["template"] == "chat_template"
            scored = [h["step"] for h in log_history(out) if f"eval_{folder}_ndcg_at_10" in h]
            assert scored == [0, 2], log_history(out)
        elif script == "run_stage_II.py":  # a Stage II adapter, the folder scored during training
            out = work / flag(words, "--output_dir")
            assert (out / "adapter_model.safetensors").is_file() and (out / "llm2vec_config.json").is_file()
            logged = {k for h in log_history(out) for k in h if split_log_key(k)}
            assert f"eval_{folder}_ndcg_at_10" in logged, log_history(out)
            stage_II_names.append(logged)  # both trainers: the same names
        elif script == "export_sentence_transformers.py":
            out = work / flag(words, "--output_dir")
            assert (out / "export_complete.json").is_file()
            prompts = json.loads((out / "config_sentence_transformers.json").read_text())["prompts"]
            assert config["default_instruction"] in prompts["query"]  # the instruction the run trained with
        else:  # an mteb result of the local folder, with its main score
            (result,) = (work / flag(words, "--output_dir")).rglob(f"{flag(words, '--local_task_name')}.json")
            assert "export__" in str(result.relative_to(work))  # it scored the export
            (scores,) = json.loads(result.read_text())["scores"]["test"]
            assert 0 <= scores["ndcg_at_10"] <= 1 and scores["main_score"] == scores["ndcg_at_10"]
    assert len(stage_II_names) == 2 and stage_II_names[0] == stage_II_names[1], stage_II_names
    print("; ".join(times))  # shown with -s
