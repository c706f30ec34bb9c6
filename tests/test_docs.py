"""docs/configuration.md is generated from the argument classes; it must match them."""

import write_config_docs

from llm2vec.arguments import STAGE_ARGUMENTS, DataArguments, ModelArguments


def test_configuration_reference_is_up_to_date():
    assert write_config_docs.main(["--check"]) == 0, "run python experiments/write_config_docs.py"


def test_every_field_has_help_and_is_in_the_reference():
    from dataclasses import fields

    text = write_config_docs.render()
    for cls in (ModelArguments, DataArguments, *STAGE_ARGUMENTS.values()):
        for f in fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
            assert f"| `{f.name}` |" in text, f.name


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
