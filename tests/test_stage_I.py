"""Stage I: the reconstruction loss against a per-example causal-LM reference, and the driver end to end."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from _drivers import launcher, subprocess_env, tiny_run_flags
from _tiny_data import write_tiny_e5 as write_e5
from safetensors.torch import load_file

from llm2vec import LLM2Vec
from llm2vec.collator import TrainCollator
from llm2vec.dataset import TrainExample
from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q
from llm2vec.templates import encode as template_encode
from llm2vec.testing import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]

PAIRS = [
    (
        "Given a question, retrieve passages that answer it",
        "What is the capital of France?",
        "Paris is the capital of France. Berlin is the capital of Germany.",
    ),
    ("", "quick fox", "The quick brown fox jumps over the lazy dog."),
    (
        "Retrieve semantically similar text",
        "numbers, punctuation: commas (parentheses) and [brackets] in a long query",
        "Rome",
    ),
]


def examples(pairs=PAIRS):
    return [TrainExample(query=q, positive=d, negative=None, query_instruction=i, source="t") for i, q, d in pairs]


def stage_I_model(tiny_models, family, **kwargs):
    model, tokenizer = tiny_models[family]
    return LLM2Vec_q2d_d2q(model, tokenizer, **kwargs)


def reference_direction_nll(causal_lm, tokenizer, spec, source_item, target_item, targets="text"):
    """-sum log P(target tokens | anchor of source) from plain, unpadded causal-LM forwards of one pair."""
    src, tgt = template_encode(tokenizer, spec, [source_item, target_item], max_length=512)
    with torch.no_grad():
        hidden = causal_lm.model(input_ids=torch.tensor([src.input_ids])).last_hidden_state
    anchor = hidden[0, -1]  # the final-layer state at the anchor token, the last token of the source
    y = list(tgt.input_ids[tgt.text_start : tgt.text_end] if targets == "text" else tgt.input_ids[:-1])
    embeds = torch.cat([anchor[None], causal_lm.get_input_embeddings()(torch.tensor(y))])
    with torch.no_grad():
        logits = causal_lm(inputs_embeds=embeds[None]).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    return -sum(logp[t, token] for t, token in enumerate(y)), len(y)


@pytest.mark.parametrize("targets", ["text", "all"])
def test_batched_loss_matches_per_example_reference(tiny_models, family, targets):
    model = stage_I_model(tiny_models, family, alpha=0.2)
    causal_lm, tokenizer = tiny_models[family]
    batch = TrainCollator.for_encoder(model, reconstruction=targets)(examples())
    with torch.no_grad():
        out = model(**batch)
    q2d = [reference_direction_nll(causal_lm, tokenizer, model.template, (i, q), ("", d), targets) for i, q, d in PAIRS]
    d2q = [reference_direction_nll(causal_lm, tokenizer, model.template, ("", d), (i, q), targets) for i, q, d in PAIRS]
    ref_q2d = sum(s for s, _ in q2d) / sum(n for _, n in q2d)  # token mean over the batch
    ref_d2q = sum(s for s, _ in d2q) / sum(n for _, n in d2q)
    torch.testing.assert_close(out.loss_q2d, ref_q2d, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss_d2q, ref_d2q, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, 0.2 * ref_q2d + 0.8 * ref_d2q, rtol=0, atol=1e-5)


def test_targets_text_exclude_template_and_instruction(tiny_models):
    model = stage_I_model(tiny_models, "llama3")
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples())
    tok = model.tokenizer
    row = batch["query_targets"]["input_ids"][0][batch["query_targets"]["attention_mask"][0].bool()]
    # the query text only (no header, no instruction, no anchor); the space after the separator is the text's
    assert tok.decode(row) == " " + PAIRS[0][1]
    batch = TrainCollator.for_encoder(model, reconstruction="all")(examples())
    row = batch["query_targets"]["input_ids"][0][batch["query_targets"]["attention_mask"][0].bool()]
    assert (
        tok.decode(row)
        == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n" + PAIRS[0][0] + ": " + PAIRS[0][1]
    )


def test_pair_loss_independent_of_batch_padding(tiny_models, family):
    """With unit denominators the loss is a sum over pairs: a pair contributes the same alone or padded."""
    model = stage_I_model(tiny_models, family)
    collate = TrainCollator.for_encoder(model, reconstruction="text")
    ones = {"q2d": torch.tensor(1.0), "d2q": torch.tensor(1.0)}
    with torch.no_grad():
        together = model(**{**collate(examples()), "target_counts": ones}).loss
        alone = sum(model(**{**collate(examples([p])), "target_counts": ones}).loss for p in PAIRS)
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-4)


def test_alpha_extremes_give_single_directions(tiny_models):
    batch = TrainCollator.for_encoder(stage_I_model(tiny_models, "qwen2"), reconstruction="text")(examples())
    with torch.no_grad():
        both = stage_I_model(tiny_models, "qwen2", alpha=0.5)(**batch)
        only_q2d = stage_I_model(tiny_models, "qwen2", alpha=1.0)(**batch)
        only_d2q = stage_I_model(tiny_models, "qwen2", alpha=0.0)(**batch)
    assert only_q2d.loss_d2q is None and only_d2q.loss_q2d is None
    torch.testing.assert_close(only_q2d.loss, both.loss_q2d, rtol=0, atol=1e-6)
    torch.testing.assert_close(only_d2q.loss, both.loss_d2q, rtol=0, atol=1e-6)


def test_gradient_flows_through_the_anchor_into_the_encoding_pass(tiny_models, monkeypatch):
    causal_lm, tokenizer = tiny_models["mistral"]
    model = LLM2Vec_q2d_d2q(causal_lm, tokenizer)
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples())

    def grads():
        model.zero_grad()
        out = model(**batch)
        if out.query_embedding.requires_grad:
            out.query_embedding.retain_grad()
            out.document_embedding.retain_grad()
        out.loss.backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return out, g

    out, attached = grads()
    assert out.query_embedding.grad.abs().sum() > 0 and out.document_embedding.grad.abs().sum() > 0
    # The same step with the anchor embeddings detached from the encoding pass: the gradients change.
    encode = LLM2Vec.embed
    monkeypatch.setattr(LLM2Vec, "embed", lambda self, features: encode(self, features).detach())
    _, detached = grads()
    changed = [n for n in attached if not torch.allclose(attached[n], detached[n])]
    assert changed, "detaching the anchor did not change any gradient: the encoding pass gets no signal"


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_the_anchor_is_the_final_normed_state_and_enters_the_decoder_unscaled_at_position_0(tiny_models, family):
    """The anchor path of Eq. 1 and 3 (as in the authors' code): e_X is the last layer's state after the final norm,
    the vector the LM head reads (its logits are the causal LM's at the anchor token); the reconstruction pass feeds
    it as it is in place of an input embedding, at position 0 (an input-embedding row given as the anchor gives the
    states of that token read by its id)."""
    from llm2vec.llm2vec import decoder_body
    from llm2vec.loss.reconstruction import reconstruction_states

    lm, tokenizer = tiny_models[family]
    model = LLM2Vec_q2d_d2q(lm, tokenizer)
    batch = TrainCollator.for_encoder(model, reconstruction="text")(examples())
    decoder, targets = decoder_body(lm), batch["positive_targets"]
    token = torch.full((len(targets["input_ids"]),), 5)
    with torch.no_grad():
        anchors = model.embed(batch["query"])
        for anchor, ids, real in zip(anchors, batch["query"]["input_ids"], batch["query"]["attention_mask"]):
            logits = lm(input_ids=ids[real.bool()][None]).logits[0, -1]
            assert torch.allclose(lm.get_output_embeddings()(anchor), logits, atol=1e-5)
        embedded = decoder.get_input_embeddings()(token)
        states = reconstruction_states(decoder, embedded, targets["input_ids"], targets["attention_mask"])
        for row, (ids, real) in enumerate(zip(targets["input_ids"], targets["attention_mask"])):
            y = ids[real.bool()]
            by_id = decoder(input_ids=torch.cat([token[row : row + 1], y])[None]).last_hidden_state[0, : len(y)]
            assert torch.allclose(states[row, : len(y)], by_id, atol=1e-5)


# ---------------------------------------------------------------------------------------------- the driver


@pytest.fixture(scope="module")
def stage_I_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage1")
    return save_tiny_model("llama3", root / "model"), write_e5(root / "data"), root


def driver_args(model, data, out, **overrides):
    return tiny_run_flags(
        model, data, out, **{"learning_rate": 1e-3, "max_steps": 1, "save_strategy": "no", **overrides}
    )


def run_driver(argv, nproc=1):
    return subprocess.run(
        launcher(nproc) + [str(ROOT / "experiments/run_stage_I.py")] + argv,
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def test_two_processes_equal_one_process_and_accumulation(stage_I_setup):
    """After one step, 2 ranks x 2, 1 rank x 4, and 1 rank x 2 x 2 accumulation give the same parameters."""
    model, data, root = stage_I_setup
    # SGD: the update is proportional to the gradient, so a wrongly scaled gradient shows, and float noise in
    # near-zero gradients is not blown up to a full step as AdamW's first step (g / (|g| + eps)) does.
    sgd = {"optim": "sgd"}
    runs = {
        "ddp": (driver_args(model, data, root / "ddp", per_device_train_batch_size=2, ddp_backend="gloo", **sgd), 2),
        "single": (driver_args(model, data, root / "single", **sgd), 1),
        "accum": (
            driver_args(
                model, data, root / "accum", per_device_train_batch_size=2, gradient_accumulation_steps=2, **sgd
            ),
            1,
        ),
    }
    for name, (argv, nproc) in runs.items():
        result = run_driver(argv, nproc)
        assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"
    base, single = weights(model), weights(root / "single")
    assert any(not torch.equal(base[k], single[k]) for k in single), "the step changed nothing"
    for other in ("ddp", "accum"):
        w = weights(root / other)
        for k in single:
            torch.testing.assert_close(w[k], single[k], rtol=0, atol=2e-6, msg=f"{other}: {k}")
    # The checkpoint is a full causal LM that the encoder loads, with the run's settings and resolved config.
    enc = LLM2Vec.from_pretrained(str(root / "ddp"), device="cpu")
    assert enc.encode(["hello"], show_progress_bar=False).shape == (1, 32)
    resolved = json.loads((root / "ddp" / "run_config.json").read_text())
    assert resolved["world_size"] == 2 and resolved["alpha"] == 0.2


def run_stage_I(argv):
    from llm2vec.training import run

    return run("I", argv)


def test_resume_continues_the_same_run(stage_I_setup):
    model, data, root = stage_I_setup
    run_stage_I(driver_args(model, data, root / "straight", max_steps=3))
    run_stage_I(driver_args(model, data, root / "broken", max_steps=3, save_strategy="steps", save_steps=2))
    # Simulate an interruption after step 2: resume from that checkpoint into a fresh run folder.
    ckpt = root / "broken" / "checkpoint-2"
    run_stage_I(driver_args(model, data, root / "resumed", max_steps=3, resume_from_checkpoint=str(ckpt)))
    a, b = weights(root / "straight"), weights(root / "resumed")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    assert (ckpt / "llm2vec_config.json").is_file() and (ckpt / "run_config.json").is_file()


def test_driver_reports_missing_and_malformed_data(stage_I_setup, tmp_path):
    model, _, _ = stage_I_setup
    result = run_driver(driver_args(model, tmp_path / "nowhere", tmp_path / "out"))
    assert result.returncode == 2
    assert "nowhere/nq.jsonl" in result.stderr and "nowhere/fever.jsonl" in result.stderr
    assert "Traceback" not in result.stderr
    bad = write_e5(tmp_path / "bad")
    with open(bad / "fever.jsonl", "a") as f:
        f.write("{not json\n")
    result = run_driver(driver_args(model, bad, tmp_path / "out"))
    assert result.returncode == 2 and "fever.jsonl:25" in result.stderr and "Traceback" not in result.stderr
    # a source name the E5 loader does not know is a config mistake, named by its field
    result = run_driver(driver_args(model, stage_I_setup[1], tmp_path / "out2", e5_sources='["nq","nope"]'))
    assert result.returncode == 2 and "e5_sources" in result.stderr and "'nope'" in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert "Traceback" not in result.stderr and len(errors) == 1 and errors[0].startswith("error: e5_sources")


def test_driver_config_errors_are_clear(stage_I_setup, tmp_path):
    from llm2vec.arguments import ConfigError

    model, data, _ = stage_I_setup
    with pytest.raises(ConfigError, match="unknown field.*'alhpa'"):
        run_stage_I(driver_args(model, data, tmp_path / "o") + ["--alhpa", "0.3"])
    with pytest.raises(ConfigError, match="total_batch_size is 512"):
        run_stage_I(driver_args(model, data, tmp_path / "o", total_batch_size=512))
    with pytest.raises(ConfigError, match="flash"):
        run_stage_I(driver_args(model, data, tmp_path / "o", attn_implementation="flash_attention_2"))
    with pytest.raises(ConfigError, match="stage 'II'"):
        run_stage_I(driver_args(model, data, tmp_path / "o", stage="II"))
    # a field of the other stage is named, with the stage it belongs to
    with pytest.raises(
        ConfigError, match=r"unknown field\(s\) for Stage I: \['loss_scale'\] \(loss_scale: Stage II only\)"
    ):
        run_stage_I(driver_args(model, data, tmp_path / "o", loss_scale=50))
    # FSDP's own activation checkpointing (the shipped fsdp2 file) and the training argument together
    fsdp_file = Path(__file__).resolve().parents[1] / "train_configs" / "fsdp" / "fsdp2_full_shard.json"
    with pytest.raises(ConfigError, match="--activation_checkpointing false"):
        run_stage_I(
            driver_args(
                model, data, tmp_path / "o", fsdp="true", fsdp_config=fsdp_file, activation_checkpointing="true"
            )
        )
    config = tmp_path / "stage_I.json"
    config.write_text(json.dumps({"model_name_or_path": str(model), "output_dir": str(tmp_path / "o"), "lora_r": 8}))
    with pytest.raises(ConfigError, match=f"{config}: unknown field.*lora_r"):
        run_stage_I([str(config)])


# ---------------------------------------------------------------------------------------------- configs

PAPER_MODELS = {
    "MetaLlama3.2_1b_q2d_d2q": "meta-llama/Llama-3.2-1B-Instruct",
    "Qwen2.5_1.5b_q2d_d2q": "Qwen/Qwen2.5-1.5B-Instruct",
    "MetaLlama3.2_3b_q2d_d2q": "meta-llama/Llama-3.2-3B-Instruct",
    "Mistral_7b_q2d_d2q": "mistralai/Mistral-7B-Instruct-v0.2",
    "MetaLlama3.1_8b_q2d_d2q": "meta-llama/Llama-3.1-8B-Instruct",
}
ABLATIONS = {"OnlyQ2D": 1.0, "OnlyD2Q": 0.0, "alpha0.5": 0.5, "alpha0.8": 0.8}


def check_paper_stage_I(path):
    from llm2vec.arguments import load_config, parse_config

    config = parse_config("I", [str(path), "--use_cpu", "true"])  # CI has no GPU
    model, data, exp, args, raw = config.model, config.data, config.stage, config.training, load_config([str(path)])[0]
    # the authors' horizon: a 3-epoch linear schedule, stopped (and saved) at the paper's 2000 steps
    assert exp.stage == "I" and exp.stop_after_n_steps == 2000 and args.num_train_epochs == 3
    assert "max_steps" not in raw and args.max_steps <= 0
    assert args.learning_rate == 4e-5 and args.warmup_steps == 300 and args.lr_scheduler_type == "linear"
    assert args.per_device_train_batch_size * 8 * args.gradient_accumulation_steps == 512 == exp.total_batch_size
    assert model.max_seq_length == 512 and model.pooling_mode == "eos_token"
    assert model.attn_implementation == "flash_attention_2"
    assert args.bf16 and args.activation_checkpointing and args.seed == 42
    assert model.master_weights == "bf16" and config.dtype == torch.bfloat16 and "torch_dtype" not in raw  # pure bf16
    assert exp.reconstruction_targets == "text" and data.dataset_name == "E5"
    # the memory-bounded step (exact: tests/test_performance.py) is on in every paper config
    assert exp.token_budget >= 4096 and exp.logit_chunk_rows == 4096
    assert data.query_instructions is True and data.instruction_separator == "; "  # the authors' loader, both stages
    return model, exp, raw, config


def test_stage_I_configs_match_the_paper():
    files = sorted((ROOT / "train_configs/stage_I").glob("*.json"))
    assert {f.stem for f in files} == set(PAPER_MODELS)
    for f in files:
        model, exp, raw, config = check_paper_stage_I(f)
        assert model.model_name_or_path == PAPER_MODELS[f.stem] and exp.alpha == 0.2
        assert raw["output_dir"] == f"output/stage_I/{f.stem}"
        if "7b" in f.stem or "8b" in f.stem:  # 7B/8B full fine-tuning needs FSDP, in transformers 5's form
            assert raw["fsdp"] is True and raw["fsdp_config"]["version"] == 2
            assert raw["fsdp_config"]["transformer_layer_cls_to_wrap"] == [
                "MistralDecoderLayer" if "Mistral" in f.stem else "LlamaDecoderLayer"
            ]
            # pure bf16 under FSDP too: no mixed precision, so accelerate keeps the bf16 weights (no fp32 upcast)
            assert config.training.mixed_precision == "no" and config.resolved()["precision"] == {
                "weights": "bfloat16",
                "autocast": "off",
            }
        else:
            assert "fsdp" not in raw and config.resolved()["precision"] == {"weights": "bfloat16", "autocast": "bf16"}


def test_stage_I_ablation_configs():
    for name, alpha in ABLATIONS.items():
        model, exp, _, _ = check_paper_stage_I(ROOT / f"train_configs/ablation/MetaLlama3.2_1b_stage1_{name}.json")
        assert model.model_name_or_path == "meta-llama/Llama-3.2-1B-Instruct" and exp.alpha == alpha


def test_stage_I_model_still_encodes(tiny_models):
    """The training subclass keeps the encoder API: encode() gives each text's Eq. 1 embedding, the final state of
    the anchor closing its user turn (SmolLM2's chat format written out), the text run alone through the decoder."""
    causal_lm, tokenizer = tiny_models["smollm2"]
    texts = ["Paris is the capital of France.", "fox"]
    trained = LLM2Vec_q2d_d2q(causal_lm, tokenizer).encode(texts, show_progress_bar=False)
    assert trained.shape == (2, 32)
    for row, text in zip(trained, texts):
        prompt = tokenizer(f"<|im_start|>user\n{text}<|im_end|>", add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            alone = causal_lm.get_decoder()(input_ids=prompt["input_ids"]).last_hidden_state[0, -1]
        assert (abs(row - alone.numpy()) < 1e-6).all()


def test_driver_without_a_data_path_says_so_in_one_line(tiny_checkpoints, tmp_path, capsys):
    """The package names no data folder of the repository (the configs do): a run without one stops with one line
    naming the field, before any model is built."""
    from llm2vec.training import main

    flags = ["--model_name_or_path", str(tiny_checkpoints["llama3"]), "--output_dir", str(tmp_path / "out")]
    assert main("I", [*flags, "--use_cpu", "true", "--per_device_train_batch_size", "2"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error == [
        "error: dataset_file_path is not set: give the folder of the E5 <source>.jsonl files in the config or as "
        "--dataset_file_path"
    ]


def test_driver_reads_user_jsonl_with_default_instruction(tmp_path):
    from llm2vec.arguments import DataArguments
    from llm2vec.training import load_training_data

    for name in ("a", "b"):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(4):
                line = {"query": f"q{i}", "positive": f"p{i}"}
                if i == 0:
                    line["instruction"] = "own"
                f.write(json.dumps(line) + "\n")
    data = DataArguments(
        dataset_name="jsonl",
        dataset_file_path=f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl",
        default_instruction="Retrieve the answer",
    )
    dataset = load_training_data(data, global_batch_size=2, seed=0, require_negative=False)
    by_query = {(ex.source, ex.query): ex.query_instruction for ex in dataset}
    assert len(by_query) == 8 and {s for s, _ in by_query} == {"a", "b"}
    assert by_query[("a", "q0")] == "own" and by_query[("b", "q3")] == "Retrieve the answer"
