"""The GPU checks of experiments/gpu_check.py.

On CPU: the quick mode runs every check and says SKIP, with the reason, for the two whose subject needs a GPU
(FlashAttention, Liger), never a pass; the script runs where mteb, datasets and flash-attn cannot be imported
(the GPU machine has none of them); two defects planted in packing (sequence boundaries one token late, and
sequences attending across their boundaries) make the per-sequence comparisons fail at the bf16 tolerances
the GPU run uses, while the correct code passes them; the MFU's FLOP count equals a count by hand.

On CUDA each check runs at its GPU size and must pass; a check whose package is missing is reported by pytest
as skipped with the check's reason, not as passed.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import gpu_check  # noqa: E402

from llm2vec import packing  # noqa: E402
from llm2vec.loss import reconstruction  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def statuses(lines: list[str]) -> dict[str, str]:
    return {line.split()[0]: line.split()[1] for line in lines if line.split()[0] in gpu_check.CHECKS}


def test_quick_mode_runs_every_check_on_cpu_and_skips_what_it_cannot_run(capsys):
    assert gpu_check.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("versions: Python ") and f"torch {torch.__version__}" in lines[0]
    for package in ("transformers", "peft", "accelerate", "flash-attn", "liger-kernel"):
        assert f"{package} " in lines[0]
    assert lines[1].startswith("device: CPU")
    assert statuses(lines) == {
        "packed_sdpa": "PASS",
        "packed_flash": "SKIP",
        "stage_I_step": "PASS",
        "stage_II_step": "PASS",
        "anchor_measures": "PASS",
        "liger": "SKIP",
        "stage_I_1b": "PASS",
    }
    text = "\n".join(lines)
    assert "FlashAttention was not run" in text and "Liger's kernel was not run" in text
    assert "tokens/s" in text and "MFU n/a (not a bf16 run)" in text
    assert lines[-1].startswith("5 PASS, 0 FAIL, 2 SKIP")


def test_anchor_measures_fail_when_the_device_batch_is_not_the_reference_batch(monkeypatch):
    """The device side of ``anchor_measures`` measures its own copy of the batches: with the queries' rows
    reversed there (each document then reconstructed from another pair's anchor), the check fails."""
    original = gpu_check.to_device

    def reversed_queries(batch, device):
        moved = original(batch, device)
        if isinstance(moved, dict) and "query" in moved:
            moved["query"] = {k: v.flip(0) for k, v in moved["query"].items()}
        return moved

    monkeypatch.setattr(gpu_check, "to_device", reversed_queries)
    (result,) = gpu_check.run_checks(gpu_check.setting(quick=True), ["anchor_measures"])
    assert result.status == "FAIL" and "q2d" in result.detail.split("failed:")[1], result.line()


def test_a_failing_check_fails_the_command(monkeypatch, capsys):
    """A check whose numbers disagree (here every reference embedding of the plain step made 10 % larger) is
    reported with what failed, counted on the last line, and the command exits 1."""
    original = gpu_check.relative_errors

    def off(got, ref):
        return original(got, ref * 1.1)

    monkeypatch.setattr(gpu_check, "relative_errors", off)
    assert gpu_check.main(["--quick", "--only", "packed_sdpa"]) == 1
    out = capsys.readouterr().out
    assert "packed_sdpa     FAIL" in out and "failed: worst text embedding vs padded sdpa" in out
    assert out.splitlines()[-1].startswith("0 PASS, 1 FAIL, 0 SKIP")


# --------------------------------------------------------------------------- planted defects, bf16 tolerances


def boundaries_one_token_late(call):
    """Packing with each sequence's start moved one token later (the first token of a sequence joins the one
    before it): position ids, and the cu_seq_lens derived from them, are off by one at every boundary."""

    def shifted(decoder, pieces, positions, embeds):
        flat = torch.cat(list(positions))
        starts = (flat == 0).nonzero().flatten().tolist() + [len(flat)]
        if len(starts) < 3:  # one sequence: no boundary
            return call(decoder, pieces, positions, embeds)
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        lengths = [lengths[0] + 1, *lengths[1:-1], lengths[-1] - 1]
        moved = torch.cat([torch.arange(n, device=flat.device) for n in lengths])
        return call(decoder, pieces, list(moved.split([len(p) for p in pieces])), embeds)

    return shifted


def attending_across_boundaries(call):
    """Packing whose position ids never restart: the whole row is one causal sequence, so every sequence attends
    to the ones before it (no block-diagonal mask, cu_seq_lens [0, N])."""

    def leaking(decoder, pieces, positions, embeds):
        n = sum(len(p) for p in pieces)
        flat = torch.arange(n, device=pieces[0].device)
        return call(decoder, pieces, list(flat.split([len(p) for p in pieces])), embeds)

    return leaking


def bf16_on_cpu() -> gpu_check.Setting:
    """The GPU run's tolerances (bf16) at the quick sizes, on CPU with sdpa."""
    return gpu_check.Setting(torch.device("cpu"), torch.bfloat16, "sdpa", True, "test on CPU")


CHECKED = ["packed_sdpa", "stage_I_step", "stage_II_step"]


@pytest.mark.parametrize("check", CHECKED)
def test_correct_packing_passes_at_bf16_tolerances(check):
    result = gpu_check.CHECKS[check](bf16_on_cpu())
    assert result.status == "PASS", result.line()


@pytest.mark.parametrize("defect", [boundaries_one_token_late, attending_across_boundaries])
def test_planted_packing_defects_fail_every_packed_check(monkeypatch, defect):
    planted = defect(packing.packed_call)
    monkeypatch.setattr(packing, "packed_call", planted)  # the encoding calls
    monkeypatch.setattr(reconstruction, "packed_call", planted)  # the reconstruction calls
    for check in CHECKED:
        result = gpu_check.CHECKS[check](bf16_on_cpu())
        assert result.status == "FAIL", result.line()
        assert "embedding" in result.detail.split("failed:")[1], result.line()  # caught text by text


def test_per_sequence_nll_is_read_off_whole_sequences():
    sequences = [(5, 6, 7), (8, 9), (10,)]
    calls = [([8, 9, 5, 6, 7], torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])), ([10, 4], torch.tensor([7.0, 0.0]))]
    got = gpu_check.nll_per_sequence(calls, sequences)
    assert got.tolist() == [3.0, 2.0, 7.0]


