"""Write docs/configuration.md, the field reference of both stages, from the argument classes' help texts.

python experiments/write_config_docs.py            # rewrite the file
python experiments/write_config_docs.py --check    # exit 1 if the file is out of date (the tests do this)
"""

import argparse
import json
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from llm2vec.arguments import DataArguments, ModelArguments, StageIArguments, StageIIArguments

DOCS_FILE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HEADER = (
    "# Configuration reference\n\nGenerated from the argument classes of `llm2vec/arguments/` by "
    "`python experiments/write_config_docs.py`; do not edit by hand.\n\n"
)


def markdown_reference() -> str:
    """The field reference of both stages as Markdown (``docs/configuration.md`` is generated from this)."""
    lines = [
        "A config is a JSON object of these fields; the same fields work as command-line flags "
        "(`--field value`), and flags after a JSON file override it. Any field of "
        "[transformers' `TrainingArguments`](https://huggingface.co/docs/transformers/main_classes/trainer"
        "#transformers.TrainingArguments) is accepted too (optimiser, schedule, batch, precision, saving).",
        "",
    ]
    sections = [
        (ModelArguments, "both stages"),
        (DataArguments, "both stages"),
        (StageIArguments, "Stage I only"),
        (StageIIArguments, "Stage II only"),
    ]
    for cls, scope in sections:
        lines += [
            f"## `{cls.__name__}` ({scope})",
            "",
            (cls.__doc__ or "").strip(),
            "",
            "| field | default | allowed | meaning |",
            "|---|---|---|---|",
        ]
        for f in fields(cls):
            if f.name.startswith("_"):
                continue
            default = f.default if f.default_factory is MISSING else f.default_factory()
            default = "required" if default is MISSING else json.dumps(default)
            allowed = ", ".join(f"`{c}`" for c in f.metadata.get("choices", ()))
            lines.append(f"| `{f.name}` | `{default}` | {allowed} | {f.metadata.get('help', '')} |")
        lines.append("")
    return "\n".join(lines)


def render() -> str:
    return HEADER + markdown_reference() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when they differ")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOCS_FILE.read_text(encoding="utf-8") if DOCS_FILE.is_file() else ""
        if current != text:
            print(f"{DOCS_FILE} is out of date: run python experiments/write_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOCS_FILE.parent.mkdir(parents=True, exist_ok=True)
    DOCS_FILE.write_text(text, encoding="utf-8")
    print(f"wrote {DOCS_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
