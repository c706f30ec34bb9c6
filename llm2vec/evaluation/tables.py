"""The paper's MTEB tables, printed from mteb result folders (``<TaskName>.json``, scores in 0-1)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .benchmark import FULL_BENCHMARK, Benchmark, Task
from .paths import read_input_json

AVERAGE = "Average"  # the key of the all-task mean, in the paper's tables and in Run.averages

# Where the paper reports numbers for a (model, row) pair, in order of preference.
CATEGORY_TABLES = {FULL_BENCHMARK: ("table1", "table3"), "subset15": ("table10",)}
PER_TASK_TABLES = ("table14", "table15")


class TableError(ValueError):
    """Bad input; the message names the path or field and says what to do."""


@dataclass(frozen=True)
class Average:
    """A mean over ``n_total`` scores of which ``n_total - len(missing)`` were available."""

    value: float | None
    n_total: int
    missing: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def n_present(self) -> int:
        return self.n_total - len(self.missing)

    @classmethod
    def of(cls, scores: Mapping[str, float | None]) -> Average:
        present = [v for v in scores.values() if v is not None]
        missing = tuple(name for name, v in scores.items() if v is None)
        return cls(sum(present) / len(present) if present else None, len(scores), missing)


@dataclass
class Run:
    """The scores (0-100) found in one result folder, keyed by mteb task name."""

    label: str
    scores: dict[str, float]
    problems: dict[str, str] = field(default_factory=dict)  # mteb task name -> why its result file gave no score

    def task_score(self, task: Task) -> Average:
        """The paper task's score; for one with subtasks their mean (the aggregate file only without any)."""
        parts = task.subtasks
        if not parts or (task.name in self.scores and not any(p in self.scores for p in parts)):
            parts = (task.name,)
        return Average.of({p: self.scores.get(p) for p in parts})

    def averages(self, benchmark: Benchmark) -> dict[str, Average]:
        """Category name (and :data:`AVERAGE`) -> mean over that category's complete tasks."""
        per_task = {}
        for task in benchmark.tasks:
            score = self.task_score(task)
            per_task[task.name] = score.value if score.complete else None
        out = {c.name: Average.of({t.name: per_task[t.name] for t in c.tasks}) for c in benchmark.categories}
        out[AVERAGE] = Average.of(per_task)
        return out


def read_run(folder: str | Path, benchmark: Benchmark, label: str | None = None) -> Run:
    """The ``main_score`` of the task's split and hf_subset of every ``<TaskName>.json`` of the benchmark under
    ``folder`` (:meth:`mteb.TaskResult.from_disk`)."""
    folder = Path(folder)
    label = label or str(folder)
    if not folder.is_dir():
        raise TableError(f"{folder}: no such directory; pass a folder that mteb wrote results into")
    wanted = benchmark.result_files()
    found: dict[str, Path] = {}
    for path in sorted(folder.rglob("*.json")):
        if path.stem not in wanted:
            continue
        if path.stem in found:
            raise TableError(
                f"{folder}: two results for {path.stem} ({found[path.stem]} and {path}); "
                "pass the folder of a single model revision"
            )
        found[path.stem] = path
    if not found:
        raise TableError(
            f"{folder}: no mteb result files for any of the {len(benchmark.tasks)} tasks "
            "(looked for <TaskName>.json in all subfolders); pass the folder mteb.evaluate wrote to"
        )

    from mteb import TaskResult  # imported late: mteb is slow to import and only needed here

    run = Run(label, {})
    for name, path in found.items():
        try:
            result = TaskResult.from_disk(path)
        except Exception as err:  # noqa: BLE001 - any parse failure is a bad input file
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TableError(f"{path}: not a readable mteb result ({first_line}); re-run mteb on it") from err
        task = wanted[name]
        entries = {e["hf_subset"]: e for e in result.scores.get(task.split, [])}
        if task.split not in result.scores:
            run.problems[name] = f"no '{task.split}' split in {path}"
        elif task.hf_subset not in entries:
            run.problems[name] = f"no '{task.hf_subset}' subset of the '{task.split}' split in {path}"
        else:
            run.scores[name] = 100.0 * float(entries[task.hf_subset]["main_score"])
    return run


