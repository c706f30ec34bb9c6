"""The recipe around the equations: the learning-rate horizon and stop_after_n_steps, the precision policy,
the query instructions and their separator. Each test has an independent reference."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from _drivers import launcher, subprocess_env, tiny_run_flags
from _tiny_data import write_tiny_e5
from safetensors.torch import load_file

from llm2vec.arguments import ConfigError, DataArguments, parse_config
from llm2vec.testing import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
PER_SOURCE, BATCH = 24, 4  # two sources of 24 pairs in global batches of 4: 12 optimizer steps per epoch


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    return save_tiny_model("llama3", root / "model"), write_tiny_e5(root / "data", n=PER_SOURCE), root


def flags(model, data, out, **overrides):
    fields = {"learning_rate": 1e-3, "warmup_steps": 3, "num_train_epochs": 3, "per_device_train_batch_size": BATCH}
    fields.update(save_strategy="no", max_seq_length=64)
    return tiny_run_flags(model, data, out, **{**fields, **overrides})


def run_stage_I(argv):
    from llm2vec.training import run

    return run("I", argv)


def logged_rates(trainer) -> dict[int, float]:
    return {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}


def linear_with_warmup(step: int, peak: float, warmup: int, horizon: int) -> float:
    """transformers' linear schedule with warm-up, written out: the rate of optimizer step ``step`` (1-based),
    which has ``step - 1`` steps behind it (the Trainer logs this rate at that step)."""
    done = step - 1
    if done < warmup:
        return peak * done / warmup
    return peak * max(0.0, (horizon - done) / (horizon - warmup))


# ------------------------------------------------------------------------------------- horizon and stop


def test_rate_follows_the_3_epoch_schedule_and_the_run_stops_and_saves(setup):
    model, data, root = setup
    out = root / "stopped"
    trainer = run_stage_I(flags(model, data, out, stop_after_n_steps=7, save_strategy="steps", save_steps=3))
    horizon = 3 * (PER_SOURCE // BATCH) * 2  # 3 epochs of 12 global batches, computed here from the data written
    assert trainer.state.global_step == 7 and trainer.state.max_steps == horizon == 36
    rates = logged_rates(trainer)
    assert sorted(rates) == list(range(1, 8))
    for step, rate in rates.items():
        assert rate == pytest.approx(linear_with_warmup(step, 1e-3, 3, horizon), rel=1e-9, abs=1e-15), step
    # the final model is saved at the stop (= the trainer's weights after step 7), with a checkpoint there too
    final = load_file(out / "model.safetensors")
    trained = {k: v.detach() for k, v in trainer.model.model.state_dict().items()}
    assert final.keys() <= trained.keys()
    for k in final:
        torch.testing.assert_close(final[k], trained[k], rtol=0, atol=0)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6", "checkpoint-7"]
    for k, v in load_file(out / "checkpoint-7" / "model.safetensors").items():
        assert torch.equal(v, final[k])
    # the horizon and the rate at the stop are saved beside the model
    schedule = json.loads((out / "run_config.json").read_text())["lr_schedule"]
    assert schedule["horizon_steps"] == 36 and schedule["stop_step"] == 7 and schedule["warmup_steps"] == 3
    assert schedule["learning_rate_at_stop"] == pytest.approx(linear_with_warmup(7, 1e-3, 3, 36), rel=1e-9)
    assert schedule["fraction_of_peak_at_stop"] == pytest.approx(30 / 33, abs=1e-6)
    assert trainer.data_collator.instruction_separator == "; " and trainer.data_collator.query_instructions


def test_max_steps_decays_to_zero_at_the_stop(setup):
    """The documented alternative: max_steps = N makes the schedule end (rate 0) at step N."""
    model, data, root = setup
    trainer = run_stage_I(flags(model, data, root / "decay", max_steps=5))
    rates = logged_rates(trainer)
    assert trainer.state.global_step == 5 and trainer.state.max_steps == 5
    assert trainer.lr_scheduler.get_last_lr()[0] == 0.0  # the schedule has run out at the stop
    for step, rate in rates.items():
        assert rate == pytest.approx(linear_with_warmup(step, 1e-3, 3, 5), rel=1e-9, abs=1e-15)


def test_resuming_mid_run_continues_the_same_schedule(setup):
    model, data, root = setup
    straight = run_stage_I(flags(model, data, root / "straight", stop_after_n_steps=6))
    broken = root / "broken"
    run_stage_I(flags(model, data, broken, stop_after_n_steps=4, save_strategy="steps", save_steps=2))
    # the run was stopped at step 4 (think: interrupted); resume from checkpoint-2 to the full stop at 6
    resumed = run_stage_I(
        flags(model, data, root / "resumed", stop_after_n_steps=6, resume_from_checkpoint=broken / "checkpoint-2")
    )
    assert resumed.state.global_step == 6 and resumed.state.max_steps == straight.state.max_steps == 36
    first, second = logged_rates(straight), logged_rates(resumed)
    for step in range(3, 7):
        assert second[step] == pytest.approx(first[step], rel=1e-12), step
    a, b = load_file(root / "straight" / "model.safetensors"), load_file(root / "resumed" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    # a resume that would change the schedule (another horizon), or that is already past the stop, is refused
    with pytest.raises(ConfigError, match="resuming would change the learning-rate schedule"):
        run_stage_I(
            flags(
                model,
                data,
                root / "other",
                stop_after_n_steps=6,
                num_train_epochs=2,
                resume_from_checkpoint=broken / "checkpoint-2",
            )
        )
    with pytest.raises(ConfigError, match="step 4 is past the end of this config"):
        run_stage_I(
            flags(model, data, root / "other", stop_after_n_steps=3, resume_from_checkpoint=broken / "checkpoint-4")
        )
    # a checkpoint exactly at the stop is the finished model: written from it without training
    final = run_stage_I(
        flags(model, data, root / "at_stop", stop_after_n_steps=4, resume_from_checkpoint=broken / "checkpoint-4")
    )
    assert final.state.global_step == 4
    a, b = load_file(broken / "model.safetensors"), load_file(root / "at_stop" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_beyond_the_schedule_is_refused(setup):
    model, data, root = setup
    with pytest.raises(
        ConfigError,
        match="stop_after_n_steps 40 is beyond the end of the learning-rate schedule "
        r"\(36 steps",
    ):
        run_stage_I(flags(model, data, root / "far", stop_after_n_steps=40))
    with pytest.raises(ConfigError, match="stop_after_n_steps=0"):
        run_stage_I(flags(model, data, root / "far", stop_after_n_steps=0))


def test_a_time_budget_stops_at_the_step_it_runs_out_evaluates_there_and_saves(setup):
    """stop_after_minutes: training stops at the first step past the budget (a budget of a microsecond: step 1),
    evaluates there, records the stop in trainer_state.json and saves the final model; every logged entry is in
    the metrics file as it was logged (compared with the Trainer's own log)."""
    model, data, root = setup
    out, metrics = root / "timed", root / "timed-metrics.jsonl"
    argv = flags(model, data, out, stop_after_minutes=1e-8, metrics_file=metrics, validation_size=8)
    trainer = run_stage_I(argv + ["--eval_strategy", "steps", "--eval_steps", "100", "--stop_after_n_steps", "5"])
    assert trainer.state.global_step == 1
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    (stop,) = [h for h in history if "stopped_by" in h]
    assert stop["step"] == 1 and stop["stopped_by"] == "stop_after_minutes" and stop["minutes"] > 0
    assert any("eval_anchor_gain_d2q" in h and h["step"] == 1 for h in history)
    final = load_file(out / "model.safetensors")
    for k, v in trainer.model.model.state_dict().items():
        if k in final:
            torch.testing.assert_close(final[k], v.detach(), rtol=0, atol=0)
    written = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert written == [h for h in history if "stopped_by" not in h]
    # a budget the run does not reach changes nothing: it trains to its stop
    again = run_stage_I(flags(model, data, root / "untimed", stop_after_minutes=60, stop_after_n_steps=3))
    assert again.state.global_step == 3 and not any("stopped_by" in h for h in again.state.log_history)


def test_a_metrics_file_inside_output_dir_or_a_budget_of_no_time_is_refused(setup):
    model, data, root = setup
    out = root / "refused"
    for field, value, said in (
        ("metrics_file", out / "metrics.jsonl", "metrics_file"),
        ("stop_after_minutes", 0, "stop_after_minutes=0"),
        ("stop_after_minutes", "nan", "stop_after_minutes=nan"),
    ):
        with pytest.raises(ConfigError, match=said):
            run_stage_I(flags(model, data, out, **{field: value}))
    assert not out.exists() or not any(out.iterdir())


def test_plan_matches_the_paper_estimate():
    """E5 at about 1.5 M pairs in batches of 512, 3 epochs: a horizon of about 8.8k steps; at Stage I's stop
    (2000) the rate is still about 80 % of its peak, at Stage II's (1000) about 92 %."""
    from transformers import TrainingArguments

    from llm2vec.schedule import plan_schedule

    args = TrainingArguments(
        output_dir="unused",
        learning_rate=4e-5,
        warmup_steps=300,
        num_train_epochs=3,
        lr_scheduler_type="linear",
        use_cpu=True,
        report_to="none",
    )
    batches = 1_500_000 // 512
    stage_I = plan_schedule(args, batches, 2000)
    assert stage_I.horizon_steps == 3 * batches == 8787
    assert stage_I.learning_rate_at_stop == pytest.approx(4e-5 * (8787 - 1999) / (8787 - 300), rel=1e-9)
    assert 0.79 < stage_I.as_dict()["fraction_of_peak_at_stop"] < 0.81
    assert plan_schedule(args, batches, 1000).as_dict()["fraction_of_peak_at_stop"] == pytest.approx(
        7788 / 8487, abs=1e-6
    )


@pytest.mark.parametrize(
    ("scheduler", "kwargs"),
    [
        ("linear", {}),
        ("cosine", {}),
        ("cosine_with_restarts", {"num_cycles": 2}),
        ("polynomial", {"power": 2.0, "lr_end": 1e-6}),
        ("constant", {}),
        ("constant_with_warmup", {}),
        ("inverse_sqrt", {}),
        ("cosine_with_min_lr", {"min_lr": 1e-5}),
        ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
        ("warmup_stable_decay", {"num_decay_steps": 10}),
        ("reduce_lr_on_plateau", {}),
        ("greedy", {}),
    ],
)
def test_the_planned_rate_at_the_stop_is_the_rate_the_scheduler_reaches_there(scheduler, kwargs):
    """For every scheduler transformers' TrainingArguments takes: the plan's rate at the stop is the rate a real
    optimizer has after ``stop - 1`` steps of transformers' own scheduler (the rate the Trainer logs at step
    ``stop``), stepped here; none for a scheduler whose rate is no function of the step."""
    from transformers import TrainingArguments, get_scheduler

    from llm2vec.schedule import plan_schedule

    by_metric = scheduler in ("reduce_lr_on_plateau", "greedy")  # rates that follow the evaluation, not the step
    evaluates = {"eval_strategy": "steps"} if by_metric else {}
    args = TrainingArguments(
        "unused", learning_rate=1e-3, warmup_steps=7, num_train_epochs=3, lr_scheduler_type=scheduler, **evaluates
    )
    args.lr_scheduler_kwargs = kwargs
    for stop in (1, 5, 8, 30, 60):
        plan = plan_schedule(args, 20, stop)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        stepped = get_scheduler(scheduler, optimizer, 7, 60, scheduler_specific_kwargs=kwargs)
        if by_metric:
            assert plan.learning_rate_at_stop is None
            continue
        for _ in range(stop - 1):
            optimizer.step()
            stepped.step()
        assert plan.horizon_steps == 60 and plan.warmup_steps == 7
        assert plan.learning_rate_at_stop == pytest.approx(stepped.get_last_lr()[0], rel=1e-12, abs=1e-18), stop


# ------------------------------------------------------------------------------------- precision policy


def parsed(*extra):
    return parse_config("I", ["--model_name_or_path", "m", "--output_dir", "o", "--use_cpu", "true", *extra])


def test_precision_policy():
    pure = parsed("--bf16", "true")
    assert (
        pure.model.master_weights == "bf16" and pure.dtype == torch.bfloat16 and pure.training.mixed_precision == "bf16"
    )
    master = parsed("--bf16", "true", "--master_weights", "fp32")
    assert master.dtype == torch.float32 and master.training.mixed_precision == "bf16"
    fsdp = ["--fsdp", "true", "--fsdp_config", '{"version": 2}']
    pure_fsdp = parsed("--bf16", "true", *fsdp)
    assert pure_fsdp.dtype == torch.bfloat16 and pure_fsdp.training.mixed_precision == "no"
    assert pure_fsdp.resolved()["precision"] == {"weights": "bfloat16", "autocast": "off"}
    master_fsdp = parsed("--bf16", "true", "--master_weights", "fp32", *fsdp)
    assert master_fsdp.dtype == torch.float32 and master_fsdp.training.mixed_precision == "bf16"
    assert parsed().dtype == torch.float32 and parsed("--master_weights", "bf16").dtype == torch.float32  # no bf16
    with pytest.raises(ConfigError, match="torch_dtype 'float32' contradicts master_weights 'bf16'"):
        parsed("--bf16", "true", "--torch_dtype", "float32")
    with pytest.raises(ConfigError, match="master_weights='fp16'"):
        parsed("--master_weights", "fp16")


@pytest.mark.parametrize("master_weights,dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_fsdp_keeps_the_chosen_master_weights(setup, master_weights, dtype):
    """Two CPU processes under FSDP2 with bf16: the trained weights stay bf16 with master_weights bf16 (accelerate
    would otherwise upcast them to float32), and are float32 with master_weights fp32."""
    model, data, root = setup
    out = root / f"fsdp_{master_weights}"
    argv = flags(
        model,
        data,
        out,
        max_steps=1,
        warmup_steps=0,
        per_device_train_batch_size=2,
        ddp_backend="gloo",
        bf16="true",
        master_weights=master_weights,
        fsdp="true",
        fsdp_config='{"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}',
    )
    result = subprocess.run(
        [*launcher(2), str(ROOT / "experiments/run_stage_I.py"), *argv],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    trained, start = load_file(out / "model.safetensors"), load_file(Path(model) / "model.safetensors")
    assert {v.dtype for v in trained.values()} == {dtype}
    assert any(not torch.equal(trained[k].float(), start[k].float()) for k in trained), "the step changed nothing"


def test_bf16_update_check_rounds_as_bf16_arithmetic_says():
    """The measuring script's bf16 AdamW step: a weight of magnitude > 2^-6 (half its bf16 spacing is 6.1e-5)
    cannot move by a 4e-5 step; one below 2^-8 with a clear gradient always moves."""
    from research.bf16_update_check import adamw_step

    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(4096, generator=g) * 0.02).bfloat16()
    grads = torch.randn(4096, generator=g)
    new = adamw_step([weights], [grads], 4e-5)[0]
    big, small = weights.float().abs() > 2**-6, (weights.float().abs() < 2**-8) & (grads.abs() > 1e-3)
    assert big.any() and small.any()
    assert torch.equal(new[big], weights[big]) and bool((new[small] != weights[small]).all())
    assert new.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------- instructions


def test_query_instructions_in_both_stages_and_never_a_target(tiny_models):
    """Queries get the E5 instruction joined by the configured separator (the authors' "; "); with
    query_instructions false they get none; Stage I's text targets never contain it."""
    from llm2vec.collator import TrainCollator
    from llm2vec.dataset import TrainExample
    from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q

    causal_lm, tokenizer = tiny_models["llama3"]
    model = LLM2Vec_q2d_d2q(causal_lm, tokenizer)
    example = TrainExample(
        query="which fox jumps",
        positive="The quick brown fox jumps.",
        negative="A dog.",
        query_instruction="Retrieve passages",
        source="nq",
    )
    header = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
    for data, expected in (
        (DataArguments(), "Retrieve passages; which fox jumps"),
        (DataArguments(instruction_separator=" | "), "Retrieve passages | which fox jumps"),
        (DataArguments(query_instructions=False), "which fox jumps"),
    ):
        for stage in ({"reconstruction": "text"}, {"with_negative": True}):  # Stage I, Stage II
            batch = TrainCollator.for_encoder(model, **stage, **data.collator_options())([example])
            assert tokenizer.decode(batch["query"]["input_ids"][0]) == header + expected + "<|eot_id|>"
            if "query_targets" in batch:
                target = tokenizer.decode(batch["query_targets"]["input_ids"][0]).strip()
                assert target == "which fox jumps"
            assert (
                tokenizer.decode(batch["positive"]["input_ids"][0]) == header + "The quick brown fox jumps.<|eot_id|>"
            )
    with pytest.raises(ConfigError, match="instruction_separator is empty"):
        DataArguments(instruction_separator="")
