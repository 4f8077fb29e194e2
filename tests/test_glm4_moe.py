"""GLM-4.5 (`Glm4MoeForCausalLM`) without transformers: the presets, the model against the
float64 reference (partial rotary, q/k/v biases without o's, dense first layers, sigmoid
group-limited routing with a selection bias, the shared expert), checkpoints in the published
layout (MTP layers skipped and said so, an FP8 one whose router is stored unquantized),
refusals by name, and the engine's arms byte for byte.
(tests/test_glm4_moe_parity.py compares with transformers itself.)"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from strata_jax.checkpoint import CheckpointError, load_checkpoint
from strata_jax.engine import Engine
from strata_jax.models import (FAMILIES, build_model, config_from_hf, forward, get_preset,
                               init_cache, param_shapes)
from strata_jax.reference import reference_forward
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import assert_close, hf_quantize, save_safetensors

# Three layers (one dense), 8 experts in 2 groups of which each token keeps 1, top-2.
F32 = get_preset("glm-4.5").scaled(n_experts=8, top_k=2, param_dtype="float32").replace(
    n_groups=2, topk_groups=1)
BF16 = F32.replace(param_dtype="bfloat16")


@pytest.fixture(scope="module")
def f32_params():
    params = dict(init_synthetic(F32, seed=1))
    for l in F32.moe_layers:  # biases that change choices: sigmoid scores lie in (0, 1)
        name = f"layers.{l}.mlp.selection_bias"
        params[name] = np.random.default_rng(l).uniform(-0.3, 0.3, F32.n_experts).astype(
            np.float32)
    return params


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, F32.vocab_size, n).astype(np.int32)


def test_presets_have_the_published_shapes():
    big, air = get_preset("glm-4.5"), get_preset("glm-4.5-air")
    assert "Glm4MoeForCausalLM" in FAMILIES
    assert (big.hidden_size, big.n_layers, big.n_experts, big.expert_intermediate,
            big.n_dense_layers, big.dense_intermediate, big.routed_scaling) == \
        (5120, 92, 160, 1536, 3, 12_288, 2.5)
    assert (air.hidden_size, air.n_layers, air.n_experts, air.expert_intermediate,
            air.n_dense_layers, air.dense_intermediate, air.routed_scaling) == \
        (4096, 46, 128, 1408, 1, 10_944, 1.0)
    for c in (big, air):
        assert (c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim, c.top_k) == (96, 8, 128, 64, 8)
        assert c.attention_biases == ("q", "k", "v") and c.shared_expert_intermediate
        assert c.router_scores == "sigmoid" and c.selection_bias
    assert (big.qk_norm, air.qk_norm) == ("per_head", "none")
    assert F32.rotary_dim == 8 and F32.head_dim == 16  # scaled keeps half of each head rotated
    shapes = param_shapes(F32)
    assert "layers.1.attn.o_bias" not in shapes and "layers.1.attn.q_bias" in shapes
    assert shapes["layers.1.mlp.selection_bias"].dtype == np.float32
    assert "layers.0.mlp.router" not in shapes and "layers.0.mlp.gate" in shapes  # dense


def test_model_matches_float64_reference_whole_and_in_chunks(f32_params):
    model = build_model(F32, f32_params)
    toks = _tokens(60)
    ref, ref_counts = reference_forward(F32, f32_params, toks)
    logits, _, counts = forward(model, toks, init_cache(F32, 64))
    assert_close(logits, ref, np.float32)
    np.testing.assert_array_equal(np.asarray(counts), ref_counts)
    cache, parts = init_cache(F32, 64), []
    for a, b in ((0, 17), (17, 41), (41, 60)):
        out, cache, _ = forward(model, toks[a:b], cache, start=a)
        parts.append(np.asarray(out))
    assert_close(np.concatenate(parts), ref, np.float32, err_msg="three chunks")


# ---- checkpoints as the files store them ---------------------------------------------------------


def _swiglu(t, hf, params, ours):
    for mine, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        t[f"{hf}{proj}.weight"] = params[ours + mine].T


def _hf_tensors(c, params, mtp: int = 1):
    """Our params in GLM-4.5's names and layouts, written by hand; `mtp` extra layers numbered
    after the decoder's, as the published checkpoints hold them."""
    t = {"model.embed_tokens.weight": params["embed"], "model.norm.weight":
         params["final_norm.weight"], "lm_head.weight": params["lm_head"].T}
    for l in range(c.n_layers):
        p, q = f"layers.{l}.", f"model.layers.{l}."
        t[q + "input_layernorm.weight"] = params[p + "input_norm.weight"]
        t[q + "post_attention_layernorm.weight"] = params[p + "post_attn_norm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[q + f"self_attn.{proj}.weight"] = params[p + f"attn.{proj}"].T
        for b in "qkv":
            t[q + f"self_attn.{b}_proj.bias"] = params[p + f"attn.{b}_bias"]
        for norm in ("q_norm", "k_norm"):
            t[q + f"self_attn.{norm}.weight"] = params[p + f"attn.{norm}.weight"]
        if l not in c.moe_layers:
            _swiglu(t, q + "mlp.", params, p + "mlp.")
            continue
        t[q + "mlp.gate.weight"] = params[p + "mlp.router"].T
        t[q + "mlp.gate.e_score_correction_bias"] = params[p + "mlp.selection_bias"]
        _swiglu(t, q + "mlp.shared_experts.", params, p + "mlp.shared.")
        for ours, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            w = params[p + f"mlp.{ours}"]
            for e in range(c.n_experts):
                t[q + f"mlp.experts.{e}.{hf}.weight"] = w[e].T
    for i in range(mtp):
        q = f"model.layers.{c.n_layers + i}."
        t[q + "eh_proj.weight"] = np.ones((c.hidden_size, 2 * c.hidden_size), np.float32)
        t[q + "enorm.weight"] = np.ones(c.hidden_size, np.float32)
        t[q + "mlp.experts.0.up_proj.weight"] = np.ones((4, c.hidden_size), np.float32)
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def _config(c, **fields) -> dict:
    """GLM-4.5's config.json of `c` (transformers 4 spellings, as the published one)."""
    cfg = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
               vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.n_layers,
               num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
               head_dim=c.head_dim, partial_rotary_factor=c.rotary_dim / c.head_dim,
               n_routed_experts=c.n_experts, num_experts_per_tok=c.top_k,
               moe_intermediate_size=c.expert_intermediate,
               intermediate_size=c.dense_intermediate, first_k_dense_replace=c.n_dense_layers,
               n_shared_experts=c.shared_expert_intermediate // c.expert_intermediate,
               n_group=c.n_groups, topk_group=c.topk_groups, norm_topk_prob=c.norm_topk_prob,
               routed_scaling_factor=c.routed_scaling, use_qk_norm=c.qk_norm == "per_head",
               attention_bias=c.attention_bias, rms_norm_eps=c.rms_norm_eps,
               max_position_embeddings=c.max_seq_len, rope_theta=c.rope_theta,
               rope_scaling=None, num_nextn_predict_layers=1, hidden_act="silu",
               tie_word_embeddings=False, torch_dtype=c.param_dtype, eos_token_id=[1, 2])
    cfg.update(fields)
    return {k: v for k, v in cfg.items() if v is not None}


