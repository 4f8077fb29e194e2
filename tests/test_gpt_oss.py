"""gpt-oss (`GptOssForCausalLM`) without transformers: the presets, the model against the float64
reference (attention sinks, alternating sliding windows, router and expert biases, the clamped
SwiGLU), checkpoints in the published layouts (fused experts; bf16 and MXFP4 `_blocks` /
`_scales`), refusals by name, and the engine's arms byte for byte with MXFP4 experts.
(tests/test_gpt_oss_parity.py compares with transformers itself.)"""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest

from strata_jax.checkpoint import CheckpointError, load_checkpoint
from strata_jax.engine import Engine
from strata_jax.formats import ExpertFormat, quantized_config
from strata_jax.models import (FAMILIES, build_model, config_from_hf, forward, get_preset,
                               init_cache, param_shapes)
from strata_jax.reference import reference_forward
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import (PoisonUnrouted, assert_close, gpt_oss_mxfp4, hf_config,
                                hf_tensors, read_in_chunks, save_safetensors,
                                write_hf_checkpoint)
from strata_jax.weights import QuantizedParams

PRESET = "gpt-oss-20b"
# Four layers alternating sliding (window 8) and full, 8 experts, top-2; hidden 64, width 64
# (whole MXFP4 packs); a clamp of 0.5 so the random products reach it.
F32 = get_preset(PRESET).scaled(n_layers=4, n_experts=8, top_k=2, param_dtype="float32").replace(
    sliding_window=8, swiglu_limit=0.5)
BF16 = F32.replace(param_dtype="bfloat16")


@pytest.fixture(scope="module")
def f32_params():
    return {k: np.asarray(v) for k, v in init_synthetic(F32, seed=1).items()}


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, F32.vocab_size, n).astype(np.int32)


def _write(path, c, tensors, **fields):
    save_safetensors(tensors, path / "model.safetensors")
    cfg = {**hf_config(c, "GptOssForCausalLM"), **fields}
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                  if v is not None}))


def test_presets_have_the_published_shapes():
    big, small = get_preset("gpt-oss-120b"), get_preset("gpt-oss-20b")
    assert "GptOssForCausalLM" in FAMILIES
    assert (big.n_layers, big.n_experts, small.n_layers, small.n_experts) == (36, 128, 24, 32)
    for c in (big, small):
        assert (c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.top_k,
                c.expert_intermediate, c.vocab_size) == (2880, 64, 8, 64, 4, 2880, 201_088)
        assert c.attention_sinks and c.router_bias and c.expert_bias
        assert (c.expert_act, c.swiglu_limit, c.swiglu_alpha) == ("clamped_swiglu", 7.0, 1.702)
        assert c.attention_biases == ("q", "k", "v", "o") and c.sliding_window == 128
        assert [c.window_of(i) for i in range(4)] == [128, None, 128, None]
        assert c.rope_scaling.rope_type == "yarn" and not c.rope_scaling.truncate
    # Fewer layers (--layers, the benchmarks' slices) keep the published alternation.
    assert small.replace(n_layers=3).layer_types == (
        "sliding_attention", "full_attention", "sliding_attention")
    # MXFP4 is the release's expert format: 4.25 bits a weight, the biases beside them.
    fmt = ExpertFormat.of(quantized_config(big, "mxfp4", 0))
    h, i = 2880, 2880
    assert fmt.blob_bytes == 3 * h * i // 2 + 3 * h * i // 32 + 2 * (2 * i + h)
    shapes = param_shapes(F32)
    assert shapes["layers.0.attn.sinks"].shape == (F32.n_heads,)
    assert shapes["layers.0.mlp.router_bias"].shape == (F32.n_experts,)
    assert shapes["layers.0.mlp.gate_bias"].shape == (F32.n_experts, F32.expert_intermediate)


