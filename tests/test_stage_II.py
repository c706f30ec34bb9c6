"""Stage II: InfoNCE loss, the gather across processes, the LoRA model, the driver and the configs."""

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _drivers import nq_run_flags
from _references import stage_II_loss_by_hand
from _stage_II_dist_worker import LR, build_encoder, fox_triples, lora_state, run_gather_rank, run_rank, sgd_step
from _tiny_data import write_tiny_e5

from llm2vec.arguments import StageIIArguments, load_config, parse_config
from llm2vec.llm2vec import LLM2Vec
from llm2vec.loss.infonce import InfoNCELoss

ROOT = Path(__file__).resolve().parents[1]
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------- the loss


def reference_infonce(query, positive, negative, scale):
    """Eq. 6-7 one query at a time: -log softmax over [all positives ; all negatives] at the own positive."""
    candidates = list(positive) + (list(negative) if negative is not None else [])
    losses = []
    for i, q in enumerate(query):
        sims = [scale * F.cosine_similarity(q, d, dim=0) for d in candidates]
        log_denominator = torch.logsumexp(torch.stack(sims), dim=0)
        losses.append(log_denominator - sims[i])
    return torch.stack(losses).mean()


@pytest.mark.parametrize("with_negative", [True, False])
@pytest.mark.parametrize("scale", [20.0, 50.0])
def test_infonce_equals_per_query_loop(with_negative, scale):
    g = torch.Generator().manual_seed(0)
    q, p, n = (torch.randn(6, 16, generator=g) for _ in range(3))
    negative = n if with_negative else None
    loss = InfoNCELoss(scale)(q, p, negative)
    assert torch.allclose(loss, reference_infonce(q, p, negative, scale), atol=1e-5, rtol=0)
    assert InfoNCELoss(scale).scores(q, p, negative).shape == (6, 12 if with_negative else 6)
    # gather=False (the validation loss on embeddings gathered already): the same equation on the given batch
    ungathered = InfoNCELoss(scale)(q, p, negative, gather=False)
    assert torch.allclose(ungathered, reference_infonce(q, p, negative, scale), atol=1e-5, rtol=0)


def test_infonce_correct_pairs_score_lower_than_shuffled():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(8, 32, generator=g)
    p = q + 0.1 * torch.randn(8, 32, generator=g)  # each positive close to its query
    n = torch.randn(8, 32, generator=g)
    loss = InfoNCELoss(20.0)
    shuffled = p[torch.roll(torch.arange(8), 1)]
    assert loss(q, p, n) < loss(q, shuffled, n) - 1.0
    assert loss(q, p, n) < 0.1  # tau = 0.05 separates near-duplicates sharply


def test_infonce_low_precision_inputs_give_float32_loss():
    q, p = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    assert InfoNCELoss()(q, p).dtype == torch.float32


# ---------------------------------------------------------------- data and helpers


def union_batch(encoder, n: int = 4) -> dict:
    from llm2vec.collator import TrainCollator

    return TrainCollator.for_encoder(encoder, with_negative=True)(fox_triples(n, "nq"))


@pytest.fixture(scope="module")
def llama_checkpoint(tiny_checkpoints):
    return str(tiny_checkpoints["llama3"])


# ---------------------------------------------------------------- two processes


