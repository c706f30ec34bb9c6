"""Packed decoder calls (llm2vec.packing): the same embeddings, losses and gradients as padded calls,
in fewer calls and with no padding. On CPU the packed row runs under sdpa's block-diagonal mask; with
flash_attention_2 transformers takes the variable-length kernel from the same position ids (GPU only).

Besides the project's padded path, each packed result is checked against references that share none of its code
(tests/_references.py): every text run alone through the model, the Stage I loss written out pair by pair
(Eq. 3-5, float64), the Stage II loss query by query (Eq. 6-7, float64), with their gradients by autograd.
"""

import contextlib

import pytest
import torch
from _references import embed_alone, stage_I_loss_by_hand, stage_II_loss_by_hand
from _references import loss_and_grads as reference_loss_and_grads
from test_performance import PAIRS, assert_same_gradients, chunked_step, examples, loss_and_grads

from llm2vec import LLM2Vec
from llm2vec.arguments import ConfigError, ModelArguments
from llm2vec.collator import TrainCollator
from llm2vec.llm2vec import decoder_body
from llm2vec.llm2vec_contrastive import LLM2VecContrastive
from llm2vec.llm2vec_q2d_d2q import LLM2Vec_q2d_d2q
from llm2vec.packing import packed_positions, unpack
from llm2vec.pooling import POOLING_MODES
from llm2vec.testing import build_tiny_model

TEXTS = [
    ["Given a question, retrieve passages that answer it", "What is the capital of France?"],
    "Paris is the capital of France. Berlin is the capital of Germany, and Rome that of Italy.",
    "a",
    ["Retrieve semantically similar text", "numbers, punctuation: commas (parentheses) and [brackets]"],
    "The quick brown fox",
]


@contextlib.contextmanager
def counted_calls(model):
    """Counts the forward calls of the decoder body of ``model`` (an LLM2Vec)."""
    calls = []
    handle = decoder_body(model.model).register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def test_pack_helpers_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]])  # right, full and left padding
    assert packed_positions(mask).tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1]
    states = torch.arange(9.0)[:, None].expand(9, 2)
    back = unpack(states, mask)
    assert back[:, :, 0].tolist() == [[0, 1, 2, 0], [3, 4, 5, 6], [0, 0, 7, 8]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_embeddings_equal_padded_ones(tiny_models, family, side):
    causal_lm, tokenizer = tiny_models[family]
    for mode in POOLING_MODES:
        padded = LLM2Vec(causal_lm, tokenizer, pooling_mode=mode)
        packed = LLM2Vec(causal_lm, tokenizer, pooling_mode=mode, packing=True)
        features = padded.tokenize(TEXTS, padding_side=side)
        before = {k: v.clone() for k, v in features.items()}
        with torch.no_grad(), counted_calls(packed) as calls:
            got = packed.embed(features)
        assert len(calls) == 1
        with torch.no_grad():
            ref = padded.embed(features)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=f"{family} {mode}")
        with torch.no_grad():
            alone = embed_alone(causal_lm.get_decoder(), features, mode)  # each text on its own, no padding
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5, msg=f"{family} {mode}: texts run alone")
        assert all(torch.equal(features[k], before[k]) for k in features)  # the batch is not changed


def test_encode_with_packing_equals_encode_without(tiny_models):
    causal_lm, tokenizer = tiny_models["qwen2"]
    ref = LLM2Vec(causal_lm, tokenizer).encode(TEXTS, batch_size=2, convert_to_tensor=True, show_progress_bar=False)
    got = LLM2Vec(causal_lm, tokenizer, packing=True).encode(
        TEXTS, batch_size=2, convert_to_tensor=True, show_progress_bar=False
    )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("alpha", [0.2, 1.0])
def test_packed_stage_I_step_equals_padded_step_in_two_calls(tiny_models, family, alpha):
    """Queries and documents encoded in one call, both reconstruction directions in a second one: the padded step's
    loss and gradients, and those of the loss written out pair by pair (each text alone, float64)."""
    causal_lm, tokenizer = tiny_models[family]
    padded = LLM2Vec_q2d_d2q(causal_lm, tokenizer, alpha=alpha)
    packed = LLM2Vec_q2d_d2q(causal_lm, tokenizer, alpha=alpha, packing=True)
    batch = TrainCollator.for_encoder(padded, reconstruction="text")(examples())
    ref_loss, ref_grads = loss_and_grads(padded, batch)
    with counted_calls(packed) as calls:
        loss, grads = loss_and_grads(packed, batch)
    assert len(calls) == 2
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert_same_gradients(grads, ref_grads, rtol=1e-5)
    by_hand, hand_grads = reference_loss_and_grads(
        lambda: stage_I_loss_by_hand(causal_lm, batch, alpha)["loss"], packed
    )
    torch.testing.assert_close(loss.double(), by_hand, rtol=1e-5, atol=0)
    assert_same_gradients(grads, hand_grads, rtol=1e-5)
    with torch.no_grad():
        ref, out = padded(**batch), packed(**batch)
        parts = stage_I_loss_by_hand(causal_lm, batch, alpha)
    torch.testing.assert_close(out.loss_q2d, ref.loss_q2d, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.loss_q2d.double(), parts["q2d"], rtol=1e-5, atol=0)
    if alpha < 1:
        torch.testing.assert_close(out.loss_d2q, ref.loss_d2q, rtol=1e-5, atol=0)
        torch.testing.assert_close(out.loss_d2q.double(), parts["d2q"], rtol=1e-5, atol=0)
    assert ref.metrics["padding_fraction"] > 0 and out.metrics["padding_fraction"] == 0


