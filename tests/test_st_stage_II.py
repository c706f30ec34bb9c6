"""Stage II through sentence-transformers (``trainer: sentence_transformers``) against the project's own Stage II.

The two paths are tied together on tiny random models: on the same batch and weights,
``CachedMultipleNegativesRankingLoss`` at the paper's scale (20 = 1 / 0.05, mini-batches for the cache) gives the
project's InfoNCE loss and gradients (float32, 1e-6), for the project's plain and gradient-cached steps; one
optimizer step of each driver from the same weights gives the same LoRA weights; the result loads with
``LLM2Vec.from_pretrained`` and embeds as the trained ``SentenceTransformer``, and exports. The worked examples of
docs/training.md (CachedGISTEmbedLoss self-guided and guided, MatryoshkaLoss, mine_hard_negatives, retrieval
evaluation during training) run as printed there, at tiny size.
"""

import contextlib
import json
import logging
import re
import shlex
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentence_transformers")

from _drivers import nq_run_flags  # noqa: E402
from _tiny_data import write_tiny_beir, write_tiny_e5  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from llm2vec import LLM2Vec  # noqa: E402
from llm2vec.arguments import ConfigError, parse_config  # noqa: E402
from llm2vec.chunked_steps import gradient_cache_step  # noqa: E402
from llm2vec.collator import TrainCollator  # noqa: E402
from llm2vec.dataset import TrainExample  # noqa: E402
from llm2vec.llm2vec_contrastive import LLM2VecContrastive  # noqa: E402
from llm2vec.retrieval import LOGGED, MEAN, split_log_key  # noqa: E402
from llm2vec.st_training import build_loss, lora_config, sentence_transformer, separator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_LENGTH = 64
INSTRUCTIONS = ("Given a question, retrieve passages that answer it", "Retrieve a supporting document")
TEXTS = ["the quick brown fox", "a text that is a little longer than the first one, with commas", "x", "Ünïcödé"]


def examples(n: int = 6) -> list:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    return [
        TrainExample(
            query=" ".join(words[i : i + 3]),
            positive=" ".join(words[i : i + 6 + i % 3]),
            negative=" ".join(reversed(words[i : i + 4])),
            query_instruction=INSTRUCTIONS[i % 2] if i % 3 else "",  # some queries bare
            source="nq",
        )
        for i in range(n)
    ]


def stage_args(**over):
    return parse_config("II", ["--model_name_or_path", "unused", "--output_dir", "/tmp/unused", *over]).stage


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return str(tiny_checkpoints["llama3"])


@pytest.fixture(scope="module")
def both(checkpoint):
    """The project's Stage II model and the sentence-transformers one, with the same (non-zero) LoRA weights, in
    eval mode (LoRA dropout off: both draw other masks)."""
    lora = lora_config(stage_args())
    project = LLM2VecContrastive.load(checkpoint, max_length=MAX_LENGTH, loss_scale=20.0)
    from peft import get_peft_model

    torch.manual_seed(0)
    project.model = get_peft_model(project.model, lora)
    with torch.no_grad():
        for name, p in project.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # lora_B starts at zero, where lora_A gets no gradient
    st = sentence_transformer(checkpoint, lora=lora, max_length=MAX_LENGTH, instruction_separator="; ")
    st[0].model.load_state_dict(project.model.state_dict())
    return project.eval(), st.eval()


def lora_grads(module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad and p.grad is not None}


def st_features(st, batch):
    from llm2vec.st_training import st_dataset

    columns = st_dataset(batch, with_negative=True)
    return [st.preprocess(columns[name]) for name in ("query", "positive", "negative")]


