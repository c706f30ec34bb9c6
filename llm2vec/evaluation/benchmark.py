"""The paper's MTEB benchmark as data: which tasks, in which category, scored on which split and subset."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .paths import read_input_json

FULL_BENCHMARK = "mteb56"  # the benchmark of all tasks of a tasks file; its subset "15" is "subset15"


class BenchmarkError(ValueError):
    """A tasks file that is missing or malformed, an unknown subset, or a name that is not an mteb task."""


class UnknownTaskError(BenchmarkError):
    """A name that is not an mteb task (``name`` is the name)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Task:
    """One task as the paper counts it, and where its score is read from in an mteb result."""

    name: str
    category: str
    split: str
    hf_subset: str
    main_score: str
    subtasks: tuple[str, ...] = ()  # mteb tasks whose mean is this task's score (CQADupstackRetrieval's)


@dataclass(frozen=True)
class Category:
    name: str
    label: str
    tasks: tuple[Task, ...]


@dataclass(frozen=True)
class Benchmark:
    """Tasks grouped into the paper's categories (empty ones dropped); ``subsets``: subset key -> task names."""

    name: str
    categories: tuple[Category, ...]
    subsets: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def tasks(self) -> tuple[Task, ...]:
        return tuple(task for category in self.categories for task in category.tasks)

    def result_files(self) -> dict[str, Task]:
        """mteb task name -> the paper task it belongs to, for every result file worth reading."""
        files = {}
        for task in self.tasks:
            files[task.name] = task
            files.update({sub: task for sub in task.subtasks})
        return files

    def subset(self, key: str) -> Benchmark:
        """The benchmark restricted to subset ``key`` of the tasks file, named ``subset<key>``."""
        if key not in self.subsets:
            raise BenchmarkError(f"unknown subset {key!r}; choose one of {sorted(self.subsets)}")
        keep = set(self.subsets[key])
        categories = []
        for category in self.categories:
            members = tuple(t for t in category.tasks if t.name in keep)
            if members:
                categories.append(Category(category.name, category.label, members))
        return Benchmark(f"subset{key}", tuple(categories))

    def expand(self, names: Iterable[str]) -> list[str]:
        """mteb task names for ``names``: a task with subtasks becomes them; duplicates are dropped."""
        by_name = {t.name: t for t in self.tasks}
        out: list[str] = []
        for name in names:
            task = by_name.get(name)
            for mteb_name in task.subtasks if task is not None and task.subtasks else (name,):
                if mteb_name not in out:
                    out.append(mteb_name)
        return out


def load_benchmark(tasks_file: str | os.PathLike, subset: str | None = None) -> Benchmark:
    """The tasks of ``tasks_file`` (docs/design.md), or its subset ``subset`` (``"15"``)."""
    path = Path(tasks_file)
    holds = "it lists the tasks, their categories, and the split and subset each is scored on"
    config = read_input_json(path, "tasks file", holds, BenchmarkError)
    try:
        fields = ("category", "split", "hf_subset", "main_score")
        tasks = [
            Task(name, *(spec[f] for f in fields), subtasks=tuple(spec.get("subtasks", ())))
            for name, spec in config["tasks"].items()
        ]
        categories = tuple(
            Category(cat["name"], cat["label"], tuple(t for t in tasks if t.category == cat["name"]))
            for cat in config["categories"]
        )
        subsets = {str(key): tuple(entry["tasks"]) for key, entry in config.get("subsets", {}).items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise BenchmarkError(
            f"tasks file {str(path)!r} is malformed ({type(e).__name__}: {e}); expected "
            '{"categories": [{"name", "label"}, ...], "tasks": {name: {"category", "split", "hf_subset", '
            '"main_score"}}, "subsets": {"15": {"tasks": [...]}}}'
        ) from None
    uncategorised = sorted(t.name for t in tasks if t.category not in {c.name for c in categories})
    if uncategorised:
        raise BenchmarkError(f"tasks file {str(path)!r}: tasks {uncategorised} name a category not in 'categories'")
    unknown = sorted({n for names in subsets.values() for n in names} - {t.name for t in tasks})
    if unknown:
        raise BenchmarkError(f"tasks file {str(path)!r}: subsets name tasks {unknown} that are not in 'tasks'")
    benchmark = Benchmark(FULL_BENCHMARK, tuple(c for c in categories if c.tasks), subsets)
    return benchmark if subset is None else benchmark.subset(subset)


def mteb_tasks(names: Iterable[str], benchmark: Benchmark | None = None) -> list:
    """mteb task objects for ``names``, restricted to the split and hf_subset ``benchmark`` gives (a sub-task its
    parent's); an unknown name raises :class:`UnknownTaskError`."""
    import mteb  # imported late: slow to import

    files = benchmark.result_files() if benchmark is not None else {}
    tasks = []
    for name in names:
        try:
            task = mteb.get_task(name)
        except KeyError as e:
            hint = str(e).strip("\"'").removeprefix("KeyError: ")
            raise UnknownTaskError(name, f"{name!r} is not an mteb {mteb.__version__} task ({hint})") from None
        entry = files.get(name)
        if entry is not None:
            if entry.hf_subset in task.hf_subsets:
                task = task.filter_languages(None, hf_subsets=[entry.hf_subset])
            task = task.filter_eval_splits([entry.split])
        tasks.append(task)
    return tasks