@pytest.mark.parametrize("budget", [1, 120])
def test_packed_token_budget_chunks_count_real_tokens(tiny_models, budget):
    from llm2vec.chunked_steps import chunk_cost, decoder_call_lengths, plan_chunks

    causal_lm, tokenizer = tiny_models["mistral"]
    plain = LLM2Vec_q2d_d2q(causal_lm, tokenizer, alpha=0.2)
    packed = LLM2Vec_q2d_d2q(causal_lm, tokenizer, alpha=0.2, token_budget=budget, packing=True)
    batch = TrainCollator.for_encoder(plain, reconstruction="text")(examples())
    lengths = decoder_call_lengths(batch, ("q2d", "d2q")).tolist()
    chunks = plan_chunks(lengths, budget, packed=True)
    assert len(chunks) > 1
    for rows in chunks:  # a packed chunk costs its real tokens: within the budget unless a pair alone exceeds it
        assert chunk_cost(lengths, rows, packed=True) == sum(sum(lengths[i]) for i in rows)
        assert len(rows) == 1 or chunk_cost(lengths, rows, packed=True) <= budget
    ref_loss, ref_grads = loss_and_grads(plain, batch)
    with counted_calls(packed) as calls:
        out, grads, _ = chunked_step(packed, batch)
    assert len(calls) == 2 * len(chunks) and out.chunks == len(chunks)
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-5, atol=0)
    assert_same_gradients(grads, ref_grads, rtol=1e-5)
    by_hand, hand_grads = reference_loss_and_grads(lambda: stage_I_loss_by_hand(causal_lm, batch, 0.2)["loss"], packed)
    torch.testing.assert_close(out.loss.double(), by_hand, rtol=1e-5, atol=0)
    assert_same_gradients(grads, hand_grads, rtol=1e-5)
    assert out.metrics["padding_fraction"] == 0


def stage_II_model(packing):
    """A fresh tiny model (PEFT changes the model it wraps: the session's shared ones stay untouched)."""
    from peft import LoraConfig, get_peft_model

    causal_lm, tokenizer = build_tiny_model("llama3")
    model = LLM2VecContrastive(decoder_body(causal_lm), tokenizer, loss_scale=20.0, packing=packing)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    model.model = get_peft_model(model.model, lora)
    for name, p in model.model.named_parameters():  # LoRA's B starts at zero: give it a value so A gets a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def test_packed_stage_II_step_equals_padded_step_in_one_call():
    padded, packed = stage_II_model(False), stage_II_model(True)
    packed.model.load_state_dict(padded.model.state_dict())
    triples = [(i, q, d, n) for (i, q, d), (_, _, n) in zip(PAIRS, PAIRS[1:] + PAIRS[:1])]
    from llm2vec.dataset import TrainExample

    batch = TrainCollator.for_encoder(padded, with_negative=True)(
        [TrainExample(query=q, positive=d, negative=n, query_instruction=i, source="t") for i, q, d, n in triples]
    )

    def step(model):
        model.zero_grad()
        out = model(**batch)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = step(padded)
    with counted_calls(packed) as calls:
        loss, grads = step(packed)
    assert len(calls) == 1 and "negative" in batch  # queries, positives and negatives in one packed call
    assert any("lora_A" in n for n in ref_grads)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert_same_gradients(grads, ref_grads, rtol=1e-5)

    # each text alone through the LoRA model, InfoNCE query by query in float64
    hand_loss, hand_grads = reference_loss_and_grads(lambda: stage_II_loss_by_hand(packed, batch), packed)
    torch.testing.assert_close(loss.double(), hand_loss, rtol=1e-5, atol=0)
    assert_same_gradients(grads, hand_grads, rtol=1e-5)


