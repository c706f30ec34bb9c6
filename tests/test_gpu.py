"""The GPU checks of experiments/gpu_check.py (issue #19, point 7).

On CUDA each check runs at its GPU size (bf16, flash_attention_2 when installed) and must pass: packed
FlashAttention calls against padded sdpa ones, the Stage I and Stage II steps with the paper configs' settings
against the plain steps, Liger's loss against the blockwise one, and a Stage I step of a 1B-shaped model that
reports its peak memory and throughput. Without CUDA those are skipped; the quick mode (tiny float32 models on
CPU, where every path is exact) runs instead, so the script itself is tested. References: the plain padded
sdpa steps on the same weights, and Liger against the blockwise cross-entropy.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import gpu_check  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_quick_mode_runs_every_check_on_cpu(capsys):
    assert gpu_check.main(["--quick", "--only", "packed_flash", "stage_I_step", "stage_II_step", "liger"]) == 0
    lines = capsys.readouterr().out.splitlines()
    status = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert status == {"packed_flash": "PASS", "stage_I_step": "PASS", "stage_II_step": "PASS", "liger": "SKIP"}


def test_a_failing_check_fails_the_command(monkeypatch, capsys):
    """A check whose numbers disagree (here the plain step's loss made 1 % larger) is reported and exits 1."""
    compare = gpu_check.compare

    def off_by_one_percent(name, s, loss, ref_loss, *rest, **kwargs):
        return compare(name, s, loss, ref_loss * 1.01, *rest, **kwargs)

    monkeypatch.setattr(gpu_check, "compare", off_by_one_percent)
    assert gpu_check.main(["--quick", "--only", "stage_I_step"]) == 1
    assert "stage_I_step   FAIL" in capsys.readouterr().out


@CUDA
@pytest.mark.parametrize("name", list(gpu_check.CHECKS))
def test_gpu_check(name):
    (result,) = gpu_check.run_checks(gpu_check.setting(quick=False), [name])
    assert result.status in ("PASS", "SKIP"), result.line()
