"""The lower bounds: ``setup.py`` states each dependency's lowest tested version once, ``.ci/lower_bounds.py`` turns
them into exact pins for CI's second environment, and that environment runs the tests that
``tests/lower_bounds.txt`` names (``.ci/run``)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_ONLY = ("flash-attn", "liger-kernel")  # extras that CPU CI cannot install, so never tested there


def helper():
    spec = importlib.util.spec_from_file_location("lower_bounds", ROOT / ".ci" / "lower_bounds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def listed_tests() -> list[str]:
    """The entries of tests/lower_bounds.txt, read as .ci/run reads them (``#`` starts a comment)."""
    lines = (ROOT / "tests" / "lower_bounds.txt").read_text(encoding="utf-8").splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def test_pins_are_the_lower_bounds_of_every_requirement():
    source = (
        'setup(name="x", install_requires=["torch>=2.11.0", "numpy >= 2.2"],\n'
        '      extras_require={"a": ["gguf>=0.19.0"], "b": ["gguf>=0.19.0", "Pytest>=9.0.0"]})'
    )
    assert helper().pins(source) == ["gguf==0.19.0", "numpy==2.2", "pytest==9.0.0", "torch==2.11.0"]


@pytest.mark.parametrize("requirement", ["torch", "torch==2.11.0", "torch<3", "torch>=2.11,<3"])
def test_a_requirement_without_a_plain_lower_bound_is_refused(requirement):
    with pytest.raises(SystemExit, match="no lower bound"):
        helper().pins(f'setup(install_requires=["{requirement}"])')


def test_two_different_bounds_of_one_package_are_refused():
    with pytest.raises(SystemExit, match="two lower bounds"):
        helper().pins('setup(install_requires=["gguf>=0.19.0"], extras_require={"demo": ["gguf>=0.18.0"]})')


def test_the_developer_guide_names_every_tested_bound():
    pins = helper().pins((ROOT / "setup.py").read_text(encoding="utf-8"))
    assert any(p.startswith("torch==") for p in pins) and any(p.startswith("transformers==") for p in pins)
    guide = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    section = guide.split("## Lower bounds", 1)[1].split("\n## ", 1)[0]
    missing = [p for p in pins if p.split("==")[0] not in CUDA_ONLY and p.replace("==", " ") not in section]
    assert not missing, f"docs/development.md's Lower bounds do not name these bounds of setup.py: {missing}"


def test_the_lower_bounds_list_names_existing_test_files():
    tests = listed_tests()
    assert tests and len(tests) == len(set(tests))
    for entry in tests:
        path = ROOT / entry
        assert path.is_file() and path.parent == ROOT / "tests" and path.name.startswith("test_"), entry
    assert "tests/test_compat.py" in tests  # the release-dependent paths themselves
    assert "tests/lower_bounds.txt" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