@dataclass(frozen=True)
class PaperReference:
    """The paper's numbers for one model and row, restricted to one benchmark."""

    label: str
    averages: dict[str, float]  # category name or AVERAGE -> the paper's number
    tasks: dict[str, float]  # paper task name -> the paper's per-task score (Tables 14/15), if reported
    disputed: dict[str, str]  # category name -> note, for Table 1 cells that disagree with the per-task tables


def load_paper_results(paper_file: str | os.PathLike) -> dict:
    """The paper's numbers from a paper-results JSON file (docs/design.md)."""
    path = Path(paper_file)
    paper = read_input_json(path, "paper results file", "it holds the paper's numbers to compare with", TableError)
    if not isinstance(paper, dict) or not {"models", "tables", "known_inconsistencies"} <= set(paper):
        raise TableError(
            f"paper results file {str(path)!r} must be a JSON object with 'models', 'tables' "
            "and 'known_inconsistencies'"
        )
    return paper


def paper_reference(paper: Mapping, model: str, row: str, benchmark: Benchmark) -> PaperReference:
    """``row`` (``"anchor"``, ``"baseline"``, ...) of ``model`` in the paper's tables: category averages from Table 1
    (Table 3 for the Stage I ablations, Table 10 on the 15-task subset), per-task scores from Tables 14/15."""
    tables = paper["tables"]
    models = {m.lower(): m for m in paper["models"]}
    if model.lower() not in models:
        raise TableError(f"--paper-model {model!r}: not a model of the paper; choose one of {paper['models']}")
    model = models[model.lower()]

    def first_with_row(candidates: Iterable[str]) -> tuple[str | None, object]:
        for table in candidates:
            entry = tables[table]["models"].get(model, {}).get(row)
            if entry is not None:
                return table, entry
        return None, None

    category_table, entry = first_with_row(CATEGORY_TABLES.get(benchmark.name, ()))
    averages = dict(entry) if isinstance(entry, Mapping) else ({AVERAGE: entry} if entry is not None else {})
    task_table, entry = first_with_row(PER_TASK_TABLES)
    wanted = {t.name for t in benchmark.tasks}
    tasks = {name: score for name, score in (entry or {}).items() if name in wanted}
    sources = [t for t in (category_table, task_table) if t is not None]
    if not sources:
        searched = CATEGORY_TABLES.get(benchmark.name, ()) + PER_TASK_TABLES
        rows = sorted({r for t in searched for r in tables[t]["models"].get(model, {})})
        if not rows:
            raise TableError(
                f"--paper-model {model!r}: the paper reports no {benchmark.name} numbers for this model; "
                "choose another model or leave out --paper-model"
            )
        raise TableError(
            f"--paper-row {row!r}: the paper reports no such row for {model} on {benchmark.name}; choose one of {rows}"
        )
    disputed = {}
    if category_table == "table1":
        for cell in paper["known_inconsistencies"]["cells"]:
            if cell["model"] == model and cell["row"] == row:
                disputed[cell["column"]] = (
                    f"Table 1 gives {cell['table1']:.2f} but the mean of the paper's per-task scores is "
                    f"{cell['per_task_mean']:.2f} (known_inconsistencies in the paper results file)"
                )
    tables_used = ("Tables " if len(sources) > 1 else "Table ") + ", ".join(t.removeprefix("table") for t in sources)
    return PaperReference(f"Paper ({tables_used}): {model}, {row}", averages, tasks, disputed)


NOT_AVAILABLE = "–"


def _fmt(value: float | None) -> str:
    return NOT_AVAILABLE if value is None or math.isnan(value) else f"{value:.2f}"


def _fmt_average(avg: Average) -> str:
    if avg.value is None:
        return "missing"
    return _fmt(avg.value) + ("" if avg.complete else "*")


