"""Multi-head latent attention and the DeepSeek-V3 family without transformers: the model
against the float64 reference of the published formulas, the latent cache, the engine's arms
byte for byte, checkpoints as the files store them (FP8 with block scales included), and
refusals by name. (tests/test_deepseek_parity.py compares with transformers itself.)"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from strata_jax.checkpoint import CheckpointError, load_checkpoint
from strata_jax.engine import Engine
from strata_jax.engine.memory import memory_plan
from strata_jax.layers import mla as mla_layer
from strata_jax.models import (build_model, cache_bytes, config_from_hf, forward, get_preset,
                               init_cache, mla, model_module, param_shapes)
from strata_jax.reference import reference_forward
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import assert_close, fp8_block_quantize, save_safetensors

F32 = get_preset("deepseek-v3").scaled(n_experts=8, top_k=2, param_dtype="float32")
BF16 = F32.replace(param_dtype="bfloat16")


@pytest.fixture(scope="module")
def f32_params():
    return init_synthetic(F32, seed=1)


@pytest.fixture
def small_blocks(monkeypatch):
    """Prefix blocks of 16 positions: a later chunk's prefix spans several."""
    monkeypatch.setattr(mla_layer, "PREFIX_BLOCK_BYTES", 1)
    monkeypatch.setattr(mla_layer, "PREFIX_MIN_BLOCK", 16)


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, F32.vocab_size, n).astype(np.int32)


def test_preset_is_the_published_shape_with_a_latent_cache():
    ds = get_preset("deepseek-v3")
    assert isinstance(ds, mla.MLAConfig) and model_module(ds) is mla
    assert (ds.n_layers, ds.n_heads, ds.head_dim, ds.qk_rope_dim, ds.v_head_dim) == \
        (61, 128, 192, 64, 128)
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.n_dense_layers, ds.n_experts) == \
        (1536, 512, 3, 256)
    assert ds.softmax_multiplier == pytest.approx((0.1 * np.log(40) + 1) ** 2)
    per_position = cache_bytes(ds, 2) - cache_bytes(ds, 1)
    assert per_position == 576 * 61 * 2  # latent 512 + rotary key 64, bf16, 61 layers
    per_head = 61 * ds.n_heads * (ds.head_dim + ds.v_head_dim) * 2
    assert per_head / per_position >= 50
    plan = memory_plan(ds, max_context=32_768)
    assert plan["kv_bytes"] == cache_bytes(ds, 32_768)
    assert plan["kv_values_per_position"] == 576 * 61
    assert plan["kv_values_per_position_per_head"] * 2 == per_head
    shapes = param_shapes(F32)
    assert shapes["layers.1.attn.kv_a_proj"].shape == (64, 32 + 8)
    assert shapes["layers.1.attn.kv_b_proj"].shape == (32, 2 * (16 + 16))
    assert shapes["layers.1.mlp.selection_bias"].dtype == np.float32
    assert "layers.0.mlp.gate" in shapes and "layers.0.mlp.router" not in shapes  # dense


