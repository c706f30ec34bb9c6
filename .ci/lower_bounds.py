"""Print setup.py's lower bounds as exact pins, one ``name==version`` a line: a pip constraints file.

    python .ci/lower_bounds.py > lower.txt && pip install -c lower.txt -e ".[test]"

installs the package at the lowest versions it declares (what ``.ci/run`` tests beside the newest releases).
Every requirement of ``install_requires`` and of every extra is read from ``setup.py`` itself (its source, not
run), so the bounds are stated once; a requirement without a ``>=`` bound is an error.

``python .ci/lower_bounds.py --check`` instead prints the installed versions and fails unless each installed
requirement is at exactly its bound (a resolver that quietly took a newer release would test nothing); the CUDA
only extras (flash-attn, liger-kernel) are absent on CPU and skipped.
"""

import ast
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "setup.py"
REQUIREMENT = re.compile(r"^([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.+-]*)$")


def requirements(source: str) -> list[str]:
    """The strings of ``install_requires`` and ``extras_require`` in the ``setup(...)`` call of ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg in ("install_requires", "extras_require"):
            value = ast.literal_eval(node.value)
            groups = value.values() if isinstance(value, dict) else [value]
            found += [r for group in groups for r in group]
    return found


def pins(source: str) -> list[str]:
    """``name==version`` for each requirement ``name>=version`` (each name once)."""
    out = {}
    for requirement in requirements(source):
        match = REQUIREMENT.match(requirement.replace(" ", ""))
        if not match:
            raise SystemExit(f"setup.py: requirement {requirement!r} has no lower bound of the form name>=version")
        name, version = match.groups()
        if out.setdefault(name.lower(), version) != version:
            raise SystemExit(f"setup.py: {name} has two lower bounds, {out[name.lower()]} and {version}; give one")
    return [f"{name}=={version}" for name, version in sorted(out.items())]


def check(pinned: list[str]) -> int:
    """Print each pinned package's installed version; 1 if one differs from its pin, else 0."""
    wrong, seen = [], []
    for pin in pinned:
        name, wanted = pin.split("==")
        try:
            got = version(name)
        except PackageNotFoundError:
            continue
        seen.append(f"{name} {got}")
        if got.split("+")[0] != wanted:  # a local tag (2.11.0+cu130) is the same release
            wrong.append(f"{name} {got} (its bound is {wanted})")
    print("installed:", ", ".join(seen))
    if wrong:
        print("not at the lower bound: " + ", ".join(wrong), file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    pinned = pins(SETUP.read_text(encoding="utf-8"))
    if sys.argv[1:] == ["--check"]:
        sys.exit(check(pinned))
    sys.stdout.write("".join(p + "\n" for p in pinned))