def test_gather_backward_equals_a_loop_over_per_rank_losses(tmp_path):
    """Two processes: each rank's loss and the gradients of its embeddings equal those of a one-process loop.

    Rank r's loss covers its own queries against every rank's candidates, so the gradient its positives and
    negatives receive is the sum over ranks of d loss_r' / d e (what the gather's backward all-reduce gives).
    """
    import torch.multiprocessing as mp

    g = torch.Generator().manual_seed(3)
    data = {k: torch.randn(6, 8, generator=g) for k in ("query", "positive", "negative")}
    torch.save(data, tmp_path / "data.pt")
    mp.spawn(
        run_gather_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "data.pt"), str(tmp_path)), nprocs=2, join=True
    )
    ranks = [torch.load(tmp_path / f"gather{r}.pt") for r in range(2)]

    union = {k: v.clone().requires_grad_(True) for k, v in data.items()}
    per_rank = []
    for r in range(2):  # rank r's queries are rows 3r..3r+2; their candidates are all positives and negatives
        rows = slice(3 * r, 3 * r + 3)
        candidates = [union["positive"], union["negative"]]
        losses = []
        for i, q in zip(range(rows.start, rows.stop), union["query"][rows]):
            sims = torch.stack([20.0 * F.cosine_similarity(q, d, dim=0) for c in candidates for d in c])
            losses.append(torch.logsumexp(sims, 0) - sims[i])
        per_rank.append(torch.stack(losses).mean())
    torch.stack(per_rank).sum().backward()
    for r, result in enumerate(ranks):
        torch.testing.assert_close(result["loss"], per_rank[r].detach(), rtol=0, atol=1e-5)
        for k in ("query", "positive", "negative"):
            torch.testing.assert_close(result[k], union[k].grad[3 * r : 3 * r + 3], rtol=0, atol=1e-5, msg=k)