@pytest.mark.parametrize("project_step", ["plain", "gradient_cache"])
def test_cached_mnrl_at_the_papers_scale_gives_the_infonce_loss_and_gradients(both, project_step):
    project, st = both
    batch = examples()
    inputs = TrainCollator.for_encoder(project, with_negative=True, instruction_separator="; ")(batch)
    project.zero_grad()
    if project_step == "plain":
        want = project(**{k: inputs[k] for k in ("query", "positive", "negative")}).loss
        want.backward()
    else:
        want, _ = gradient_cache_step(
            project,
            inputs,
            budget=40,  # several chunks
            packed=False,
            loss_fn=project.loss_fn,
            pad_token_id=project.pad_token_id,
            backward=lambda t, grad=None: t.backward(grad),
            no_sync=contextlib.nullcontext,
        )
    expected = {n.removeprefix("model."): g for n, g in lora_grads(project).items()}

    st.zero_grad()
    features = st_features(st, batch)
    # the same token ids on both sides (query with the training separator, documents bare)
    for side, f in zip(("query", "positive", "negative"), features):
        got = [i[m.bool()].tolist() for i, m in zip(f["input_ids"], f["attention_mask"])]
        ref = [i[m.bool()].tolist() for i, m in zip(inputs[side]["input_ids"], inputs[side]["attention_mask"])]
        assert got == ref, side
    loss = build_loss("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 2}, st, loss_scale=20.0)
    assert loss.scale == 20.0
    got = loss(features, None)
    got.backward()
    grads = {n.removeprefix("0.model."): g for n, g in lora_grads(st).items()}
    assert set(grads) == set(expected) and len(grads) == 2 * 7 * 2  # A and B of 7 modules in 2 layers
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-6)  # 3.5: a few float32 ulps
    # gradients: float32 sums over other matmul shapes (mini-batches of 2 rows against whole sides) round
    # differently; the largest difference is held to 1e-5 of the tensor's largest entry (measured: 1.6e-6)
    worst = max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in expected.items())
    assert worst <= 1e-5, worst
    assert any(g.abs().max() > 1e-4 for g in expected.values())  # a real comparison, not of zeros


# ----------------------------------------------------------------------------------------------- the drivers


def flags(checkpoint, data, out, *extra):
    settings = dict(attn_implementation="sdpa", per_device_train_batch_size=4, save_strategy="no", report_to="none")
    common = nq_run_flags(data, MAX_LENGTH, **settings, lora_dropout=0, learning_rate="2e-4")
    return ["--model_name_or_path", checkpoint, "--output_dir", str(out), *common, *extra]


@pytest.fixture(scope="module")
def one_step(checkpoint, tmp_path_factory):
    """One optimizer step of each driver from the same base (seed 42: the same LoRA initialisation)."""
    from llm2vec.training import run

    root = tmp_path_factory.mktemp("one_step")
    data = write_tiny_e5(root / "data", n=8, sources=("nq",))
    common = ["--max_steps", "1"]
    runs = {
        "project": run("II", flags(checkpoint, data, root / "project", *common)),
        "project_cached": run(
            "II", flags(checkpoint, data, root / "project_cached", *common, "--embedding_token_budget", "128")
        ),
        "st": run(
            "II",
            flags(
                checkpoint,
                data,
                root / "st",
                *common,
                "--trainer",
                "sentence_transformers",
                "--loss",
                "CachedMultipleNegativesRankingLoss",
                "--loss_kwargs",
                '{"mini_batch_size": 2}',
            ),
        ),
    }
    return root, runs


def test_one_optimizer_step_of_each_path_gives_the_same_lora_weights(one_step):
    root, runs = one_step
    losses = {k: [h["loss"] for h in t.state.log_history if "loss" in h] for k, t in runs.items()}
    assert losses["st"] == pytest.approx(losses["project"], abs=1e-6) == losses["project_cached"]
    st = load_file(root / "st" / "adapter_model.safetensors")
    start = None
    for other in ("project", "project_cached"):
        want = load_file(root / other / "adapter_model.safetensors")
        assert st.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(st[k], want[k], rtol=0, atol=1e-6, msg=k)
        start = want
    assert any(start[k].abs().max() > 0 for k in start if "lora_B" in k)  # the step moved lora_B off zero


def test_the_result_is_a_stage_II_run_that_loads_embeds_and_exports_like_the_sentence_transformer(
    one_step, checkpoint, tmp_path
):
    root, runs = one_step
    out = root / "st"
    assert {"adapter_model.safetensors", "adapter_config.json", "llm2vec_config.json", "run_config.json"} <= {
        p.name for p in out.iterdir()
    }
    run_config = json.loads((out / "run_config.json").read_text())
    assert run_config["trainer"] == "sentence_transformers" and run_config["lora_r"] == 16
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == checkpoint

    trained = runs["st"].model
    encoder = LLM2Vec.from_pretrained(checkpoint, str(out), device="cpu")
    with separator(trained, ": "):  # evaluation's separator, as LLM2Vec.encode joins an instruction
        for instruction in ("", INSTRUCTIONS[0]):
            got = trained.encode(TEXTS, prompt=instruction or None, convert_to_tensor=True, show_progress_bar=False)
            want = encoder.encode([[instruction, t] for t in TEXTS], convert_to_tensor=True, show_progress_bar=False)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    from llm2vec.export import export_sentence_transformers

    report = export_sentence_transformers(checkpoint, tmp_path / "export", str(out), max_length=MAX_LENGTH)
    assert report["min_cosine"] >= 0.99999 and report["query_instruction"]  # the run's one E5 instruction