def _write(path, tensors, cfg):
    save_safetensors(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg))


def test_checkpoint_loads_as_stored_and_skips_the_mtp_layer(tmp_path, f32_params, capsys):
    params = {k: np.asarray(f32_params[k]) for k in param_shapes(F32)}
    _write(tmp_path, _hf_tensors(F32, params), _config(F32))
    ckpt = load_checkpoint(str(tmp_path), progress=True)
    assert "skipped 3 tensor(s) under 'model.layers.3.'" in capsys.readouterr().err
    assert list(ckpt.skipped) == ["model.layers.3."] and ckpt.skipped["model.layers.3."][0] == 3
    assert ckpt.config == F32.replace(name="glm4_moe")
    assert set(ckpt.params) | set(ckpt.experts) == set(param_shapes(F32))
    for name, value in ckpt.params.items():
        np.testing.assert_array_equal(value, params[name], err_msg=name)
    for name in ckpt.experts:
        np.testing.assert_array_equal(ckpt.experts[name], params[name], err_msg=name)


def test_bf16_checkpoint_keeps_the_selection_bias_float32(tmp_path, f32_params):
    """The published checkpoints store e_score_correction_bias (and the router) in float32
    beside bfloat16 weights: the bias stays float32."""
    params = {k: np.asarray(f32_params[k]) for k in param_shapes(F32)}
    tensors = {k: v if "e_score" in k or "mlp.gate.weight" in k else v.astype(ml_dtypes.bfloat16)
               for k, v in _hf_tensors(F32, params, mtp=0).items()}
    _write(tmp_path, tensors, _config(F32, torch_dtype="bfloat16", num_nextn_predict_layers=0))
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert ckpt.config.param_dtype == "bfloat16" and not ckpt.skipped
    bias = ckpt.params["layers.1.mlp.selection_bias"]
    assert bias.dtype == np.float32
    np.testing.assert_array_equal(bias, params["layers.1.mlp.selection_bias"])


