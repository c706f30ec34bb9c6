"""The GPU preset (``experiments/demo/scale.py``) at smoke size on CPU, and the carry of its inputs.

The smoke run goes through every stage of the preset (tiny model, small standard-library corpus): Stage I with the
anchor measures, both Stage II arms, the retrieval evaluation without mteb and the report; its nDCG@10 of the
untrained model is then compared with ``mteb_eval_custom.py`` (mteb's own scoring) on the same folder and model.
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "experiments"), str(REPO)]

from demo import gpu_carry, scale  # noqa: E402
from demo.stdlib_data import build_stdlib_dataset  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    data = root / "data"
    build_stdlib_dataset(data, max_train=32, max_eval_queries=20)
    out = root / "out"
    assert scale.main(["--preset", "smoke", "--data", str(data), "--out", str(out)]) == 0
    return data, out, json.loads((out / "report.json").read_text())


def test_smoke_runs_every_stage_and_reports_them(smoke):
    _, out, report = smoke
    preset = scale.PRESETS["smoke"]
    curve = report["stage_I_curve"]
    assert [r["step"] for r in curve] == list(range(0, preset.stage_I_steps + 1, preset.eval_every))
    assert [r["pairs_seen"] for r in curve] == [r["step"] * preset.global_batch for r in curve]
    for r in curve:
        for m in scale.MEASURES:
            assert f"{m}_q2d" in r and f"{m}_d2q" in r
    for arm in ("stage_II_anchor", "stage_II_baseline"):
        assert (out / arm / "adapter_config.json").is_file()
    assert set(report["evaluation"]) == set(scale.ROWS)
    e = report["evaluation"]
    assert report["differences"]["anchor_minus_baseline"] == e["anchor"]["ndcg_at_10"] - e["baseline"]["ndcg_at_10"]
    # Stage II trained the adapters: the Baseline row is not the untrained model's
    assert e["baseline"] != e["untrained"]
    assert set(report["seconds"]) == {"inputs", "stage_I", "stage_II", "evaluation", "report"}
    text = (out / "report.md").read_text()
    assert "Anchor - Baseline" in text and "| 0 | 0 |" in text


def test_evaluation_without_mteb_equals_mteb_eval_custom(smoke, tmp_path):
    data, out, report = smoke
    pytest.importorskip("mteb")
    import mteb_eval_custom
    from demo.settings import INSTRUCTION, TASK_NAME

    argv = ["--base_model_name_or_path", str(out / "model"), "--local_retrieval_dir", str(data / "eval")]
    argv += ["--local_task_name", TASK_NAME, "--local_instruction", INSTRUCTION, "--output_dir", str(tmp_path)]
    argv += ["--max_length", str(scale.PRESETS["smoke"].max_seq_length), "--device", "cpu"]
    assert mteb_eval_custom.main(argv) == 0
    found = json.loads(next(tmp_path.rglob(f"{TASK_NAME}.json")).read_text())["scores"]["test"][0]
    ours = report["evaluation"]["untrained"]
    assert ours["ndcg_at_10"] == pytest.approx(found["ndcg_at_10"], abs=1e-4)
    assert ours["mrr_at_10"] == pytest.approx(found["mrr_at_10"], abs=1e-4)


def test_carry_parts_reassemble_to_the_file_and_a_damaged_part_is_refused(tmp_path):
    data = tmp_path / "data"
    (data / "eval").mkdir(parents=True)
    (data / "manifest.json").write_text("{}")
    (data / "eval" / "qrels.jsonl").write_text('{"query-id": "q", "corpus-id": "d", "score": 1}\n')
    gguf = tmp_path / "model.gguf"
    payload = bytes(range(256)) * (gpu_carry.PART1_BYTES // 256 + 1000)  # over one part: both parts hold bytes
    gguf.write_bytes(payload)
    wheel = tmp_path / "gguf-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("gguf/__init__.py", "MARK = 1\n")
    gpu_carry.prepare(tmp_path / "carry", data, gguf, wheel)
    assert (tmp_path / "carry" / "part2" / "gguf.part2").stat().st_size == len(payload) - gpu_carry.PART1_BYTES
    joined = gpu_carry.reassemble(tmp_path / "carry", tmp_path / "there" / "joined.gguf")
    assert joined.read_bytes() == payload
    corpus = gpu_carry.unpack_corpus(tmp_path / "carry", tmp_path / "there")
    assert (corpus / "eval" / "qrels.jsonl").read_text() == (data / "eval" / "qrels.jsonl").read_text()
    part2 = tmp_path / "carry" / "part2" / "gguf.part2"
    part2.write_bytes(b"x" + part2.read_bytes()[1:])
    with pytest.raises(gpu_carry.CarryError, match="SHA-256 differs"):
        gpu_carry.reassemble(tmp_path / "carry", tmp_path / "there" / "again.gguf")
