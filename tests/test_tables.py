"""Tests of the MTEB table code (llm2vec/evaluation/tables.py), its command line
(experiments/mteb_tables.py) and the data files the command line reads by default.

The main check feeds the paper's per-task scores (Tables 14/15), written as mteb 2.x result files by
mteb's own writer, through the table code and compares the category averages with the paper's Table 1
(and the 15-task averages with Table 10): numbers the code never sees.
"""

from __future__ import annotations

import json
from pathlib import Path

import mteb
import mteb_tables
import pytest
from mteb.cache import ResultCache

from llm2vec.evaluation import tables
from llm2vec.evaluation.benchmark import Benchmark, load_benchmark

CONFIG = mteb_tables.CONFIG_DIR
PAPER = tables.load_paper_results(mteb_tables.DEFAULT_PAPER_FILE)
FULL = load_benchmark(mteb_tables.DEFAULT_TASKS_FILE)
SUBSET = load_benchmark(mteb_tables.DEFAULT_TASKS_FILE, "15")
# Rounding: per-task scores and averages are both printed to 2 decimals.
TOL = 0.0101

# Every (model, row) for which the paper gives per-task scores, and the table holding them.
PER_TASK_ROWS = [
    (table, model, row)
    for table in ("table14", "table15")
    for model, rows in PAPER["tables"][table]["models"].items()
    for row in rows
]


def write_results(root: Path, scores: dict[str, float], benchmark: Benchmark, skip: set[str] = frozenset()):
    """Write 0-100 paper-task scores as mteb result files with mteb's own TaskResult.to_disk.

    The files go where mteb's ResultCache puts them (``results/<model>/<revision>/<Task>.json``).
    CQADupstackRetrieval is written as its 12 sub-forums, spread around the paper's score so that
    only their mean equals it. Returns the folder holding the task files.
    """
    folder = root / "results" / "paper__model" / "rev"
    folder.mkdir(parents=True)
    for task in benchmark.tasks:
        if task.name not in scores:
            continue
        files = {task.name: scores[task.name]}
        if task.subtasks:
            n = len(task.subtasks)
            files = {sub: scores[task.name] + 0.4 * (i - (n - 1) / 2) for i, sub in enumerate(task.subtasks)}
        for name, value in files.items():
            if name in skip:
                continue
            result = mteb.TaskResult.from_task_results(
                mteb.get_task(name), {task.split: {task.hf_subset: {"main_score": value / 100}}}, evaluation_time=0.0
            )
            result.to_disk(folder / f"{name}.json")
    return folder


@pytest.fixture(scope="module")
def paper_runs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """One result folder per (model, row) of Tables 14/15."""
    folders = {}
    for table, model, row in PER_TASK_ROWS:
        scores = PAPER["tables"][table]["models"][model][row]
        folders[model, row] = write_results(tmp_path_factory.mktemp(f"{model}-{row}"), scores, FULL)
    return folders


# --------------------------------------------------------------------------------------------------
# The category mapping reproduces the paper's averages
# --------------------------------------------------------------------------------------------------


def test_per_task_rows_are_the_table1_rows_but_mistral():
    """Tables 14/15 (per-task scores) and Table 1 (category averages) were transcribed apart: the per-task rows are
    every row of Table 1 but Mistral-7B's (the paper gives no per-task Mistral-7B scores), each in one table, so the
    check of Table 1 below leaves out no row that it could check."""
    table1 = {(model, row) for model, rows in PAPER["tables"]["table1"]["models"].items() for row in rows}
    per_task = [(model, row) for _, model, row in PER_TASK_ROWS]
    assert sorted(per_task) == sorted((model, row) for model, row in table1 if model != "Mistral-7B")
    assert len(per_task) == 8  # four models x (baseline, anchor)


@pytest.mark.parametrize(("table", "model", "row"), PER_TASK_ROWS)
def test_table1_category_averages_from_per_task_scores(paper_runs, table, model, row):
    run = tables.read_run(paper_runs[model, row], FULL)
    averages = run.averages(FULL)
    expected = PAPER["tables"]["table1"]["models"][model][row]
    assert set(averages) == set(expected)
    assert all(avg.complete for avg in averages.values())

    off = {key for key, value in expected.items() if abs(averages[key].value - value) > TOL}
    documented = {
        cell["column"]
        for cell in PAPER["known_inconsistencies"]["cells"]
        if cell["model"] == model and cell["row"] == row
    }
    # Every Table 1 cell is reproduced except those documented as the paper's own inconsistencies.
    assert off == documented
    for cell in PAPER["known_inconsistencies"]["cells"]:
        if cell["model"] == model and cell["row"] == row:
            assert averages[cell["column"]].value == pytest.approx(cell["per_task_mean"], abs=0.006)
    # The all-task mean also matches the "Average" line of Tables 14/15.
    assert averages[tables.AVERAGE].value == pytest.approx(PAPER["tables"][table]["average"][model][row], abs=TOL)