def test_packing_setting():
    def args(**kw):
        return ModelArguments(model_name_or_path="m", **kw)

    assert not args().use_packing  # auto with sdpa (the default attention): length-sorted padding
    # auto with flash_attention_2: packed where the model family declares packing exact
    assert args(attn_implementation="flash_attention_2").use_packing == "if_exact"
    assert args(packing=True).use_packing is True and args(packing="true").use_packing is True  # JSON or string
    assert not args(packing=False, attn_implementation="flash_attention_2").use_packing
    with pytest.raises(ConfigError, match="packing"):
        args(packing="sometimes")


# ---------------------------------------------------------------- which families may pack


def hidden_alone_and_packed(decoder, lengths, vocab, seed=0):
    """Final-layer states of random texts of these lengths: each run alone (no padding, no mask), and all in one
    packed call; as two lists of (n_i, H) tensors."""
    from llm2vec.packing import packed_call

    g = torch.Generator().manual_seed(seed)
    texts = [torch.randint(5, vocab, (n,), generator=g) for n in lengths]
    with torch.no_grad():
        alone = [decoder(input_ids=t[None], use_cache=False).last_hidden_state[0] for t in texts]
        packed = packed_call(decoder, texts, [torch.arange(n) for n in lengths], embeds=False)
    return alone, list(packed)


def max_relative_error(got, expected):
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, expected))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_call_equals_each_text_run_alone(tiny_models, family, attention):
    """The shipped families declare packing exact: a packed row's states equal each text run alone, with no padding
    and no batch (an independent reference: one plain forward per text)."""
    from llm2vec.templates import get_template

    assert get_template(family).packing_exact
    causal_lm, tokenizer = tiny_models[family]
    decoder = decoder_body(causal_lm)
    previous = decoder.config._attn_implementation
    decoder.set_attn_implementation(attention)
    try:
        alone, packed = hidden_alone_and_packed(decoder, [7, 1, 12, 4], len(tokenizer))
    finally:
        decoder.set_attn_implementation(previous)
    assert max_relative_error(packed, alone) < 1e-5


@pytest.mark.parametrize("model_type", ["opt", "bloom"])
def test_packing_is_not_exact_for_opt_and_bloom(model_type):
    """Why a family must declare it: OPT (positions learned from the attention mask) and Bloom (ALiBi) ignore the
    restarting position ids, so their packed rows differ from the texts run alone."""
    from transformers import AutoConfig, AutoModel

    size = {"hidden_size": 32, "num_attention_heads": 4}
    extra = {"opt": {"ffn_dim": 64, "num_hidden_layers": 2, "word_embed_proj_dim": 32}, "bloom": {"n_layer": 2}}
    config = AutoConfig.for_model(model_type, vocab_size=300, **size, **extra[model_type])
    torch.manual_seed(0)
    decoder = AutoModel.from_config(config).eval()
    alone, packed = hidden_alone_and_packed(decoder, [7, 9, 12], 300)
    assert max_relative_error(packed, alone) > 1e-3


@pytest.fixture
def unverified_family(monkeypatch):
    """The Llama-3 format registered again as a family that does not declare packing exact."""
    import dataclasses

    from llm2vec import templates

    spec = dataclasses.replace(templates.get_template("llama3"), name="llama3_unverified", packing_exact=False)
    monkeypatch.setitem(templates._REGISTRY, spec.name, spec)
    return spec.name


def test_packing_is_refused_for_a_family_that_does_not_declare_it(tiny_models, unverified_family):
    from llm2vec.llm2vec import PackingRefused

    causal_lm, tokenizer = tiny_models["llama3"]
    with pytest.raises(PackingRefused, match="does not declare packed decoder calls exact") as refused:
        LLM2Vec(causal_lm, tokenizer, template=unverified_family, packing=True)
    assert "\n" not in str(refused.value)
    assert not LLM2Vec(causal_lm, tokenizer, template=unverified_family, packing="if_exact").packing  # auto: off
    assert LLM2Vec(causal_lm, tokenizer, template="llama3", packing="if_exact").packing


def test_driver_refuses_packing_for_such_a_family_in_one_line(tiny_checkpoints, unverified_family, tmp_path, capsys):
    from _tiny_data import write_tiny_e5

    from llm2vec.training import main

    data = write_tiny_e5(tmp_path / "data", n=8, sources=("nq",))
    flags = ["--model_name_or_path", str(tiny_checkpoints["llama3"]), "--output_dir", str(tmp_path / "out")]
    flags += ["--dataset_file_path", str(data), "--e5_sources", '["nq"]', "--use_cpu", "true", "--max_steps", "1"]
    flags += ["--per_device_train_batch_size", "4", "--template", unverified_family, "--packing", "true"]
    assert main("II", flags) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # (after transformers' loading progress bar)
    assert error.startswith("error: command line: packing: the 'llama3_unverified' family")


# ---------------------------------------------------------------- the variable-length arguments