def test_published_config_json_reads_as_the_preset():
    """gpt-oss-120b's config.json as the hub has it (the original code's spellings beside
    transformers', MXFP4 experts): the preset, with MXFP4 experts."""
    big = get_preset("gpt-oss-120b")
    hub = dict(
        architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0,
        eos_token_id=200002, experts_per_token=4, head_dim=64, hidden_act="silu",
        hidden_size=2880, initial_context_length=4096, initializer_range=0.02,
        intermediate_size=2880, layer_types=list(big.layer_types),
        max_position_embeddings=131072, model_type="gpt_oss", num_attention_heads=64,
        num_experts_per_tok=4, num_hidden_layers=36, num_key_value_heads=8,
        num_local_experts=128, output_router_logits=False, pad_token_id=199999,
        quantization_config={"modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"], "quant_method": "mxfp4"},
        rms_norm_eps=1e-05, rope_scaling={
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0,
        tie_word_embeddings=False, transformers_version="4.55.0.dev0", use_cache=True,
        vocab_size=201088)
    c = config_from_hf(hub)
    assert c == big.replace(name="gpt_oss", expert_format="mxfp4", expert_block=32)
    # transformers' defaults where the file is silent: yarn x32, alternating layers, 1.702.
    for key in ("rope_scaling", "layer_types", "experts_per_token", "initial_context_length"):
        del hub[key]
    assert config_from_hf(hub) == c
    kept = dict(hub, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert":
                                          ["model.layers.*.mlp.experts", "lm_head"]})
    assert config_from_hf(kept).expert_format == "plain"


REFUSED = [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"experts_per_token": 3}, "spellings disagree"),
    ({"swiglu_limit": -1.0}, "swiglu_limit=-1.0"),
    ({"swiglu_alpha": "x"}, "swiglu_alpha='x'"),
    ({"mystery": 1}, "mystery=1"),
    ({"layer_types": "full_attention"}, "layer_types='full_attention'"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ({"model_type": "mixtral"}, "model_type='mixtral'"),
    ({"quantization_config": {"quant_method": "mxfp4", "group_size": 64}}, "group_size=64"),
    ({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.0.mlp.experts"]}}, "some layers' routed experts"),
]


@pytest.mark.parametrize("fields,match", REFUSED, ids=[m for _, m in REFUSED])
def test_fields_the_model_does_not_implement_are_refused_by_name(fields, match):
    with pytest.raises(CheckpointError, match=match):
        config_from_hf({**hf_config(F32, "GptOssForCausalLM"), **fields})


def test_model_matches_float64_reference_past_the_window(f32_params):
    """60 tokens (past the window of 8) whole and in three chunks: the sinks, windows, biases
    and the clamp (reached: limit 0.5) against the float64 formulas."""
    model = build_model(F32, f32_params)
    toks = _tokens(60)
    ref, ref_counts = reference_forward(F32, f32_params, toks)
    logits, _, counts = forward(model, toks, init_cache(F32, 64))
    assert_close(logits, ref, np.float32)
    np.testing.assert_array_equal(np.asarray(counts), ref_counts)
    parts = [np.asarray(out) for *_, out in read_in_chunks(model, toks, (0, 17, 41, 60),
                                                          init_cache(F32, 64))]
    assert_close(np.concatenate(parts), ref, np.float32, err_msg="three chunks")
    # The clamp is reached: without it the reference moves.
    loose = reference_forward(F32.replace(swiglu_limit=1e3), f32_params, toks)[0]
    assert np.abs(loose - ref).max() > 1e-3


def test_bf16_checkpoint_loads_fused_experts_as_stored(tmp_path, f32_params):
    params = {k: np.asarray(f32_params[k]) for k in param_shapes(F32)}
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_tensors(F32, params, PRESET).items()}
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 128)
    write_hf_checkpoint(tmp_path, BF16, PRESET, tensors, shards=3)  # a layer across shards
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert ckpt.config == BF16.replace(name="gpt_oss", max_seq_len=131_072)  # yarn x32
    assert set(ckpt.params) | set(ckpt.experts) == set(param_shapes(BF16))
    for name in (*ckpt.params, *ckpt.experts):
        got = ckpt.params[name] if name in ckpt.params else ckpt.experts[name]
        want = params[name].astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got, want, err_msg=name)


def _mxfp4_checkpoint(path, params):
    """`params` (float32) written as the release stores them: bf16 non-expert weights and
    biases, MXFP4 gate_up/down blocks and scales; returns the MXFP4 config and its planes."""
    q = quantized_config(BF16, "mxfp4", 0)
    fmt = ExpertFormat.of(q)
    quant = QuantizedParams(params, q)
    planes = {l: {p: quant[f"layers.{l}.mlp.{p}"] for p in ("gate", "gate_scale", "up",
                                                          "up_scale", "down", "down_scale")}
              for l in q.moe_layers}
    tensors = {k: v.astype(ml_dtypes.bfloat16)
               for k, v in hf_tensors(F32, params, PRESET).items()}
    tensors = gpt_oss_mxfp4(F32, tensors, planes.__getitem__)
    _write(path, BF16, tensors, quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]})
    return q, fmt, planes