def test_documented_inconsistencies_are_the_cells_the_per_task_scores_contradict(paper_runs):
    """The list of the paper's own inconsistencies is exactly the Table 1 cells that the per-task scores, averaged by
    the table code, miss by more than rounding (over every row; the test above checks it row by row), and each
    entry quotes Table 1's value."""
    off = []
    for _, model, row in PER_TASK_ROWS:
        averages = tables.read_run(paper_runs[model, row], FULL).averages(FULL)
        expected = PAPER["tables"]["table1"]["models"][model][row]
        off += [(model, row, key) for key, value in expected.items() if abs(averages[key].value - value) > TOL]
    cells = PAPER["known_inconsistencies"]["cells"]
    assert sorted(off) == sorted((cell["model"], cell["row"], cell["column"]) for cell in cells)
    for cell in cells:
        assert cell["table1"] == PAPER["tables"]["table1"]["models"][cell["model"]][cell["row"]][cell["column"]]


TABLE10_ROWS = [(model, row) for model in PAPER["tables"]["table10"]["models"] for row in ("baseline", "anchor")]


@pytest.mark.parametrize(("model", "row"), TABLE10_ROWS)
def test_subset_average_matches_table10(paper_runs, model, row):
    # Table 10's "Only Stage II" and "Stage I + Stage II" are the 15-task means of Table 14/15's rows.
    averages = tables.read_run(paper_runs[model, row], SUBSET).averages(SUBSET)
    expected = PAPER["tables"]["table10"]["models"][model][row]
    assert averages[tables.AVERAGE].complete
    assert averages[tables.AVERAGE].value == pytest.approx(expected, abs=TOL)


def test_cqadupstack_is_the_mean_of_its_subforums(paper_runs):
    model = "Llama-3.2-1B-Instruct"
    run = tables.read_run(paper_runs[model, "anchor"], FULL)
    task = next(t for t in FULL.tasks if t.name == "CQADupstackRetrieval")
    subforum_scores = [run.scores[s] for s in task.subtasks]
    assert len(set(round(s, 4) for s in subforum_scores)) == 12  # written spread out, not all equal
    assert run.task_score(task).value == pytest.approx(42.78, abs=1e-4)  # Table 14


# --------------------------------------------------------------------------------------------------
# Missing tasks
# --------------------------------------------------------------------------------------------------


def test_missing_tasks_are_shown_and_mark_the_category_incomplete(tmp_path):
    scores = PAPER["tables"]["table14"]["models"]["Llama-3.2-1B-Instruct"]["baseline"]
    folder = write_results(tmp_path, scores, FULL, skip={"MSMARCO", "CQADupstackTexRetrieval"})
    run = tables.read_run(folder, FULL)
    averages = run.averages(FULL)

    retrieval = averages["Retrieval"]
    assert not retrieval.complete
    assert retrieval.n_present == 13 and retrieval.n_total == 15
    assert set(retrieval.missing) == {"MSMARCO", "CQADupstackRetrieval"}
    assert averages[tables.AVERAGE].n_present == 54
    assert averages["Reranking"].complete  # other categories unaffected

    cqa = run.task_score(next(t for t in FULL.tasks if t.name == "CQADupstackRetrieval"))
    assert (cqa.n_present, cqa.n_total, cqa.missing) == (11, 12, ("CQADupstackTexRetrieval",))

    paper = tables.paper_reference(PAPER, "Llama-3.2-1B-Instruct", "baseline", FULL)
    markdown = tables.render_markdown([run], FULL, paper)
    lines = markdown.splitlines()
    msmarco_row = next(line for line in lines if line.startswith("| MSMARCO |"))
    assert "missing" in msmarco_row
    our_row = next(line for line in lines if line.startswith(f"| `{run.label}` |"))
    cells = [c.strip() for c in our_row.strip("|").split("|")]
    assert cells[1].endswith("*") and cells[-1].endswith("*")  # Retr. and Avg incomplete
    assert not cells[2].endswith("*")  # Rerank. complete
    assert "Retr. 13/15 (missing: CQADupstackRetrieval, MSMARCO)" in markdown
    assert "Avg 54/56" in markdown
    assert "CQADupstackRetrieval 11/12 (missing: CQADupstackTexRetrieval)" in markdown
    diff_row = next(line for line in lines if line.startswith(f"| `{run.label}` − paper |"))
    assert [c.strip() for c in diff_row.strip("|").split("|")][1] == tables.NOT_AVAILABLE  # no diff for partial
    assert [c.strip() for c in diff_row.strip("|").split("|")][2] == "+0.00"


