"""docs/configuration.md is generated from the argument classes; it must match them."""

import write_config_docs

from llm2vec.arguments import STAGE_ARGUMENTS, DataArguments, ModelArguments


def test_configuration_reference_is_up_to_date():
    assert write_config_docs.main(["--check"]) == 0, "run python experiments/write_config_docs.py"


def test_every_field_has_help_and_the_reference_says_what_the_command_line_accepts():
    """docs/configuration.md read as a reader would: for each stage, its table rows (both stages' and the stage's
    own) are exactly the options that the stage's parser adds to TrainingArguments' (transformers'
    HfArgumentParser, which also prints the drivers' --help), each with argparse's help text and choices."""
    import re
    from dataclasses import fields
    from pathlib import Path

    from transformers import HfArgumentParser, TrainingArguments

    for cls in (ModelArguments, DataArguments, *STAGE_ARGUMENTS.values()):
        for f in fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"

    text = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    documented = {}  # "both stages", "Stage I only", ... -> {field: (allowed, meaning)}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        scope = re.match(r"`\w+` \((.+?)\)", section).group(1)
        rows = re.findall(r"^\| `(\w+)` \| `.*?` \| (.*?) \| (.*) \|$", section, flags=re.M)
        documented.setdefault(scope, {}).update({name: (allowed, meaning) for name, allowed, meaning in rows})
    training = {action.dest for action in HfArgumentParser(TrainingArguments)._actions}
    for stage, own in STAGE_ARGUMENTS.items():
        actions = {}
        for action in HfArgumentParser((ModelArguments, DataArguments, own, TrainingArguments))._actions:
            if action.dest not in training:
                actions.setdefault(action.dest, action)  # a boolean's --no_<field> shares the field's dest
        rows = {**documented["both stages"], **documented[f"Stage {stage} only"]}
        assert set(rows) == set(actions), f"Stage {stage}: documented but not accepted, or accepted but undocumented"
        for name, (allowed, meaning) in rows.items():
            assert meaning == actions[name].help, name
            assert allowed == ", ".join(f"`{c}`" for c in actions[name].choices or ()), name


def test_tests_named_by_the_readme_and_docs_exist():
    """The departures tables name the test that checks each row; a renamed or removed test must not leave a
    dangling reference (README: ``test_file::test_name``; docs/departures.md: ``test_file``: ``test_name``)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    references = re.findall(r"`(test_\w+)::(test_\w+)`", (root / "README.md").read_text())
    for row in (root / "docs" / "departures.md").read_text().splitlines():
        for file, names in re.findall(r"`(test_\w+)`: ((?:`test_\w+`(?:, )?)+)", row):
            references += [(file, name) for name in re.findall(r"`(test_\w+)`", names)]
    assert len(references) > 20
    missing = [
        f"{file}::{name}"
        for file, name in references
        if f"def {name}(" not in (root / "tests" / f"{file}.py").read_text()
    ]
    assert not missing, f"named in the README or docs/departures.md but not defined: {missing}"


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown``: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``; a repeated heading gets ``-1``, ``-2``, ... (fenced code is no heading)."""
    import re

    seen: dict[str, int] = {}
    anchors = set()
    for line in re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S).splitlines():
        heading = re.match(r"#{1,6} +(.+?) *#*$", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_link_of_the_readme_and_docs_reaches_its_file_and_heading():
    """Each relative link ``[text](path#anchor)`` of README.md and docs/*.md names a file or folder that exists and,
    for a Markdown page, a heading of that page; a link within the page (``#anchor``) a heading of its own."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.name}: {target} (no such heading in {file.name})")
    assert checked > 50
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_measured_figure_of_the_readme_is_on_the_page_it_links_to():
    """The README quotes measured numbers and links to the page that holds them with their command and machine:
    every decimal figure (and every number with thousands separators) of a "Measured so far" bullet, and of the
    GPU bullet, appears on the first docs page the bullet links to, so a page updated without its README line (or
    the reverse) fails here."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    section = text.split("## Measured so far")[1].split("\n## ")[0]
    bullets = [b for b in re.split(r"\n(?=- )", section) if b.startswith("- ")]
    bullets.append(re.search(r"\n(- \*\*On a GPU\*\*.*?)(?=\n- )", text, re.S).group(1))
    checked = 0
    for bullet in bullets:
        figures = re.findall(r"(?<![\w.])[-+]?\d[\d,]*\.\d+|(?<![\w.])\d{1,3}(?:,\d{3})+", bullet)
        if not figures:
            continue
        link = re.search(r"\]\((docs/[^)#]+)", bullet)
        assert link, f"a README bullet with measured figures links to no docs page: {bullet[:80]}"
        page = (root / link.group(1)).read_text()
        missing = [f for f in figures if f.lstrip("+-") not in page]
        assert not missing, f"{link.group(1)} does not hold the README's {missing}"
        checked += len(figures)
    assert checked > 10


def test_the_developer_guides_times_of_its_two_commands_are_on_the_pages_it_links_to():
    """The times under the developer guide's two commands (the demo, the suite, CI) are measurements: each of a
    paragraph's durations (``37.2 min``, ``225 s``, ``13 min 21 s``) appears on a docs page the paragraph links to,
    so a stale time (or one measured nowhere) fails here."""
    import re
    from pathlib import Path

    guide = Path(__file__).resolve().parents[1] / "docs" / "development.md"
    section = guide.read_text().split("## The two commands")[1].split("\n## ")[0]
    prose = re.sub(r"```.*?```", "", section, flags=re.S)
    checked = 0
    for paragraph in prose.split("\n\n"):
        figures = re.findall(r"(?<![\w.])\d+(?:\.\d+ min| min \d+ s| s)\b", paragraph.replace("\n", " "))
        if not figures:
            continue
        pages = [(guide.parent / link).read_text() for link in re.findall(r"\]\(([^)#:]+\.md)", paragraph)]
        assert pages, f"a paragraph with measured times links to no docs page: {paragraph[:80]}"
        missing = [f for f in figures if not any(f in page for page in pages)]
        assert not missing, f"no page linked from the paragraph holds {missing}"
        checked += len(figures)
    assert checked >= 5