def test_unknown_loss_or_argument_is_refused_in_one_line(checkpoint, tmp_path):
    base = [
        "--model_name_or_path",
        checkpoint,
        "--output_dir",
        str(tmp_path / "o"),
        "--trainer",
        "sentence_transformers",
    ]
    from llm2vec.training import run

    with pytest.raises(ConfigError) as e:
        run("II", [*base, "--loss", "InfoNCE"])
    message = str(e.value)
    assert "\n" not in message and "loss='InfoNCE'" in message and "CachedGISTEmbedLoss" in message
    with pytest.raises(ConfigError, match="loss is read only with trainer sentence_transformers"):
        parse_config("II", [*base[:4], "--loss", "MatryoshkaLoss"])
    with pytest.raises(ConfigError, match=r"^loss_kwargs: CachedMultipleNegativesRankingLoss takes no argument 'tau'"):
        build_loss("CachedMultipleNegativesRankingLoss", {"tau": 0.05}, model=None)
    with pytest.raises(ConfigError, match="embedding_token_budget: not on the trainer sentence_transformers path"):
        run("II", [*base, "--embedding_token_budget", "1024", "--dataset_file_path", str(tmp_path)])


# ----------------------------------------------------------------------------------------------- docs/training.md


def doc_block(marker: str) -> str:
    """The fenced block of docs/training.md that contains ``marker``."""
    text = (ROOT / "docs" / "training.md").read_text()
    blocks = re.findall(r"```(?:bash|python)\n(.*?)```", text, flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, marker
    return found[0]


def doc_flags(marker: str) -> list[str]:
    """The flags after the config file of the docs command that contains ``marker``."""
    words = shlex.split(doc_block(marker).replace("\\\n", " "))
    return words[words.index("experiments/run_stage_II.py") + 2 :]


@pytest.mark.parametrize(
    "marker",
    ["CachedGISTEmbedLoss --loss_kwargs '{\"mini", '"guide"', "MatryoshkaLoss"],
    ids=["gist_self_guided", "gist_with_guide", "matryoshka"],
)
def test_docs_loss_examples_train_at_tiny_size(marker, checkpoint, tmp_path, tiny_checkpoints):
    from llm2vec.training import run

    data = write_tiny_e5(tmp_path / "data", n=8, sources=("nq",))
    extra = doc_flags(marker)
    extra = [
        w.replace("output/stage_I/MetaLlama3.2_1b_q2d_d2q", str(tiny_checkpoints["qwen2"])).replace(
            "[2048, 512]", "[32, 16]"
        )
        for w in extra
    ]
    trainer = run("II", flags(checkpoint, data, tmp_path / "out", "--max_steps", "2", *extra))
    assert trainer.state.global_step == 2
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(x == x and abs(x) < 1e3 for x in losses)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_docs_mine_hard_negatives_runs_twice_as_printed_then_retrieval_evaluation(checkpoint, tmp_path, caplog):
    """The mining recipe of docs/training.md, run twice as printed on pairs of the README's own-data walk (columns
    ``anchor``, ``positive``), writes an hf dataset with hard negatives; a sentence-transformers Stage II run trains
    on it with a BEIR folder evaluated at every eval_steps."""
    import datasets

    pairs = write_tiny_e5(tmp_path / "pairs", n=12, sources=("nq",))
    rows = [json.loads(line) for line in (pairs / "nq.jsonl").read_text().splitlines()]
    datasets.Dataset.from_dict(
        {"anchor": [r["query"] for r in rows], "positive": [r["positive"] for r in rows]}
    ).save_to_disk(str(tmp_path / "my_pairs"))
    code = doc_block("mine_hard_negatives")
    code = code.replace("output/stage_I/MetaLlama3.2_1b_q2d_d2q", checkpoint).replace("data/", f"{tmp_path}/")
    code = code.replace("max_length=512", f"max_length={MAX_LENGTH}")
    for _ in range(2):  # a second run replaces the first's triples
        exec(compile(code, "docs/training.md", "exec"), {})
        mined = datasets.load_from_disk(str(tmp_path / "my_triples"))
        assert mined.column_names == ["anchor", "positive", "negative"] and len(mined) >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_pairs", "my_triples", "pairs"]  # nothing else left

    from llm2vec.training import run

    beir = write_tiny_beir(tmp_path / "beir" / "NanoTiny")
    extra = doc_flags("beir/NanoTiny")
    extra = [w.replace("data/", f"{tmp_path}/").replace("beir/NanoTiny", str(beir)) for w in extra]
    args = flags(checkpoint, tmp_path / "my_triples", tmp_path / "out", "--max_steps", "2", *extra)
    for printed in ("--e5_sources", "--dataset_file_path"):  # the e5 default is not the doc's; the doc gives its data
        args[args.index(printed) : args.index(printed) + 2] = []
    args[args.index("--per_device_train_batch_size") + 1] = "2"
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        trainer = run("II", args)
    # the retrieval scores under the names the project's trainer logs (llm2vec.retrieval.RetrievalEvaluation)
    evals = [h for h in trainer.state.log_history if any(split_log_key(k) for k in h)]
    names = {f"eval_{folder}_{metric}" for folder in ("NanoTiny", MEAN) for metric in LOGGED}
    assert evals and all({k for k in h if split_log_key(k)} == names for h in evals), trainer.state.log_history
    assert all(0 <= h[k] <= 1 for h in evals for k in names)
    assert not [k for h in trainer.state.log_history for k in h if "@" in k or "cosine" in k or "sequential" in k]


# ----------------------------------------------------------------------------------------------- refused at start-up


ST = ["--trainer", "sentence_transformers", "--max_steps", "1"]


@pytest.mark.parametrize(
    ("loss", "kwargs", "message"),
    [
        ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": "2"}, "loss_kwargs.mini_batch_size of Cached"),
        ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 0}, "give a whole number of at least 1"),
        ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": -1}, "give a whole number of at least 1"),
        ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 2.5}, "give a whole number of at least 1"),
        ("CachedGISTEmbedLoss", {"mini_batch_size": True}, "loss_kwargs.mini_batch_size of CachedGISTEmbedLoss: true"),
        ("MultipleNegativesRankingLoss", {"similarity_fct": "os.system"}, "give one of cos_sim, dot_score"),
        ("MultipleNegativesRankingLoss", {"scale": 0}, "loss_kwargs.scale of MultipleNegativesRankingLoss: 0"),
        ("CoSENTLoss", {}, "loss='CoSENTLoss': not a loss this path trains"),
        ("ContrastiveLoss", {}, "loss='ContrastiveLoss': not a loss this path trains"),
        ("AdaptiveLayerLoss", {}, "loss='AdaptiveLayerLoss': not a loss this path trains"),
        ("DenoisingAutoEncoderLoss", {}, "loss='DenoisingAutoEncoderLoss': not a loss this path trains"),
        ("MatryoshkaLoss", {"loss": "MatryoshkaLoss", "matryoshka_dims": [16]}, "loss_kwargs.loss='MatryoshkaLoss'"),
        ("MatryoshkaLoss", {"matryoshka_dims": [16, 0]}, "loss_kwargs.matryoshka_dims of MatryoshkaLoss: [16, 0]"),
    ],
)
def test_a_loss_or_argument_this_path_cannot_train_is_refused_before_the_run_starts(
    checkpoint, tmp_path, loss, kwargs, message
):
    """Values of the wrong type or range, and losses whose rows are not (query, positive[, negative]) without labels,
    are one line before the folder is touched, not a traceback at step 1."""
    from llm2vec.training import run

    data = write_tiny_e5(tmp_path / "data", n=8, sources=("nq",))
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as refused:
        run("II", flags(checkpoint, data, out, *ST, "--loss", loss, "--loss_kwargs", json.dumps(kwargs)))
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert not out.exists()