def test_later_chunk_holds_one_prefix_block_at_a_time():
    """A later chunk at a traced start (the engine's) over DeepSeek-V3's heads: XLA's buffers
    (compiled, not run) stay within the plan's working memory. Each block's part is merged
    inside its `lax.cond`; merged after it, the 16 parts' float32 outputs were all alive at
    once (2.2 GB here against a 1.7 GB plan; on a GPU 5.3 GB against 3.6 at 8K over 32K)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from strata_jax.engine.memory import attention_working_bytes
    from strata_jax.kernels import Kernels

    ds = get_preset("deepseek-v3")
    t, capacity = 1024, 8192
    assert capacity // mla_layer.prefix_block(ds.n_heads, ds.head_dim, 2, t, capacity,
                                              False) == 16
    graph, state = nnx.split(nnx.eval_shape(lambda: mla_layer.LatentAttention(
        ds, rngs=nnx.Rngs(0), layer=0, kernels=Kernels())))
    sds = jax.ShapeDtypeStruct

    def later(state, x, latent, rope, start):
        return nnx.merge(graph, state)(x, latent, rope, start,
                                       start + jnp.arange(t, dtype=jnp.int32))

    held = jax.jit(later).trace(
        jax.tree.map(lambda a: sds(a.shape, a.dtype), state), sds((t, ds.hidden_size), ds.dtype),
        sds((capacity, ds.kv_lora_rank), ds.dtype), sds((capacity, ds.qk_rope_dim), ds.dtype),
        sds((), jnp.int32)).lower().compile().memory_analysis().temp_size_in_bytes
    assert held <= attention_working_bytes(ds, t, capacity, first=False, platform="cpu")


def test_cache_holds_latents_and_rotary_keys():
    cache = init_cache(F32, 64)
    assert cache.keys[0].shape == (64, F32.kv_lora_rank)
    assert cache.values[0].shape == (64, F32.qk_rope_dim)
    assert cache.valid(10).keys[2].shape == (10, F32.kv_lora_rank)
    assert cache_bytes(F32, 64) == sum(a.nbytes for a in cache.keys + cache.values)
    with pytest.raises(ValueError, match="capacity"):
        init_cache(F32, F32.max_seq_len + 1)


@pytest.mark.parametrize("q_lora", [24, pytest.param(0, marks=pytest.mark.slow)])
def test_model_matches_float64_reference_whole_and_in_chunks(f32_params, small_blocks, q_lora):
    """One chunk, then three chunks whose prefixes span several 16-position blocks (a
    traced start), against the float64 reference (YaRN with its softmax-scale correction and
    interleaved rotary pairs, the preset's)."""
    c = F32.replace(q_lora_rank=q_lora)
    params = f32_params if q_lora else init_synthetic(c, seed=3)
    model = build_model(c, params)
    toks = _tokens(70, seed=1)
    ref, _ = reference_forward(c, params, toks)
    whole, _, _ = forward(model, toks, init_cache(c, 96))
    assert_close(whole, ref, np.float32, err_msg="one chunk")
    cache, parts, at = init_cache(c, 96), [], 0
    for n in (23, 1, 46):
        out, cache, _ = forward(model, toks[at:at + n], cache, start=at)
        parts.append(np.asarray(out))
        at += n
    assert_close(np.concatenate(parts), ref, np.float32, err_msg="three chunks")


def test_half_split_rotary_dims_match_the_reference(small_blocks):
    c = F32.replace(rope_interleave=False, rope_scaling=None)
    params = init_synthetic(c, seed=4)
    toks = _tokens(40, seed=2)
    ref, _ = reference_forward(c, params, toks)
    out, _, _ = forward(build_model(c, params), toks, init_cache(c, 64))
    assert_close(out, ref, np.float32)


ARMS = {
    "resident": None,
    "stream-all": StreamConfig(routed=False, tuning=StreamTuning(stream_floor=16)),
    "routed": StreamConfig(routed=True, tuning=StreamTuning(stream_floor=4096)),
}


@pytest.mark.slow  # the arms against transformers: tests/test_deepseek_parity.py
@pytest.mark.parametrize("order", ["chunk-major", "layer-major"])
def test_engine_arms_are_byte_identical_across_turns(order):
    """bf16: 70 tokens in chunks of 32 (the last padded), then a 19-token follow-up turn;
    every arm's logits and session (the latent caches) equal the resident arm's bit for bit."""
    params = init_synthetic(BF16, seed=2, routing_skew=2.0)
    toks = _tokens(89, seed=4)
    seen = {}
    for arm, stream in ARMS.items():
        with Engine(BF16, params, stream, max_context=128, chunk_size=32, order=order) as eng:
            first = eng.prefill(toks[:70])
            second = eng.prefill(toks[70:], first.session)
            seen[arm] = (first.logits.tobytes(), first.session.kv_sha256(),
                         second.logits.tobytes(), second.session.kv_sha256())
            assert second.session.valid_cache().keys[0].shape == (89, BF16.kv_lora_rank)
    assert seen["stream-all"] == seen["resident"]
    assert seen["routed"] == seen["resident"]


@pytest.mark.slow
def test_layer_major_and_follow_up_turn_read_the_prompt_alike(f32_params, small_blocks):
    toks = _tokens(90, seed=5)
    with Engine(F32, f32_params, None, max_context=128, chunk_size=32) as eng:
        whole = eng.prefill(toks)
        layer_major = eng.prefill(toks, order="layer-major")
        first = eng.prefill(toks[:53])
        second = eng.prefill(toks[53:], first.session)
    assert_close(layer_major.logits, whole.logits, np.float32)
    assert_close(second.logits, whole.logits, np.float32)


# ---- checkpoints as the files store them ---------------------------------------------------------


def _hf_tensors(c, params):
    """Our params in DeepSeek-V3's names and [out, in] layout, written by hand."""
    t = {"model.embed_tokens.weight": params["embed"], "model.norm.weight":
         params["final_norm.weight"], "lm_head.weight": params["lm_head"].T}
    names = {"q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_b_proj": "q_b_proj",
             "kv_a_proj": "kv_a_proj_with_mqa", "kv_b_proj": "kv_b_proj", "o_proj": "o_proj",
             "q_norm.weight": "q_a_layernorm", "kv_norm.weight": "kv_a_layernorm"}
    for l in range(c.n_layers):
        p, q = f"layers.{l}.", f"model.layers.{l}."
        t[q + "input_layernorm.weight"] = params[p + "input_norm.weight"]
        t[q + "post_attention_layernorm.weight"] = params[p + "post_attn_norm.weight"]
        for ours, hf in names.items():
            if p + "attn." + ours in params:
                w = params[p + "attn." + ours]
                t[q + f"self_attn.{hf}.weight"] = w if ours.endswith("weight") else w.T
        projections = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
        if l not in c.moe_layers:
            for ours, hf in projections:
                t[q + f"mlp.{hf}.weight"] = params[p + f"mlp.{ours}"].T
            continue
        t[q + "mlp.gate.weight"] = params[p + "mlp.router"].T
        t[q + "mlp.gate.e_score_correction_bias"] = params[p + "mlp.selection_bias"]
        for ours, hf in projections:
            t[q + f"mlp.shared_experts.{hf}.weight"] = params[p + f"mlp.shared.{ours}"].T
            for e in range(c.n_experts):
                t[q + f"mlp.experts.{e}.{hf}.weight"] = params[p + f"mlp.{ours}"][e].T
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def _config(c, **fields) -> dict:
    s = c.rope_scaling
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
               vocab_size=c.vocab_size, hidden_size=c.hidden_size,
               intermediate_size=c.dense_intermediate,
               moe_intermediate_size=c.expert_intermediate, num_hidden_layers=c.n_layers,
               num_attention_heads=c.n_heads, num_key_value_heads=c.n_heads,
               n_shared_experts=1, n_routed_experts=c.n_experts,
               routed_scaling_factor=c.routed_scaling, kv_lora_rank=c.kv_lora_rank,
               q_lora_rank=c.q_lora_rank or None, qk_rope_head_dim=c.qk_rope_dim,
               v_head_dim=c.v_head_dim, qk_nope_head_dim=c.qk_nope_dim, n_group=c.n_groups,
               topk_group=c.topk_groups, num_experts_per_tok=c.top_k,
               first_k_dense_replace=c.n_dense_layers, norm_topk_prob=True, hidden_act="silu",
               max_position_embeddings=c.max_seq_len, rms_norm_eps=c.rms_norm_eps,
               rope_theta=c.rope_theta, rope_scaling={
                   "type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast,
                   "beta_slow": s.beta_slow, "mscale": s.mscale,
                   "mscale_all_dim": s.mscale_all_dim,
                   "original_max_position_embeddings": s.original_max_position_embeddings},
               tie_word_embeddings=False, torch_dtype=c.param_dtype, topk_method="noaux_tc",
               scoring_func="sigmoid", moe_layer_freq=1, num_nextn_predict_layers=1,
               ep_size=1, aux_loss_alpha=0.001, seq_aux=True, attention_bias=False)
    cfg.update(fields)
    return cfg