def _fmt_diff(ours: Average, paper: float | None) -> str:
    if paper is None or ours.value is None or not ours.complete:
        return NOT_AVAILABLE
    diff = round(ours.value - paper, 2) + 0.0  # + 0.0 turns -0.0 into 0.0
    return f"{diff:+.2f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], align_left: int = 1) -> list[str]:
    align = "|" + "|".join(":---" if i < align_left else "---:" for i in range(len(header))) + "|"
    return ["| " + " | ".join(header) + " |", align, *("| " + " | ".join(row) + " |" for row in rows)]


def _missing_note(avg: Average, what: str) -> str:
    return f"{what} {avg.n_present}/{avg.n_total} (missing: {', '.join(avg.missing)})"


def render_category_table(runs: Sequence[Run], benchmark: Benchmark, paper: PaperReference | None) -> str:
    """Table 1 layout: one column per category plus the all-task average."""
    keys = [c.name for c in benchmark.categories] + [AVERAGE]
    labels = [c.label for c in benchmark.categories] + ["Avg"]
    rows = [["# of datasets"] + [str(len(c.tasks)) for c in benchmark.categories] + [str(len(benchmark.tasks))]]
    if paper is not None:
        rows.append([paper.label] + [_fmt(paper.averages.get(k)) + ("†" if k in paper.disputed else "") for k in keys])
    notes = []
    for run in runs:
        averages = run.averages(benchmark)
        rows.append([f"`{run.label}`"] + [_fmt_average(averages[k]) for k in keys])
        if paper is not None:
            rows.append([f"`{run.label}` − paper"] + [_fmt_diff(averages[k], paper.averages.get(k)) for k in keys])
        incomplete = [_missing_note(averages[k], label) for k, label in zip(keys, labels) if not averages[k].complete]
        if incomplete:
            notes.append(f"\\* `{run.label}` incomplete: " + "; ".join(incomplete) + ".")
    lines = _table(["Model"] + labels, rows)
    if paper is not None:
        label_of = dict(zip(keys, labels))
        notes += [f"† Paper, {label_of[key]}: {note}." for key, note in paper.disputed.items() if key in label_of]
        if benchmark.name != FULL_BENCHMARK:
            notes.append("The paper reports only the overall average on this subset.")
    return "\n".join(lines + ([""] + notes if notes else []))


def render_task_table(runs: Sequence[Run], benchmark: Benchmark, paper: PaperReference | None) -> str:
    """One row per task: each run's score and its difference from the paper's."""
    header = ["Task", "Category"]
    if paper is not None:
        header.append("Paper")
    for run in runs:
        header += [f"`{run.label}`"] + (["Δ"] if paper is not None else [])
    rows, notes = [], []
    for category in benchmark.categories:
        for task in category.tasks:
            row = [task.name, category.label]
            expected = paper.tasks.get(task.name) if paper is not None else None
            if paper is not None:
                row.append(_fmt(expected))
            for run in runs:
                score = run.task_score(task)
                row.append(_fmt_average(score))
                if paper is not None:
                    row.append(_fmt_diff(score, expected))
                if score.value is not None and not score.complete:
                    notes.append(f"\\* `{run.label}`: " + _missing_note(score, task.name) + ".")
            rows.append(row)
    for run in runs:
        notes += [f"`{run.label}`: {name} not scored: {why}." for name, why in sorted(run.problems.items())]
    if paper is not None and not paper.tasks:
        notes.append("The paper gives no per-task scores for this model (Tables 14/15).")
    return "\n".join(_table(header, rows, align_left=2) + ([""] + notes if notes else []))


def render_markdown(runs: Sequence[Run], benchmark: Benchmark, paper: PaperReference | None = None) -> str:
    """Both tables, with a short heading each."""
    title = "MTEB (56 tasks)" if benchmark.name == FULL_BENCHMARK else f"MTEB subset ({len(benchmark.tasks)} tasks)"
    return "\n".join(
        [
            f"## {title}: category averages",
            "",
            "Scores are mteb main scores x 100; `missing` = no result file.",
            "",
            render_category_table(runs, benchmark, paper),
            "",
            f"## {title}: per task",
            "",
            render_task_table(runs, benchmark, paper),
            "",
        ]
    )