def test_fp8_checkpoint_reads_its_router_unquantized(tmp_path, f32_params):
    """FP8: attention and experts quantized; modules_to_not_convert names the dense and shared
    MLPs but not the router, which transformers never converts (a parameter, not a linear)."""
    params = {k: np.asarray(f32_params[k]) for k in param_shapes(F32)}
    tensors = hf_quantize(_hf_tensors(F32, params, mtp=0), "fp8", 16)
    keep = ["lm_head", "model.layers.0.mlp"] + [f"model.layers.{l}.mlp.shared_experts"
                                                for l in F32.moe_layers]
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [16, 16], "modules_to_not_convert": keep}
    _write(tmp_path, tensors, _config(F32, quantization_config=quant))
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert ckpt.config.expert_format == "fp8"
    np.testing.assert_array_equal(ckpt.params["layers.1.mlp.router"],
                                  params["layers.1.mlp.router"])
    np.testing.assert_array_equal(ckpt.params["layers.0.mlp.gate"], params["layers.0.mlp.gate"])
    q = ckpt.params["layers.1.attn.q_proj"]
    assert not np.array_equal(q, params["layers.1.attn.q_proj"])  # dequantized
    np.testing.assert_allclose(q, params["layers.1.attn.q_proj"], atol=0.1 * np.abs(q).max())


def test_fields_read_with_transformers_defaults():
    base = _config(F32)
    for key in ("partial_rotary_factor", "first_k_dense_replace", "n_shared_experts",
                "num_nextn_predict_layers"):
        del base[key]
    c = config_from_hf(base)
    assert c.rotary_dim == F32.head_dim // 2 and c.n_dense_layers == 1
    assert c.shared_expert_intermediate == c.expert_intermediate
    none = config_from_hf(_config(F32, n_shared_experts=0, attention_bias=False,
                                  use_qk_norm=False, partial_rotary_factor=1.0))
    assert none.shared_expert_intermediate == 0 and none.attention_biases == ()
    assert none.qk_norm == "none" and none.rotary_dim == 0
    v5 = _config(F32, rope_theta=None, partial_rotary_factor=None, num_nextn_predict_layers=None,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                  "partial_rotary_factor": 0.25}, num_mtp_layers=2,
                 n_routed_experts=None, num_local_experts=8)
    assert config_from_hf(v5).rotary_dim == 4 and config_from_hf(v5).n_experts == 8


REFUSED = [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_experts": 8}, "num_experts=8"),  # not GLM's spelling
    ({"mystery": 1}, "mystery=1"),
    ({"partial_rotary_factor": 0.0625}, "partial_rotary_factor=0.0625"),  # one dim
    ({"num_local_experts": 16}, "spellings disagree"),
    ({"num_mtp_layers": 3}, "spellings disagree"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace=-1"),
    ({"n_shared_experts": -1}, "n_shared_experts=-1"),
    ({"use_qk_norm": "yes"}, "use_qk_norm='yes'"),
    ({"model_type": "deepseek_v3"}, "model_type='deepseek_v3'"),
]


@pytest.mark.parametrize("fields,match", REFUSED, ids=[m for _, m in REFUSED])
def test_fields_the_model_does_not_implement_are_refused_by_name(fields, match):
    with pytest.raises(CheckpointError, match=match):
        config_from_hf(_config(F32, **fields))


def test_bad_bias_configs_name_the_field():
    with pytest.raises(ValueError, match="attention_out_bias=False"):
        F32.replace(attention_bias=False)
    with pytest.raises(ValueError, match="rotary_dim=3"):
        F32.replace(rotary_dim=3)


ARMS = {
    "resident": None,
    "stream-all": StreamConfig(routed=False, tuning=StreamTuning(stream_floor=32)),
    "routed": StreamConfig(routed=True, tuning=StreamTuning(stream_floor=4096)),
}


@pytest.mark.slow  # the decoder's arms; tests/test_glm4_moe_parity.py runs them against transformers
def test_engine_arms_are_byte_identical_across_turns():
    """bf16: 70 tokens in chunks of 32 (the last padded), then a 20-token follow-up turn; every
    arm's logits and KV caches equal the resident arm's bit for bit."""
    params = init_synthetic(BF16, seed=2, routing_skew=2.0)
    toks = _tokens(90, seed=4)
    seen = {}
    for arm, stream in ARMS.items():
        with Engine(BF16, params, stream, max_context=128, chunk_size=32) as eng:
            first = eng.prefill(toks[:70])
            second = eng.prefill(toks[70:], first.session)
            seen[arm] = (first.logits.tobytes(), first.session.kv_sha256(),
                         second.logits.tobytes(), second.session.kv_sha256())
    assert seen["stream-all"] == seen["resident"]
    assert seen["routed"] == seen["resident"]