# --------------------------------------------------------------------------- MFU


def test_stage_I_flops_equal_torch_flop_counter():
    """The FLOP formula against torch's own counter (``torch.utils.flop_counter``) over a forward and backward of a
    tiny Llama and its LM head on three sequences run one by one, under eager attention (plain matmuls, which the
    counter sees): the matmuls of the layers and the LM head equal 6 x P_body x tokens + 6 x H x V x rows exactly,
    and the attention's batched matmuls are twice the formula's attention term, since eager attention computes
    the full n x n square of which the formula counts the causal half."""
    from torch.utils.flop_counter import FlopCounterMode

    s = gpu_check.setting(quick=True)
    hidden, layers, *_ = gpu_check.QUICK_SIZE
    causal_lm, _ = gpu_check.llama(*gpu_check.QUICK_SIZE, vocab=512, s=s)
    body, vocab = gpu_check.decoder_body(causal_lm), causal_lm.config.vocab_size
    body.set_attn_implementation("eager")
    lengths = [7, 3, 5]
    with FlopCounterMode(display=False) as counter:
        for n in lengths:
            states = body(input_ids=torch.randint(0, vocab, (1, n)), use_cache=False).last_hidden_state
            causal_lm.lm_head(states).sum().backward()  # every position predicts: sum(lengths) target rows
    counted = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    assert set(counted) == {"aten.mm", "aten.bmm"}
    matrices = gpu_check.body_parameters(causal_lm)
    flops = gpu_check.stage_I_flops
    without_attention = flops(matrices, hidden, 0, vocab, lengths, sum(lengths))  # 0 layers: no attention term
    attention = flops(matrices, hidden, layers, vocab, lengths, sum(lengths)) - without_attention
    assert counted["aten.mm"] == without_attention
    assert counted["aten.bmm"] == 2 * attention


def test_a_gpu_name_takes_the_peak_of_its_most_specific_entry_and_an_unknown_one_none():
    """A name that contains two entries of the peak table (an H100 PCIe also contains "H100") takes the entry
    listed first, which is the more specific one; a GPU the table lacks gets no peak, so its MFU reads n/a."""
    names = [name for name, _ in gpu_check.BF16_PEAK_TFLOPS]
    for i, name in enumerate(names):
        for general in names[i + 1 :]:
            if general in name:
                assert gpu_check.peak_tflops(f"NVIDIA {name}") == dict(gpu_check.BF16_PEAK_TFLOPS)[name]
    assert any(general in name for i, name in enumerate(names) for general in names[i + 1 :])
    assert gpu_check.peak_tflops("Tesla T4") is None


# --------------------------------------------------------------------------- the GPU machine as it is

HIDE = """
import sys

HIDDEN = {"mteb", "datasets", "flash_attn", "liger_kernel", "gguf"}


class Hidden:
    # wraps each import finder: the hidden packages are not found, as on a machine without them
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)


sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
"""