def test_wrong_split_is_reported_not_silently_used(tmp_path):
    # Written through mteb's ResultCache, the way mteb.evaluate saves results.
    cache = ResultCache(tmp_path)
    result = mteb.TaskResult.from_task_results(
        mteb.get_task("MSMARCO"), {"test": {"default": {"main_score": 0.4}}}, evaluation_time=0.0
    )
    cache.save_to_cache(result, model_name="m", model_revision="r")
    run = tables.read_run(tmp_path, FULL)
    assert "MSMARCO" not in run.scores
    assert "no 'dev' split" in run.problems["MSMARCO"]


# --------------------------------------------------------------------------------------------------
# The task lists resolve in mteb 2.x (offline: task metadata ships with the package)
# --------------------------------------------------------------------------------------------------

TASKS_JSON = json.loads((CONFIG / "tasks.json").read_text())
INSTRUCTIONS = json.loads((CONFIG / "task_to_instructions.json").read_text())
PAPER_COUNTS = {  # Table 1 / Table 2 header
    "Retrieval": 15,
    "Reranking": 4,
    "Clustering": 11,
    "PairClassification": 3,
    "Classification": 12,
    "STS": 10,
    "Summarization": 1,
}


def test_category_counts_match_the_paper():
    counts = {c.name: len(c.tasks) for c in FULL.categories}
    assert counts == PAPER_COUNTS
    assert {c["name"]: c["n_tasks"] for c in TASKS_JSON["categories"]} == PAPER_COUNTS
    assert len(FULL.tasks) == 56


def test_every_task_resolves_in_mteb_with_the_recorded_split_and_score():
    names = set(TASKS_JSON["tasks"]) | set(INSTRUCTIONS)
    for task in FULL.tasks:
        names.update(task.subtasks)
    resolved = {t.metadata.name for t in mteb.get_tasks(tasks=sorted(names))}
    assert resolved == names
    for task in FULL.tasks:
        for name in (task.name, *task.subtasks):
            meta = mteb.get_task(name).metadata
            assert meta.type == task.category, name
            assert task.split in meta.eval_splits, name
            subsets = meta.hf_subsets_to_langscripts
            assert task.hf_subset in subsets or (task.hf_subset == "default" and not meta.is_multilingual), name
            assert meta.main_score == task.main_score, name
    assert next(t for t in FULL.tasks if t.name == "MSMARCO").split == "dev"


def test_instructions_cover_every_task_and_subforum():
    needed = set(FULL.result_files())
    assert needed <= set(INSTRUCTIONS)
    assert len(needed) == 56 + 12
    assert all(isinstance(v, str) and v.strip() for v in INSTRUCTIONS.values())
    sts = [t.name for t in FULL.tasks if t.category == "STS"]
    assert {INSTRUCTIONS[name] for name in sts} == {"Retrieve semantically similar text"}  # Table 13 "STS*"


def test_subset_of_15_tasks():
    subset = TASKS_JSON["subsets"]["15"]["tasks"]
    assert len(subset) == len(set(subset)) == 15
    assert set(subset) <= set(TASKS_JSON["tasks"])
    counts = {c.name: len(c.tasks) for c in SUBSET.categories}
    assert counts == {
        "Retrieval": 3,
        "Reranking": 2,
        "Clustering": 3,
        "PairClassification": 1,
        "Classification": 3,
        "STS": 3,
    }  # Table 8