def test_mxfp4_checkpoint_keeps_its_experts_mxfp4(tmp_path, f32_params):
    q, fmt, planes = _mxfp4_checkpoint(tmp_path, f32_params)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert ckpt.config == q.replace(name="gpt_oss", expert_block=32, max_seq_len=131_072)
    for l in q.moe_layers:
        for p, want in planes[l].items():
            np.testing.assert_array_equal(ckpt.experts[f"layers.{l}.mlp.{p}"], want)
        bias = ckpt.experts[f"layers.{l}.mlp.up_bias"]
        np.testing.assert_array_equal(bias, f32_params[f"layers.{l}.mlp.up_bias"].astype(
            ml_dtypes.bfloat16))
    # A layer's blob holds its weights' 4.25 bits, then the biases.
    assert ckpt.experts.blobs(q.moe_layers[0]).shape == (q.n_experts, fmt.blob_bytes)
    # The model reads the MXFP4 values: logits near the bf16 model's (a 4-bit grid).
    model = ckpt.build_model()
    toks = _tokens(24)
    logits = np.asarray(forward(model, toks, init_cache(ckpt.config, 32))[0])
    assert np.isfinite(logits).all()


def test_a_bias_the_model_lacks_must_be_zero(tmp_path, f32_params):
    params = {k: np.asarray(f32_params[k]) for k in param_shapes(F32)}
    tensors = hf_tensors(F32, params, PRESET)
    tensors["model.layers.0.self_attn.q_proj.weight_blocks"] = np.zeros((4, 2), np.uint8)
    _write(tmp_path, F32, tensors)
    with pytest.raises(CheckpointError, match="weight_blocks"):
        load_checkpoint(str(tmp_path), progress=False)


ARMS = {
    "resident": (None, {}),
    "stream-all": (StreamConfig(routed=False, tuning=StreamTuning(stream_floor=16)), {}),
    "routed": (StreamConfig(routed=True, tuning=StreamTuning(stream_floor=4096)), {}),
    "layer-major": (StreamConfig(routed=True), {"order": "layer-major"}),
}


@pytest.mark.slow  # the arms against transformers: tests/test_gpt_oss_parity.py
def test_engine_arms_are_byte_identical_with_mxfp4_experts_across_turns(tmp_path, f32_params):
    """The MXFP4 checkpoint: 40 tokens in chunks of 16 (past the window, the last chunk
    padded), then a 20-token follow-up turn; every arm's logits and caches equal the resident
    arm's bit for bit."""
    _mxfp4_checkpoint(tmp_path, f32_params)
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    toks = _tokens(60, seed=4)
    seen = {}
    for arm, (stream, kw) in ARMS.items():
        with Engine(ckpt.config, ckpt.params, stream, experts=ckpt.experts.as_mapping(),
                    max_context=64, chunk_size=16) as eng:
            first = eng.prefill(toks[:40], **kw)
            second = eng.prefill(toks[40:], first.session, **kw)
            seen[arm] = (first.logits, first.session.kv_sha256(), second.logits,
                         second.session.kv_sha256())
    for arm in ("stream-all", "routed"):
        for got, want in zip(seen[arm], seen["resident"]):
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), arm
    # Layer-major runs the same math in another order (the tolerance table bounds it).
    for turn in (0, 2):
        assert_close(seen["layer-major"][turn], seen["resident"][turn], np.float32)


def test_unrouted_experts_biases_are_never_read(f32_params):
    """A 5-token chunk routes to few of the 8 experts: NaN in every other expert's weights
    and biases changes no output bit (the bias rows are taken by each row's own expert)."""
    model = build_model(F32, f32_params)
    toks = _tokens(3)
    resident = forward(model, toks, init_cache(F32, 8))
    assert (np.asarray(resident[2]) == 0).any()  # some expert is unrouted
    poisoned = forward(model, toks, init_cache(F32, 8), expert_source=PoisonUnrouted())
    for a, b in zip(jax.tree.leaves(resident), jax.tree.leaves(poisoned)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