def _write(path, c, tensors, **fields):
    save_safetensors(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(_config(c, **fields)))


def test_checkpoint_loads_as_stored_and_skips_its_mtp_layer(tmp_path, f32_params, capsys):
    params = {k: np.asarray(f32_params[k]) for k in param_shapes(F32)}
    tensors = _hf_tensors(F32, params)
    mtp = f"model.layers.{F32.n_layers}."
    tensors.update({mtp + "eh_proj.weight": np.ones((4, 8), np.float32),
                    mtp + "enorm.weight": np.ones(4, np.float32)})
    _write(tmp_path, F32, tensors)
    ckpt = load_checkpoint(str(tmp_path), progress=True)
    assert f"skipped 2 tensor(s) under '{mtp}'" in capsys.readouterr().err
    assert set(ckpt.skipped) == {mtp}
    # YaRN's context: factor x its original positions.
    assert ckpt.config == F32.replace(name="deepseek_v3", max_seq_len=40 * 4096)
    for name, value in ckpt.params.items():
        np.testing.assert_array_equal(value, params[name], err_msg=name)
        assert value.dtype == params[name].dtype, name
    for name in ckpt.experts:
        np.testing.assert_array_equal(ckpt.experts[name], params[name], err_msg=name)
    # Without num_nextn_predict_layers the extra layer is a tensor the load does not read.
    _write(tmp_path, F32, tensors, num_nextn_predict_layers=0)
    with pytest.raises(CheckpointError, match="eh_proj"):
        load_checkpoint(str(tmp_path), progress=False)