def test_per_task_tables_name_the_56_tasks():
    for table in ("table14", "table15"):
        for rows in PAPER["tables"][table]["models"].values():
            for scores in rows.values():
                assert set(scores) == set(TASKS_JSON["tasks"])


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def test_cli_prints_tables_and_writes_output(paper_runs, tmp_path, capsys):
    out = tmp_path / "tables.md"
    folder = paper_runs["Llama-3.2-1B-Instruct", "anchor"]
    rc = mteb_tables.main(
        [str(folder), "--paper-model", "llama-3.2-1b-instruct", "--paper-row", "anchor", "--output", str(out)]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert printed == out.read_text() + "\n"  # print() adds one newline
    assert "| Paper (Tables 1, 14): Llama-3.2-1B-Instruct, anchor | 52.60 | 56.65 |" in printed
    assert "| ArguAna | Retr. | 55.28 | 55.28 | +0.00 |" in printed


def test_cli_subset(paper_runs, capsys):
    folder = paper_runs["Llama-3.2-3B-Instruct", "baseline"]
    rc = mteb_tables.main(
        [str(folder), "--paper-model", "Llama-3.2-3B-Instruct", "--paper-row", "baseline", "--subset", "15"]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert "| # of datasets | 3 | 2 | 3 | 1 | 3 | 3 | 15 |" in printed
    assert "Summ." not in printed


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["{missing}"], "no such directory"),
        (["{empty}"], "no mteb result files"),
        (["{run}", "--paper-model", "GPT-5"], "--paper-model 'GPT-5'"),
        (["{run}", "--paper-model", "Mistral-7B", "--paper-row", "only_q2d"], "--paper-row 'only_q2d'"),
        (["{run}", "--paper-model", "Mistral-7B", "--subset", "15"], "no subset15 numbers"),
        (["{run}", "--subset", "7"], "--subset '7'"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(paper_runs, tmp_path, capsys, args, fragment):
    (tmp_path / "empty").mkdir()
    paths = {
        "missing": tmp_path / "nope",
        "empty": tmp_path / "empty",
        "run": paper_runs["Llama-3.2-1B-Instruct", "anchor"],
    }
    rc = mteb_tables.main([a.format(**paths) for a in args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1
    assert fragment in err
    assert "Traceback" not in err


def test_cli_unreadable_result_file(tmp_path, capsys):
    (tmp_path / "SciFact.json").write_text("{not json")
    rc = mteb_tables.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "SciFact.json" in err and err.count("\n") == 1


def test_disputed_paper_cells_are_marked(paper_runs):
    paper = tables.paper_reference(PAPER, "Qwen2.5-1.5B-Instruct", "baseline", FULL)
    assert set(paper.disputed) == {"PairClassification"}
    run = tables.read_run(paper_runs["Qwen2.5-1.5B-Instruct", "baseline"], FULL)
    markdown = tables.render_markdown([run], FULL, paper)
    paper_row = next(line for line in markdown.splitlines() if line.startswith("| Paper (Tables 1, 14)"))
    assert "| 84.41† |" in paper_row
    assert "† Paper, PairClass.: Table 1 gives 84.41 but the mean of the paper's per-task scores is 82.97" in markdown


def test_cli_reads_the_tasks_and_paper_files_it_is_given(paper_runs, tmp_path, capsys):
    config = json.loads((CONFIG / "tasks.json").read_text())
    config["subsets"]["2"] = {"tasks": ["ArguAna", "STSBenchmark"]}
    tasks_file = tmp_path / "tasks.json"
    tasks_file.write_text(json.dumps(config))
    paper = json.loads((CONFIG / "paper_results.json").read_text())
    paper["tables"]["table14"]["models"]["Llama-3.2-1B-Instruct"]["anchor"]["ArguAna"] = 12.34
    paper_file = tmp_path / "paper.json"
    paper_file.write_text(json.dumps(paper))
    folder = paper_runs["Llama-3.2-1B-Instruct", "anchor"]
    rc = mteb_tables.main(
        [
            str(folder),
            "--tasks-file",
            str(tasks_file),
            "--paper-file",
            str(paper_file),
            "--subset",
            "2",
            "--paper-model",
            "Llama-3.2-1B-Instruct",
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert "| # of datasets | 1 | 1 | 2 |" in printed
    assert "| ArguAna | Retr. | 12.34 | 55.28 | +42.94 |" in printed


@pytest.mark.parametrize(
    ("option", "content", "fragment"),
    [
        ("--paper-file", None, "paper results file"),
        ("--paper-file", "{x", "not valid JSON"),
        ("--paper-file", '{"models": []}', "must be a JSON object with"),
        ("--tasks-file", None, "tasks file"),
        ("--tasks-file", '{"tasks": []}', "malformed"),
    ],
)
def test_cli_bad_data_files_exit_2_with_one_line(paper_runs, tmp_path, capsys, option, content, fragment):
    path = tmp_path / "data.json"
    if content is not None:
        path.write_text(content)
    folder = paper_runs["Llama-3.2-1B-Instruct", "anchor"]
    rc = mteb_tables.main([str(folder), option, str(path), "--paper-model", "Llama-3.2-1B-Instruct"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert fragment in err and str(path) in err