@pytest.mark.parametrize("kind", ["missing", "file", "uncached id", "output_dir"])
def test_a_guide_that_cannot_be_read_is_refused_before_the_run_starts(checkpoint, tmp_path, kind):
    from llm2vec.training import run

    data = write_tiny_e5(tmp_path / "data", n=8, sources=("nq",))
    (tmp_path / "notes.txt").write_text("x")
    out = tmp_path / "out"
    guide, message = {
        "missing": (str(tmp_path / "no" / "guide"), "no such folder"),
        "file": (str(tmp_path / "notes.txt"), "a file; give a model folder"),
        "uncached id": ("nobody/no-such-guide", "nor a model in the local hub cache"),
        "output_dir": (checkpoint, "overlap: a run never writes where it reads"),
    }[kind]
    out = Path(checkpoint) if kind == "output_dir" else out
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    with pytest.raises(ConfigError) as refused:
        args = flags(checkpoint, data, out, *ST, "--loss", "CachedGISTEmbedLoss")
        run("II", [*args, "--loss_kwargs", json.dumps({"guide": guide}), "--overwrite_output_dir", "true"])
    assert f"loss_kwargs.guide {guide}" in str(refused.value) and message in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before


# ----------------------------------------------------------------------------------------------- the run folder


def test_every_message_names_the_one_way_out_and_a_finished_run_has_nothing_to_do(
    checkpoint, tmp_path, monkeypatch, caplog
):
    """This path does not resume: a resume, an unfinished or longer run's folder and Ctrl-C each name
    ``--overwrite_output_dir true``; the same command again on a finished run is "nothing to do". Checkpoints are
    staged and listed as the project trainer's (none is "incomplete"), and no temporary model copy (the model's,
    a guide's) is left in TMPDIR."""
    import tempfile

    from llm2vec.run.folder import CHECKPOINT_MANIFEST
    from llm2vec.training import interrupted_message, parse_config, run

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    data = write_tiny_e5(tmp_path / "data", n=8, sources=("nq",))
    out = tmp_path / "out"
    guide = json.dumps({"guide": checkpoint, "mini_batch_size": 2})
    args = flags(checkpoint, data, out, *ST, "--loss", "CachedGISTEmbedLoss", "--loss_kwargs", guide)
    args[args.index("--save_strategy") + 1] = "steps"
    trainer = run("II", [*args, "--save_steps", "1"])
    assert trainer.state.global_step == 1 and (out / "checkpoint-1" / CHECKPOINT_MANIFEST).is_file()
    assert not any((tmp_path / "tmp").iterdir())
    way_out = "does not resume: pass --overwrite_output_dir true to start anew"
    with caplog.at_level(logging.INFO, logger="llm2vec"):
        assert run("II", [*args, "--save_steps", "1"]) is None
    assert "nothing to do" in caplog.text and way_out in caplog.text
    longer = [*args[: args.index("--max_steps")], "--max_steps", "2", *args[args.index("--max_steps") + 2 :]]
    for again in ([*args, "--resume_from_checkpoint", "true"], longer):
        with pytest.raises(ConfigError, match=way_out):
            run("II", again)
    message = interrupted_message(parse_config("II", args), trainer)
    assert message.endswith(way_out) and "--resume_from_checkpoint" not in message


def test_an_overwritten_run_starts_its_evaluation_csv_files_fresh(checkpoint, tmp_path):
    """sentence-transformers appends each evaluation to ``output_dir/eval/*.csv``; a run over a replaced one
    (``--overwrite_output_dir true``) writes its own rows only, the replaced run's file moved aside, not deleted."""
    from llm2vec.training import run

    data, beir = write_tiny_e5(tmp_path / "data", n=8, sources=("nq",)), write_tiny_beir(tmp_path / "NanoCsv")
    out = tmp_path / "out"
    args = flags(checkpoint, data, out, *ST, "--retrieval_eval_dirs", str(beir), "--retrieval_eval_instruction", "")
    args += ["--eval_steps", "1", "--per_device_eval_batch_size", "8"]
    run("II", args)
    (csv,) = (out / "eval").glob("*.csv")
    first = csv.read_text().splitlines()
    assert len(first) == 2, first  # the header and the evaluation at step 1
    run("II", [*args, "--overwrite_output_dir", "true"])
    assert len(csv.read_text().splitlines()) == 2
    assert csv.with_name(f"{csv.name}.before-run").read_text().splitlines() == first
