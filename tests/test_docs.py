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