def test_fp8_checkpoint_keeps_fp8_experts_and_dequantizes_the_rest(tmp_path, f32_params):
    """DeepSeek's release: every linear FP8 with b x b block scales but the router (no
    modules_to_not_convert); the router and its float32 bias read as stored, the experts
    stay FP8, every other linear is dequantized as the published formula gives."""
    block = 16
    params = {k: np.asarray(f32_params[k]) for k in param_shapes(F32)}
    plain = _hf_tensors(F32.replace(param_dtype="bfloat16"), params)
    tensors, scales = {}, {}
    for name, w in plain.items():
        linear = (name.endswith(".weight") and w.ndim == 2 and "norm" not in name
                  and "embed" not in name and "lm_head" not in name
                  and not name.endswith("mlp.gate.weight"))
        if linear:
            q, s = fp8_block_quantize(w, block)
            tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = q, s
            scales[name] = s
        else:
            tensors[name] = w.astype(ml_dtypes.bfloat16) if "bias" not in name else w
    _write(tmp_path, BF16, tensors, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [block, block]})
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    c = ckpt.config
    assert (c.expert_format, c.expert_block, c.param_dtype) == ("fp8", block, "bfloat16")
    q_b = "model.layers.1.self_attn.q_b_proj.weight"
    s = np.repeat(np.repeat(scales[q_b].astype(np.float64), block, 0), block, 1)
    want = (tensors[q_b].astype(np.float64) * s[:tensors[q_b].shape[0], :tensors[q_b].shape[1]]).T
    assert_close(ckpt.params["layers.1.attn.q_b_proj"], want, np.dtype(ml_dtypes.bfloat16))
    assert ckpt.params["layers.1.mlp.selection_bias"].dtype == np.float32
    np.testing.assert_array_equal(ckpt.params["layers.1.mlp.selection_bias"],
                                  params["layers.1.mlp.selection_bias"])
    np.testing.assert_array_equal(ckpt.params["layers.1.mlp.router"],
                                  params["layers.1.mlp.router"].astype(ml_dtypes.bfloat16))
    assert ckpt.experts["layers.1.mlp.gate"].dtype == ml_dtypes.float8_e4m3fn
    model = ckpt.build_model()
    out, _, _ = forward(model, _tokens(20), init_cache(c, 32))
    assert np.isfinite(np.asarray(out)).all()


REFUSED = [
    ({"num_key_value_heads": 1}, "num_key_value_heads=1"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"head_dim": 24}, "head_dim=24"),
    ({"qk_head_dim": 20}, "qk_head_dim=20"),
    ({"pretraining_tp": 2}, "pretraining_tp=2"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"qk_rope_head_dim": 5, "qk_nope_head_dim": 15}, "qk_rope_dim=5"),
    ({"v_head_dim": 40}, "v_head_dim=40"),
    ({"num_experts": 8}, "num_experts"),  # not a DeepSeek-V3 field
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
]


@pytest.mark.parametrize("fields,match", REFUSED, ids=[m for _, m in REFUSED])
def test_fields_the_model_does_not_implement_are_refused_by_name(fields, match):
    with pytest.raises(CheckpointError, match=match):
        config_from_hf(_config(F32, **fields))


def test_config_reads_transformers_5_spelling_and_plain_queries():
    cfg = _config(F32, q_lora_rank=None, head_dim=F32.qk_rope_dim, qk_head_dim=F32.head_dim,
                  rope_interleave=False, num_mtp_layers=1)
    for key in ("rope_theta", "rope_scaling", "torch_dtype"):
        cfg.pop(key)
    cfg.update(dtype="float32", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    c = config_from_hf(cfg)
    assert (c.q_lora_rank, c.rope_interleave, c.rope_scaling, c.softmax_multiplier) == \
        (0, False, None, 1.0)


def test_bad_mla_configs_name_the_field():
    with pytest.raises(ValueError, match="n_kv_heads=1"):
        F32.replace(n_kv_heads=1)
    with pytest.raises(ValueError, match="qk_rope_dim=24"):
        F32.replace(qk_rope_dim=24)
    with pytest.raises(ValueError, match="q_lora_rank"):
        F32.replace(q_lora_rank=-1)
    with pytest.raises(ValueError, match="sliding window"):
        F32.replace(sliding_window=8)
    with pytest.raises(ValueError, match="attention_sinks"):
        F32.replace(attention_sinks=True)
