"""Write docs/configuration.md, the field reference of both stages, from the argument classes' help texts.

python experiments/write_config_docs.py            # rewrite the file
python experiments/write_config_docs.py --check    # exit 1 if the file is out of date (the tests do this)
"""

import argparse
import sys
from pathlib import Path

from llm2vec.arguments import markdown_reference

DOCS_FILE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HEADER = (
    "# Configuration reference\n\nGenerated from the argument classes of `llm2vec/arguments.py` by "
    "`python experiments/write_config_docs.py`; do not edit by hand.\n\n"
)


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