def test_two_processes_match_one_process_on_the_union_batch(llama_checkpoint, tmp_path):
    """Per-device batches on two processes are one InfoNCE loss over their union (what makes 64 per device x 8
    GPUs one loss of 512): the ranks' mean loss is the union's, written out query by query, and one SGD step
    gives both ranks the weights of one process stepping on the union."""
    import torch.multiprocessing as mp

    single = build_encoder(llama_checkpoint)
    batch = union_batch(single, n=4)
    torch.save(batch, tmp_path / "batch.pt")
    mp.spawn(
        run_rank,
        args=(2, str(tmp_path / "init"), llama_checkpoint, str(tmp_path / "batch.pt"), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    # the union batch by hand: every text alone, InfoNCE query by query in float64 over all 4 positives and negatives
    with torch.no_grad():
        by_hand = stage_II_loss_by_hand(single, batch)
    assert torch.allclose((ranks[0]["loss"] + ranks[1]["loss"]).double() / 2, by_hand, rtol=1e-5, atol=0)
    # one process, the whole batch: per-query losses, the mean loss, one SGD step
    before = lora_state(single)
    out = single(**batch)
    scores = single.loss_fn.scores(out.query_embedding, out.positive_embedding, out.negative_embedding)
    per_query = F.cross_entropy(scores, torch.arange(4), reduction="none").detach()
    sgd_step(single, out.loss)
    after = lora_state(single)

    for r, result in enumerate(ranks):  # rank r's queries are rows 2r, 2r+1 with labels 2r, 2r+1
        assert torch.allclose(result["loss"], per_query[2 * r : 2 * r + 2].mean(), atol=1e-5)
    assert torch.allclose((ranks[0]["loss"] + ranks[1]["loss"]) / 2, out.loss.detach(), atol=1e-5)
    moved = max((after[k] - before[k]).abs().max().item() for k in after)
    assert moved > 1e-3 * LR
    for name in after:
        assert torch.equal(ranks[0]["lora"][name], ranks[1]["lora"][name]), name
        assert torch.allclose(ranks[0]["lora"][name], after[name], atol=1e-6, rtol=1e-5), name


# ---------------------------------------------------------------- the LoRA model


def test_only_lora_parameters_get_gradients(llama_checkpoint):
    model = build_encoder(llama_checkpoint)
    batch = union_batch(model, n=3)
    model(**batch).loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all("lora_" in n for n in with_grad)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n in dict(model.named_parameters()) if "lora_" in n
    }
    assert any("lora_A" in n for n in with_grad) and any("lora_B" in n for n in with_grad)
    for module in TARGET_MODULES:
        assert any(f"{module}.lora_A" in n for n in with_grad), module


def test_adapter_round_trip_merged_and_unmerged(llama_checkpoint, tmp_path):
    model = build_encoder(llama_checkpoint)
    model.save(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    texts = ["The quick brown fox.", ["Retrieve passages", "which fox jumps?"]]
    reference = model.encode(texts, show_progress_bar=False)
    merged = LLM2Vec.from_pretrained(llama_checkpoint, peft_model_name_or_path=str(tmp_path / "adapter"), device="cpu")
    unmerged = LLM2Vec.from_pretrained(
        llama_checkpoint, peft_model_name_or_path=str(tmp_path / "adapter"), merge_peft=False, device="cpu"
    )
    plain = LLM2Vec.from_pretrained(llama_checkpoint, device="cpu")
    for loaded in (merged, unmerged):
        assert abs(loaded.encode(texts, show_progress_bar=False) - reference).max() < 1e-5
    assert abs(plain.encode(texts, show_progress_bar=False) - reference).max() > 1e-3  # the adapter matters


# ---------------------------------------------------------------- the driver, end to end


def common_flags(data: Path) -> list[str]:
    return nq_run_flags(data, 96, attn_implementation="sdpa")


def test_stage_I_then_stage_II_then_load(llama_checkpoint, tmp_path, caplog):
    from llm2vec.training import run

    data = write_tiny_e5(tmp_path / "data", n=16, sources=("nq",))
    stage_I, stage_II = tmp_path / "stage_I", tmp_path / "stage_II"
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        run(
            "I",
            [
                "--model_name_or_path",
                llama_checkpoint,
                "--output_dir",
                str(stage_I),
                "--max_steps",
                "2",
                "--per_device_train_batch_size",
                "4",
                "--save_strategy",
                "no",
                *common_flags(data),
            ],
        )
    # a finished run ends by naming where its model is
    assert [r.getMessage() for r in caplog.records if r.name == "llm2vec"][
        -1
    ] == f"Stage I: the model is saved in {stage_I}"
    stage_II_flags = [
        "--stage",
        "II",
        "--model_name_or_path",
        str(stage_I),
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--total_batch_size",
        "4",
        "--activation_checkpointing",
        "true",
        "--save_steps",
        "1",
        *common_flags(data),
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        trainer = run("II", [*stage_II_flags, "--output_dir", str(stage_II)])
    assert [r.getMessage() for r in caplog.records if r.name == "llm2vec"][-1] == (
        f"Stage II: the model is saved in {stage_II}"
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("gradient_accumulation_steps = 2" in m and "2 examples of one micro-batch" in m for m in warnings), (
        warnings
    )
    assert trainer.state.global_step == 2
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)

    for folder in (stage_II, stage_II / "checkpoint-1"):
        assert {"adapter_model.safetensors", "adapter_config.json", "llm2vec_config.json", "run_config.json"} <= set(
            os.listdir(folder)
        )
    assert not (stage_II / "model.safetensors").exists()  # the adapter only
    run_config = json.loads((stage_II / "run_config.json").read_text())
    assert run_config["stage"] == "II" and run_config["loss_scale"] == 20.0 and run_config["lora_r"] == 16

    texts = ["The quick brown fox.", ["Given a question, retrieve passages", "who jumps over the dog?"]]
    merged = LLM2Vec.from_pretrained(str(stage_I), peft_model_name_or_path=str(stage_II), device="cpu")
    unmerged = LLM2Vec.from_pretrained(
        str(stage_I), peft_model_name_or_path=str(stage_II), merge_peft=False, device="cpu"
    )
    embeddings = merged.encode(texts, show_progress_bar=False)
    assert embeddings.shape == (2, merged.model.config.hidden_size)
    assert abs(unmerged.encode(texts, show_progress_bar=False) - embeddings).max() < 1e-5
    trained = trainer.model.encode(texts, show_progress_bar=False)
    assert abs(trained - embeddings).max() < 1e-5

    # resume from checkpoint-1 in a fresh output folder: the same final adapter as the uninterrupted run
    resumed = tmp_path / "resumed"
    run(
        "II",
        [*stage_II_flags, "--output_dir", str(resumed), "--resume_from_checkpoint", str(stage_II / "checkpoint-1")],
    )
    from safetensors.torch import load_file

    a, b = load_file(stage_II / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_accumulation_warning_only_with_accumulation(caplog, tmp_path):
    from transformers import TrainingArguments

    def check(per_device, accumulation):
        args = TrainingArguments(
            output_dir=str(tmp_path),
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            use_cpu=True,
            report_to="none",
        )
        StageIIArguments().check(args)

    with caplog.at_level(logging.WARNING, logger="llm2vec"):
        check(64, 1)
        assert not caplog.records
        check(32, 2)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "64 examples" in message and "32 examples of one micro-batch" in message and "32 x 1" in message


# ---------------------------------------------------------------- the shipped configs


def stage_II_configs():
    files = sorted((ROOT / "train_configs" / "stage_II").glob("*.json")) + sorted(
        (ROOT / "train_configs" / "baseline").glob("*.json")
    )
    files += sorted((ROOT / "train_configs" / "ablation").glob("*stage2*.json"))
    return files


STAGE_I_OUTPUTS = {
    "MetaLlama3.2_1b": "output/stage_I/MetaLlama3.2_1b_q2d_d2q",
    "Qwen2.5_1.5b": "output/stage_I/Qwen2.5_1.5b_q2d_d2q",
    "MetaLlama3.2_3b": "output/stage_I/MetaLlama3.2_3b_q2d_d2q",
    "Mistral_7b": "output/stage_I/Mistral_7b_q2d_d2q",
    "MetaLlama3.1_8b": "output/stage_I/MetaLlama3.1_8b_q2d_d2q",
}
HUB_IDS = {
    "MetaLlama3.2_1b": "meta-llama/Llama-3.2-1B-Instruct",
    "Qwen2.5_1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "MetaLlama3.2_3b": "meta-llama/Llama-3.2-3B-Instruct",
    "Mistral_7b": "mistralai/Mistral-7B-Instruct-v0.2",
    "MetaLlama3.1_8b": "meta-llama/Llama-3.1-8B-Instruct",
}


def test_every_paper_model_has_a_stage_II_and_a_baseline_config():
    names = {p.name for p in stage_II_configs()}
    for prefix in HUB_IDS:
        for scale in ("", "_scale50"):  # both loss scales: the paper's tau 0.05 and the authors' code's default 50
            assert f"{prefix}_stage1_2000steps_stage2{scale}.json" in names
            assert f"{prefix}_baseline_stage2{scale}.json" in names
    for table_5_or_9 in (
        "MetaLlama3.2_1b_baseline_stage2_3000steps.json",
        "MetaLlama3.2_1b_stage1_2000steps_stage2_first125steps.json",
        "MetaLlama3.2_1b_baseline_stage2_first125steps.json",
    ):
        assert table_5_or_9 in names


def test_scale50_configs_differ_from_the_main_ones_only_in_the_scale():
    """The scale-50 set: every main Anchor and Baseline config has a twin with loss_scale 50, nothing else changed."""
    mains = sorted((ROOT / "train_configs/stage_II").glob("*_stage2.json")) + sorted(
        (ROOT / "train_configs/baseline").glob("*_stage2.json")
    )
    twins = sorted((ROOT / "train_configs/stage_II").glob("*_scale50.json")) + sorted(
        (ROOT / "train_configs/baseline").glob("*_scale50.json")
    )
    assert len(mains) == len(twins) == 10
    for main in mains:
        base, twin = json.loads(main.read_text()), json.loads(main.with_name(main.stem + "_scale50.json").read_text())
        assert base["loss_scale"] == 20.0 and twin["loss_scale"] == 50.0
        assert twin["output_dir"] == base["output_dir"] + "_scale50"
        assert {k: v for k, v in twin.items() if k not in ("loss_scale", "output_dir")} == {
            k: v for k, v in base.items() if k not in ("loss_scale", "output_dir")
        }


def test_table_5_and_9_runs_are_checkpoints_of_the_1000_step_schedule():
    """Table 5's 1000- and 3000-step rows are one run (a checkpoint at 1000, the stop at 3000) and Table 9's
    first 125 steps stop early on the same schedule: only stop_after_n_steps, save_steps and output_dir differ
    from the 1000-step configs, whose schedule spans 3 epochs whatever the stop."""

    def rest(config):
        return {k: v for k, v in config.items() if k not in ("stop_after_n_steps", "save_steps", "output_dir")}

    ablation = ROOT / "train_configs/ablation"
    table_5 = json.loads((ablation / "MetaLlama3.2_1b_baseline_stage2_3000steps.json").read_text())
    baseline = json.loads((ROOT / "train_configs/baseline/MetaLlama3.2_1b_baseline_stage2.json").read_text())
    assert rest(table_5) == rest(baseline) and table_5["stop_after_n_steps"] == 3000
    assert 1000 % table_5["save_steps"] == 0  # checkpoint-1000 is the 1000-step row
    for path in sorted(ablation.glob("*_first125steps.json")):
        early = json.loads(path.read_text())
        name = path.name.removesuffix("_first125steps.json")
        full_path = next(
            p
            for p in (
                ROOT / "train_configs/baseline" / f"{name}.json",
                ROOT / "train_configs/stage_II" / f"{name}.json",
                ablation / f"{name}.json",
            )
            if p.is_file()
        )
        assert rest(early) == rest(json.loads(full_path.read_text())), path.name
        assert early["stop_after_n_steps"] == 125 and early["save_steps"] == 25


@pytest.mark.parametrize("path", stage_II_configs(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stage_II_config_has_the_papers_values(path):
    config = parse_config("II", [str(path), "--use_cpu", "true"])  # bf16 needs a GPU to validate
    model, data, exp, args, raw = config.model, config.data, config.stage, config.training, load_config([str(path)])[0]
    name = path.stem
    prefix = next(p for p in HUB_IDS if name.startswith(p + "_"))
    assert exp.stage == "II"
    if "_baseline_" in name:
        assert model.model_name_or_path == HUB_IDS[prefix]
    elif "_stage1_2000steps_" in name:
        assert model.model_name_or_path == STAGE_I_OUTPUTS[prefix]
    else:  # Stage II on a Stage I ablation
        assert (
            model.model_name_or_path == f"output/ablation/{name.removesuffix('_first125steps').removesuffix('_stage2')}"
        )
    # the authors' horizon: a 3-epoch linear schedule; the run stops (and saves) at the paper's step count
    expected_steps = 3000 if name.endswith("_3000steps") else 125 if name.endswith("_first125steps") else 1000
    assert exp.stop_after_n_steps == expected_steps and args.num_train_epochs == 3
    assert "max_steps" not in raw and args.max_steps <= 0
    if name.endswith("_first125steps"):
        assert args.save_steps == 25  # Table 9: a checkpoint every 25 steps
    assert exp.loss_scale == (50.0 if name.endswith("_scale50") else 20.0)
    assert args.learning_rate == 2e-4 and args.warmup_steps == 300 and args.lr_scheduler_type.value == "linear"
    # the true batch of 512 in one step (7B/8B too: the gradient cache keeps 64 per device in memory)
    assert raw["per_device_train_batch_size"] == 64 and raw["gradient_accumulation_steps"] == 1
    assert exp.embedding_token_budget == (16384 if prefix in ("Mistral_7b", "MetaLlama3.1_8b") else 0)
    assert raw["per_device_train_batch_size"] * 8 * raw["gradient_accumulation_steps"] == 512 == exp.total_batch_size
    assert model.max_seq_length == 512 and model.pooling_mode == "eos_token"
    assert model.attn_implementation == "flash_attention_2" and raw["bf16"] is True and args.activation_checkpointing
    assert model.master_weights == "bf16" and config.dtype == torch.bfloat16 and "torch_dtype" not in raw  # pure bf16
    assert data.query_instructions is True and data.instruction_separator == "; "
    assert (exp.lora_r, exp.lora_alpha, exp.lora_dropout) == (16, 32, 0.05)
    assert exp.lora_target_modules == TARGET_MODULES
    assert exp.require_negative and args.seed == 42
    assert data.dataset_name == "E5" and data.dataset_file_path == "cache/echo-data"
    out_root = "output/ablation/" if path.parent.name == "ablation" else "output/stage_II/"
    assert args.output_dir == out_root + name