def test_quick_mode_runs_without_mteb_datasets_or_flash_attn(tmp_path):
    """The GPU machine has torch, transformers, peft, accelerate and sentence-transformers but no mteb, datasets,
    flash-attn, liger-kernel or gguf, and the repository is not installed there: the script runs from the
    checkout with PYTHONPATH, in a process where those packages cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(HIDE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    probe = "import importlib.util as u; print([u.find_spec(m) is None for m in ('mteb', 'datasets', 'flash_attn')])"
    hidden = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert hidden.stdout.strip() == "[True, True, True]"  # the finder hides them in that process
    command = [sys.executable, "experiments/gpu_check.py", "--quick", "--only", "packed_sdpa", "packed_flash", "liger"]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "flash-attn not installed" in lines[0] and "liger-kernel not installed" in lines[0]
    assert statuses(lines) == {"packed_sdpa": "PASS", "packed_flash": "SKIP", "liger": "SKIP"}
    assert "mteb" not in run.stderr and "datasets" not in run.stderr
    assert lines[-1].startswith("1 PASS, 0 FAIL, 2 SKIP")


# --------------------------------------------------------------------------- on a GPU


@CUDA
@pytest.mark.parametrize("name", list(gpu_check.CHECKS))
def test_gpu_check(name):
    (result,) = gpu_check.run_checks(gpu_check.setting(quick=False), [name])
    if result.status == "SKIP":  # reported by pytest as skipped, with the reason: never as a pass
        pytest.skip(result.line())
    assert result.status == "PASS", result.line()


# --------------------------------------------------------------------------- Liger's arguments


@pytest.mark.parametrize("takes_accum_dtype", [True, False])
def test_liger_loss_sums_in_float32(monkeypatch, takes_accum_dtype):
    """The fused path asks Liger for a summed loss accumulated in float32 where its loss class takes
    ``accum_dtype`` (liger-kernel >= 0.6), and leaves the argument out where it does not. A stand-in module
    records the arguments (Liger itself needs CUDA and Triton)."""
    import types

    from llm2vec.loss import linear_cross_entropy

    made = []

    class Recording:
        def __init__(self, reduction="mean", accum_dtype=None):
            made.append({"reduction": reduction, "accum_dtype": accum_dtype})

        def __call__(self, weight, hidden, targets, bias=None):
            return torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="sum")

    if not takes_accum_dtype:

        class Recording(Recording):  # noqa: F811 - an older Liger: no accum_dtype in the signature
            def __init__(self, reduction="mean"):
                made.append({"reduction": reduction})

    module = types.ModuleType("liger_kernel.transformers")
    module.LigerFusedLinearCrossEntropyLoss = Recording
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", module)
    head = torch.nn.Linear(4, 7, bias=False)
    hidden, targets = torch.randn(3, 4), torch.tensor([1, 6, 0])
    loss = linear_cross_entropy._liger_nll(head, hidden, targets)
    expected = {"reduction": "sum", "accum_dtype": torch.float32} if takes_accum_dtype else {"reduction": "sum"}
    assert made == [expected]
    torch.testing.assert_close(loss, linear_cross_entropy.linear_cross_entropy_sum(hidden, head, targets))


# --------------------------------------------------------------------------- DeepSpeed


@pytest.mark.parametrize(
    "stage,config,field",
    [
        ("I", "train_configs/stage_I/MetaLlama3.1_8b_q2d_d2q.json", "token_budget"),
        ("II", "train_configs/stage_II/MetaLlama3.1_8b_stage1_2000steps_stage2.json", "embedding_token_budget"),
    ],
)
def test_deepspeed_with_a_chunked_step_is_refused_in_one_line(stage, config, field):
    """The chunked steps (Stage I's token budget, Stage II's gradient cache) back-propagate outside DeepSpeed's
    engine, which would scale and step wrongly: the run is refused by the config check, before any data loads,
    naming the field and what to do. (The config is parsed without DeepSpeed, which is not installed here, and
    DeepSpeed's file is set afterwards, as TrainingArguments holds it.)"""
    from llm2vec.arguments import ConfigError, parse_config

    flags = ["--use_cpu", "true", "--fsdp", "false", "--attn_implementation", "sdpa", "--validation_size", "0"]
    parsed = parse_config(stage, [str(ROOT / config), *flags])
    parsed.training.per_device_train_batch_size = parsed.stage.total_batch_size  # one process here
    parsed.training.gradient_accumulation_steps = 1
    parsed.validate()  # without DeepSpeed: fine
    parsed.training.deepspeed = str(ROOT / "train_configs/deepspeed/zero3.json")
    with pytest.raises(ConfigError) as refused:
        parsed.validate()
    message = str(refused.value)
    assert "\n" not in message and f"{field} " in message and "DeepSpeed" in message and f"--{field} 0" in message
    setattr(parsed.stage, field, 0)
    parsed.validate()  # DeepSpeed without the chunked step: accepted