def probe_attention(name: str, use_boundaries: bool, seen: list):
    """Registers (transformers' public ``AttentionInterface``) an attention function that records the
    variable-length keyword arguments each layer receives. With ``use_boundaries`` it computes attention from
    ``cu_seq_lens_q`` alone, sequence by sequence, ignoring the mask and the position ids (what FlashAttention's
    variable-length kernel does; wrong boundaries give wrong states); without, it is sdpa."""
    import torch.nn.functional as F
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from llm2vec.packing import VARLEN_KWARGS

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        seen.append({k: kwargs.get(k) for k in VARLEN_KWARGS})
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        if not use_boundaries or cu_seq_lens is None:  # padded calls: plain sdpa with the mask
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        bounds = cu_seq_lens.tolist()
        out = torch.cat(
            [
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
                for q, k, v in zip(
                    *(x.split([b - a for a, b in zip(bounds, bounds[1:])], dim=2) for x in (query, key, value))
                )
            ],
            dim=2,
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


@contextlib.contextmanager
def attention_of(causal_lm, name):
    decoder = decoder_body(causal_lm)
    previous = decoder.config._attn_implementation
    decoder.set_attn_implementation(name)
    try:
        yield
    finally:
        decoder.set_attn_implementation(previous)


def test_packed_calls_pass_precomputed_boundaries_to_every_attention_layer(tiny_models):
    """Each layer's attention receives cu_seq_lens_q = cu_seq_lens_k = [0, n_1, n_1 + n_2, ...] (int32) and
    max_length_q = max_length_k = max n_i (a Python int, so no layer syncs the device), for the encoding call and
    for the reconstruction call; an attention that computes from those boundaries alone gives the padded step's
    embeddings and loss."""
    causal_lm, tokenizer = tiny_models["llama3"]
    seen = []
    name = probe_attention("varlen_probe", use_boundaries=True, seen=seen)
    padded = LLM2Vec(causal_lm, tokenizer)
    packed = LLM2Vec(causal_lm, tokenizer, packing=True)
    features = padded.tokenize(TEXTS)
    with torch.no_grad():
        ref = padded.embed(features)
        with attention_of(causal_lm, name):
            got = packed.embed(features)
    layers = causal_lm.config.num_hidden_layers
    assert len(seen) == layers
    lengths = features["attention_mask"].sum(1)
    expected = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    for kwargs in seen:
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            assert kwargs[key].dtype == torch.int32 and torch.equal(kwargs[key], expected)
        assert type(kwargs["max_length_q"]) is int and kwargs["max_length_q"] == kwargs["max_length_k"] == lengths.max()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    padded_I = LLM2Vec_q2d_d2q(causal_lm, tokenizer)
    packed_I = LLM2Vec_q2d_d2q(causal_lm, tokenizer, packing=True)
    batch = TrainCollator.for_encoder(padded_I, reconstruction="text")(examples())
    seen.clear()
    with torch.no_grad():
        ref_loss = padded_I(**batch).loss
        with attention_of(causal_lm, name):
            loss = packed_I(**batch).loss
    assert len(seen) == 2 * layers  # encoding and reconstruction, each one packed call
    reconstruction_lengths = [
        1 + n for side in ("positive_targets", "query_targets") for n in batch[side]["attention_mask"].sum(1).tolist()
    ]
    assert seen[-1]["cu_seq_lens_q"].diff().tolist() == reconstruction_lengths  # q2d's sequences, then d2q's
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)


def test_without_the_arguments_packing_falls_back_to_position_ids(tiny_models, monkeypatch):
    """Where transformers does not declare the arguments, or the decoder's forward takes no extra keyword
    arguments, none is passed and the packed call still equals the padded one (the boundaries then come from
    the restarting position ids)."""
    from llm2vec import packing

    causal_lm, tokenizer = tiny_models["qwen2"]
    decoder = decoder_body(causal_lm)
    assert packing.accepts_varlen_kwargs(decoder)

    class Explicit(torch.nn.Module):  # a decoder whose forward names its arguments: no **kwargs
        def __init__(self, inner):
            super().__init__()
            self.body = inner

        def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None, use_cache=None):
            return self.body(
                input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False
            )

    assert not packing.accepts_varlen_kwargs(Explicit(decoder))
    seen = []
    name = probe_attention("sdpa_probe", use_boundaries=False, seen=seen)
    padded = LLM2Vec(causal_lm, tokenizer)
    packed = LLM2Vec(causal_lm, tokenizer, packing=True)
    features = padded.tokenize(TEXTS)
    monkeypatch.setattr(packing, "transformers_takes_varlen_kwargs", lambda: False)  # as an older transformers
    assert not packing.accepts_varlen_kwargs(decoder)
    with torch.no_grad():
        ref = padded.embed(features)
        with attention_of(causal_lm, name):
            got = packed.embed(features)
    assert seen and all(v is None for kwargs in seen for v in kwargs.values())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
