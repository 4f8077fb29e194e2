"""The hybrid Qwen family (Qwen3-Next, Qwen3.5-MoE) without transformers: the model against the
float64 reference of the published recurrence, the engine's arms byte for byte, sessions, the
cache, its checkpoints as the files store them, and refusals by name.
(tests/test_hybrid_parity.py compares with transformers itself.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from strata_jax.checkpoint import CheckpointError, load_checkpoint
from strata_jax.engine import Engine
from strata_jax.layers.deltanet import DELTA_BLOCK
from strata_jax.models import (FAMILIES, build_model, cache_bytes, config_from_hf, forward,
                               get_preset, hybrid, init_cache, model_module, param_shapes)
from strata_jax.models.qwen3_next import _gates_order, _in_proj_order
from strata_jax.reference import reference_deltanet, reference_forward
from strata_jax.stream import StreamConfig, StreamTuning
from strata_jax.synthetic import init_synthetic
from strata_jax.testing import assert_close, delta_rule_inputs, save_safetensors

F32 = get_preset("qwen3-next-80b-a3b").scaled(n_experts=8, top_k=2, param_dtype="float32")
BF16 = F32.replace(param_dtype="bfloat16")


@pytest.fixture(scope="module")
def f32_params():
    return init_synthetic(F32, seed=1)


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, F32.vocab_size, n).astype(np.int32)


def test_presets_are_hybrid_and_registered():
    nxt = get_preset("qwen3-next-80b-a3b")
    assert isinstance(nxt, hybrid.HybridConfig) and model_module(nxt) is hybrid
    assert (nxt.n_layers, nxt.n_experts, nxt.top_k, nxt.expert_intermediate) == (48, 512, 10, 512)
    assert nxt.mixers.count("full_attention") == 12 and nxt.mixers[3] == "full_attention"
    assert (nxt.rotary_dim, nxt.linear_v_heads, nxt.shared_expert_gate) == (64, 32, True)
    q35 = get_preset("qwen3.5-35b-a3b")
    assert (q35.n_layers, q35.n_experts, q35.top_k, q35.vocab_size) == (40, 256, 8, 248_320)
    assert {"Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM",
            "Qwen3_5MoeForConditionalGeneration"} <= set(FAMILIES)
    shapes = param_shapes(F32)
    assert shapes["layers.0.linear_attn.in_proj"].shape == (64, 2 * 32 + 2 * 64)
    assert shapes["layers.3.attn.q_proj"].shape == (64, 2 * F32.q_dim)  # queries and gates
    assert "layers.0.attn.q_proj" not in shapes and "final_norm.centred_weight" in shapes


def test_deltanet_layer_matches_the_float64_recurrence_across_chunks(f32_params):
    """One Gated DeltaNet layer, chunkwise in float32, against the token-by-token float64
    recurrence: a prompt past two blocks in one call, then in two calls carrying the window and
    the state, then with a padded chunk (its padding leaves the state as it was)."""
    model = build_model(F32, f32_params)
    layer = model.layers[0].linear_attn
    x = np.random.default_rng(3).standard_normal((150, F32.hidden_size)).astype(np.float32)
    ref, ref_window, ref_state = reference_deltanet(F32, f32_params, "layers.0.linear_attn.", x)
    zeros = init_cache(F32, 8)
    window, state = zeros.keys[0], zeros.values[0]
    out, w1, s1 = layer(x, window, state)
    assert_close(out, ref, np.float32, err_msg="one call")
    assert_close(w1, ref_window, np.float32)
    assert_close(s1, ref_state, np.float32)
    a, w, s = layer(x[:70], window, state)
    b, w, s = layer(x[70:], w, s)
    assert_close(np.concatenate([a, b]), ref, np.float32, err_msg="two calls")
    assert_close(s, ref_state, np.float32)
    padded = np.concatenate([x[70:], np.ones((46, F32.hidden_size), np.float32)])  # 80 + 46
    _, w2, s2 = layer(x[:70], window, state)
    c, w2, s2 = layer(padded, w2, s2, valid=np.arange(126) < 80)
    assert_close(c[:80], ref[70:], np.float32, err_msg="padded call")
    assert_close(w2, ref_window, np.float32)
    assert_close(s2, ref_state, np.float32)
    assert 150 > 2 * DELTA_BLOCK


@pytest.mark.slow  # SCAN_UNROLL's default walks one block a step
def test_scan_walking_several_blocks_a_step_gives_the_same_bits():
    """`gated_delta_rule(unroll=n)` (`SCAN_UNROLL`): the scan's loop walking n blocks a step,
    also where n does not divide the blocks (11 here), gives the bits of one block a step."""
    import jax.numpy as jnp

    from strata_jax.layers.deltanet import gated_delta_rule
    from strata_jax.testing import delta_rule_inputs

    args = [jnp.asarray(a, jnp.float32) for a in delta_rule_inputs(690, 2, 32, 32, seed=3)]
    one, state = (np.asarray(a) for a in gated_delta_rule(*args, carry="xla", unroll=1))
    assert np.isfinite(one).all() and np.abs(state).max() > 0
    for n in (4, 16):
        o, s = gated_delta_rule(*args, carry="xla", unroll=n)
        np.testing.assert_array_equal(np.asarray(o), one, err_msg=f"unroll {n}")
        np.testing.assert_array_equal(np.asarray(s), state, err_msg=f"unroll {n}")


@pytest.mark.slow
def test_delta_rule_kernels_interpreted_match_the_scan_and_float64():
    """The Pallas kernels in interpret mode and the scan, each within float32 of the float64
    recurrence: 150 tokens in blocks of 64 (the last padded) and in the kernels' own blocks for
    float32 products (16), then four value heads reading two key heads (the kernels read them
    in place, the scan repeats them)."""
    import jax.numpy as jnp

    from strata_jax.layers.deltanet import gated_delta_rule
    from strata_jax.reference import reference_delta_rule

    inputs = delta_rule_inputs(150, 4, 16, 32, seed=7)
    args = [jnp.asarray(a, jnp.float32) for a in inputs]
    ref = reference_delta_rule(*inputs)
    for carry, block in (("xla", 64), ("pallas", 64), ("pallas", None)):  # None: 16 here
        got = gated_delta_rule(*args, block=block, carry=carry)
        assert_close(got[0], ref[0], np.float32, err_msg=f"{carry} {block}: outputs")
        assert_close(got[1], ref[1], np.float32, err_msg=f"{carry} {block}: the state")
    q2, k2 = inputs[0][:, :2], inputs[1][:, :2]  # 2 key heads for 4 value heads: h // 2
    ref = reference_delta_rule(np.repeat(q2, 2, 1), np.repeat(k2, 2, 1), *inputs[2:])
    for carry in ("xla", "pallas"):
        got = gated_delta_rule(jnp.asarray(q2, jnp.float32), jnp.asarray(k2, jnp.float32),
                               *args[2:], block=64, carry=carry)
        assert_close(got[0], ref[0], np.float32, err_msg=f"{carry}, shared keys: outputs")


@pytest.mark.slow
def test_delta_rule_kernels_take_the_layers_values_and_store_its_outputs():
    """A bf16 layer's values go in as bf16 (made float32 as the transform reads them) and its
    outputs come out as bf16 from the walk: the float32 path's outputs cast once, bit for bit,
    and the same state (the kernels in interpret mode; the scan casts the same way)."""
    import jax.numpy as jnp

    from strata_jax.layers.deltanet import gated_delta_rule

    inputs = [jnp.asarray(a, jnp.float32) for a in delta_rule_inputs(80, 2, 16, 16, seed=3)]
    v16 = inputs[2].astype(jnp.bfloat16)
    for carry in ("pallas", "xla"):
        want = gated_delta_rule(*inputs[:2], v16.astype(jnp.float32), *inputs[3:], block=16,
                                carry=carry)
        got = gated_delta_rule(*inputs[:2], v16, *inputs[3:], block=16, carry=carry,
                               out_dtype=jnp.bfloat16)
        assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32, carry
        np.testing.assert_array_equal(np.asarray(got[0].astype(jnp.float32)),
                                      np.asarray(want[0].astype(jnp.bfloat16).astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.slow
def test_bf16_products_match_float64_at_bf16():
    """bf16 products (what a bf16 layer's kernels take on a GPU: `products_for`), the kernels
    in interpret mode (blocks of 64, as on the GPU) and the scan, against the
    float64 recurrence at bf16's row of the table; the operands really are rounded (the
    kernels are not the float32 path's bits)."""
    import jax.numpy as jnp

    from strata_jax.layers.deltanet import gated_delta_rule
    from strata_jax.reference import reference_delta_rule

    inputs = delta_rule_inputs(150, 2, 32, 32, seed=5, state_scale=0.1)
    ref = reference_delta_rule(*inputs)
    args = [jnp.asarray(a, jnp.float32) for a in inputs]
    exact = np.asarray(gated_delta_rule(*args, block=64, carry="pallas")[0])
    for carry in ("pallas", "xla"):
        out, state = gated_delta_rule(*args, block=64, carry=carry, products="bf16")
        assert_close(out, ref[0], jnp.bfloat16, err_msg=f"{carry}: outputs")
        assert_close(state, ref[1], jnp.bfloat16, err_msg=f"{carry}: the state")
        assert np.abs(np.asarray(out) - exact).max() > 1e-5, carry


def test_decay_sums_are_float32_exact():
    """The scan's decays between two tokens of a block are sums over their own range, within
    float32 of the float64 sums over log-decays reaching hundreds (not a difference of two
    cumulative sums of that size)."""
    import jax.numpy as jnp

    from strata_jax.kernels.delta_rule import decay_sums

    rng = np.random.default_rng(4)
    g = -np.abs(rng.standard_normal((3, 64)) * 8.0).astype(np.float32)
    sums, gam = decay_sums(jnp.asarray(g))
    exact = np.array([[[g[b, j + 1:i + 1].astype(np.float64).sum() if i > j else 0.0
                        for j in range(64)] for i in range(64)] for b in range(3)])
    assert_close(sums, exact, np.float32)
    assert_close(gam, np.cumsum(g.astype(np.float64), axis=-1), np.float32)


@pytest.mark.slow
def test_delta_rule_kernels_match_float64_under_fast_decays():
    """The kernels take a block's decays as differences of its cumulative log-decays: with
    decays fast enough that a block's sums reach hundreds, the kernels (interpret mode; blocks
    of 64 and the float32 launch's 16) stay within float32 of the float64 recurrence."""
    import jax.numpy as jnp

    from strata_jax.kernels.delta_rule import delta_rule_chunk
    from strata_jax.reference import reference_delta_rule

    inputs = delta_rule_inputs(150, 2, 16, 32, seed=7, decay_shift=3.0)
    assert np.cumsum(inputs[3][:64, 0]).min() < -100.0
    ref = reference_delta_rule(*inputs)
    args = [jnp.asarray(a, jnp.float32) for a in inputs]
    for block in (64, None):
        out, state = delta_rule_chunk(*args, block=block)
        assert_close(out, ref[0], np.float32, err_msg=f"blocks of {block}")
        assert_close(state, ref[1], np.float32, err_msg=f"blocks of {block}: the state")


def test_delta_rule_kernels_lower_for_cuda_and_refuse_bad_shapes():
    """The Pallas rule lowers for CUDA to two Triton calls at the real head sizes with either
    products; "auto" and the products each path takes; a block or a slice that is not a power
    of two and unknown products are refused by name."""
    import jax
    import jax.numpy as jnp

    from strata_jax.kernels import Kernels
    from strata_jax.kernels.delta_rule import AUTO_ON_GPU, delta_rule_chunk, delta_rule_path
    from strata_jax.layers.deltanet import gated_delta_rule, products_for

    assert delta_rule_path("auto", "cpu") == "xla"
    assert delta_rule_path("auto", "cpu", "bf16") == "xla"
    assert delta_rule_path("auto", "gpu") == AUTO_ON_GPU["float32"] == "xla"
    assert delta_rule_path("auto", "gpu", "bf16") == AUTO_ON_GPU["bf16"] == "pallas"
    assert delta_rule_path("xla", "gpu", "bf16") == "xla"
    with pytest.raises(ValueError, match="'tf32'"):
        delta_rule_path("auto", "gpu", "tf32")
    assert products_for(jnp.bfloat16, "pallas", "gpu") == "bf16"
    assert products_for(jnp.bfloat16, "xla", "gpu") == "float32"
    assert products_for(jnp.float32, "pallas", "gpu") == "float32"
    assert products_for(jnp.bfloat16, "pallas", "cpu") == "float32"
    for name in ("scan", "fused"):
        with pytest.raises(ValueError, match=f"delta_rule='{name}'"):
            Kernels(delta_rule=name)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    rule = (f32(4096, 16, 128), f32(4096, 16, 128), f32(4096, 32, 128), f32(4096, 32),
            f32(4096, 32), f32(32, 128, 128))
    for products in ("float32", "bf16"):
        hlo = jax.jit(lambda *a, p=products: delta_rule_chunk(
            *a, block=64, products=p, interpret=False)).trace(*rule).lower(
            lowering_platforms=("cuda",)).as_text()
        assert hlo.count("__gpu$xla.gpu.triton") == 2
    zeros = [np.zeros(a.shape, np.float32) for a in rule]
    with pytest.raises(ValueError, match="products 'tf32'"):
        delta_rule_chunk(*zeros, block=64, products="tf32")
    with pytest.raises(ValueError, match="bv=48 must be a power of two"):
        delta_rule_chunk(*zeros, block=64, bv=48)
    with pytest.raises(ValueError, match="products 'tf32'"):
        gated_delta_rule(*zeros, products="tf32")
    with pytest.raises(ValueError, match="block=48 must be a power of two >= 16"):
        delta_rule_chunk(*zeros, block=48)


def test_model_matches_float64_reference_whole_and_in_chunks(f32_params):
    model = build_model(F32, f32_params)
    toks = _tokens(140)
    ref, ref_counts = reference_forward(F32, f32_params, toks)
    logits, cache, counts = forward(model, toks, init_cache(F32, 256))
    assert_close(logits, ref, np.float32)
    np.testing.assert_array_equal(np.asarray(counts), ref_counts)
    cache2, parts = init_cache(F32, 256), []
    for a, b in ((0, 33), (33, 100), (100, 140)):
        out, cache2, _ = forward(model, toks[a:b], cache2, start=a)
        parts.append(np.asarray(out))
    assert_close(np.concatenate(parts), ref, np.float32, err_msg="three chunks")


def test_cache_keeps_states_and_trims_attention():
    cache = init_cache(F32, 64)
    assert cache.capacity == 64 and cache.linear == (True, True, True, False)
    assert cache.keys[0].shape == (F32.conv_kernel - 1, F32.linear_conv_dim)
    assert cache.values[0].shape == (4, 16, 16) and cache.values[0].dtype == np.float32
    assert cache.keys[3].shape == (64, F32.n_kv_heads, F32.head_dim)
    valid = cache.valid(10)
    assert valid.keys[3].shape[0] == 10 and valid.keys[0].shape == cache.keys[0].shape
    assert valid.values[1].shape == cache.values[1].shape
    leaves = [a for pair in zip(cache.keys, cache.values) for a in pair]
    assert cache_bytes(F32, 64) == sum(a.nbytes for a in leaves)
    with pytest.raises(ValueError, match="capacity"):
        init_cache(F32, F32.max_seq_len + 1)


ARMS = {
    "resident": None,
    "stream-all": StreamConfig(routed=False, tuning=StreamTuning(stream_floor=32)),
    "routed": StreamConfig(routed=True, tuning=StreamTuning(stream_floor=4096)),
}


@pytest.mark.parametrize("order,arms", [
    pytest.param("chunk-major", ("stream-all", "routed"), marks=pytest.mark.slow,
                 id="chunk-major"),
    pytest.param("layer-major", ("stream-all",), marks=pytest.mark.slow,
                 id="layer-major-stream-all"),
    pytest.param("layer-major", ("routed",), marks=pytest.mark.slow, id="layer-major-routed")])
def test_engine_arms_are_byte_identical_across_turns(order, arms):
    """bf16: 80 tokens in chunks of 32 (the last padded), then a 21-token follow-up turn; each
    streamed arm's logits and session (KV caches, conv windows, recurrent states) equal the
    resident arm's bit for bit."""
    params = init_synthetic(BF16, seed=2, routing_skew=2.0)
    toks = _tokens(101, seed=4)
    seen = {}
    for arm in ("resident", *arms):
        with Engine(BF16, params, ARMS[arm], max_context=256, chunk_size=32,
                    order=order) as eng:
            first = eng.prefill(toks[:80])
            second = eng.prefill(toks[80:], first.session)
            seen[arm] = (first.logits.tobytes(), first.session.kv_sha256(),
                         second.logits.tobytes(), second.session.kv_sha256())
            assert second.session.position == 101
    for arm in arms:
        assert seen[arm] == seen["resident"], arm


@pytest.mark.slow  # chunks carry the state: test_model_matches_float64_reference_whole_and_in_chunks
def test_follow_up_turn_continues_the_state(f32_params):
    """float32: a prompt read in two turns gives the logits of the prompt read at once."""
    toks = _tokens(100, seed=5)
    with Engine(F32, f32_params, None, max_context=256, chunk_size=32) as eng:
        whole = eng.prefill(toks)
        first = eng.prefill(toks[:61])
        second = eng.prefill(toks[61:], first.session)
    assert_close(second.logits, whole.logits, np.float32)
    valid = second.session.valid_cache()
    assert valid.keys[3].shape[0] == 100  # the attention layer's positions only


def test_memory_plan_counts_the_deltanet_layers():
    """The plan's working memory of a Qwen3-Next chunk is the DeltaNet layer's (its delta rule
    at the real head sizes holds more than the fused attention), and `mixer_bytes` bounds what
    XLA's CPU buffer assignment gives the delta rule's scan path (temporaries, inputs, output;
    the GPU's is `benchmarks.compile_check`'s to check)."""
    import jax
    import jax.numpy as jnp

    from strata_jax.engine.memory import attention_working_bytes
    from strata_jax.layers.deltanet import gated_delta_rule
    from strata_jax.models.hybrid import mixer_bytes

    c = get_preset("qwen3-next-80b-a3b")
    assert attention_working_bytes(c, 8192, 32768, first=False, platform="gpu") == \
        mixer_bytes(c, 8192)
    t, hk, hv, dk, dv = 1024, c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    m = jax.jit(lambda *a: gated_delta_rule(*a, carry="xla")).lower(
        f32(t, hk, dk), f32(t, hk, dk), f32(t, hv, dv), f32(t, hv), f32(t, hv),
        f32(hv, dk, dv)).compile().memory_analysis()
    held = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
    assert held <= mixer_bytes(c, t)


@pytest.mark.slow
def test_pallas_delta_rule_through_the_engine(f32_params):
    """Kernels(delta_rule="pallas") (interpret mode here) through the engine: 80 tokens in
    chunks of 32 (the last padded), then a 21-token follow-up turn; resident and routed-streamed
    byte-identical, and the turn's logits within float32 of the scan's over the whole prompt."""
    from strata_jax.kernels import Kernels

    toks = _tokens(101, seed=6)
    seen = {}
    for arm in ("resident", "routed"):
        with Engine(F32, f32_params, ARMS[arm], max_context=256, chunk_size=32,
                    kernels=Kernels(delta_rule="pallas")) as eng:
            first = eng.prefill(toks[:80])
            second = eng.prefill(toks[80:], first.session)
            seen[arm] = (first.logits.tobytes(), second.logits.tobytes(),
                         second.session.kv_sha256(), second.logits)
    assert seen["routed"][:3] == seen["resident"][:3]
    with Engine(F32, f32_params, None, max_context=256, chunk_size=32) as eng:
        scan = eng.prefill(toks)
    assert_close(seen["resident"][3], scan.logits, np.float32)


# ---- checkpoints as the files store them ---------------------------------------------------------


def _hf_tensors(c, params, *, fused: bool, prefix: str = "model."):
    """Our params in Hugging Face names and layouts (Qwen3-Next's fused projections or
    Qwen3.5's split ones), written by hand."""
    t = {f"{prefix}embed_tokens.weight": params["embed"],
         f"{prefix}norm.weight": params["final_norm.centred_weight"],
         "lm_head.weight": params["lm_head"].T}
    kd, vd = c.linear_k_heads * c.linear_k_dim, c.linear_v_heads * c.linear_v_dim
    for l in range(c.n_layers):
        p, q = f"layers.{l}.", f"{prefix}layers.{l}."
        t[q + "input_layernorm.weight"] = params[p + "input_norm.centred_weight"]
        t[q + "post_attention_layernorm.weight"] = params[p + "post_attn_norm.centred_weight"]
        if c.is_linear(l):
            la, ours = q + "linear_attn.", p + "linear_attn."
            proj, gates = params[ours + "in_proj"], params[ours + "in_gates"]
            if fused:
                t[la + "in_proj_qkvz.weight"] = proj[:, np.argsort(_in_proj_order(c))].T
                t[la + "in_proj_ba.weight"] = gates[:, np.argsort(_gates_order(c))].T
            else:
                t[la + "in_proj_qkv.weight"] = proj[:, :2 * kd + vd].T
                t[la + "in_proj_z.weight"] = proj[:, 2 * kd + vd:].T
                t[la + "in_proj_b.weight"] = gates[:, :c.linear_v_heads].T
                t[la + "in_proj_a.weight"] = gates[:, c.linear_v_heads:].T
            t[la + "conv1d.weight"] = params[ours + "conv"].T[:, None, :]
            for name in ("dt_bias", "A_log", "norm.weight"):
                t[la + name] = params[ours + name]
            t[la + "out_proj.weight"] = params[ours + "out_proj"].T
        else:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                t[q + f"self_attn.{proj}.weight"] = params[p + f"attn.{proj}"].T
            for norm in ("q_norm", "k_norm"):
                t[q + f"self_attn.{norm}.weight"] = params[p + f"attn.{norm}.centred_weight"]
        t[q + "mlp.gate.weight"] = params[p + "mlp.router"].T
        for ours, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            t[q + f"mlp.shared_expert.{hf}.weight"] = params[p + f"mlp.shared.{ours}"].T
            w = params[p + f"mlp.{ours}"]
            for e in range(c.n_experts):
                t[q + f"mlp.experts.{e}.{hf}.weight"] = w[e].T
        t[q + "mlp.shared_expert_gate.weight"] = params[p + "mlp.shared_gate"].T
    return {k: np.ascontiguousarray(v) for k, v in t.items()}


def _text_config(c, **fields) -> dict:
    cfg = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
               num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
               num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
               num_experts=c.n_experts, num_experts_per_tok=c.top_k,
               moe_intermediate_size=c.expert_intermediate,
               shared_expert_intermediate_size=c.shared_expert_intermediate,
               linear_num_key_heads=c.linear_k_heads, linear_num_value_heads=c.linear_v_heads,
               linear_key_head_dim=c.linear_k_dim, linear_value_head_dim=c.linear_v_dim,
               linear_conv_kernel_dim=c.conv_kernel, layer_types=list(c.mixers),
               rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_seq_len,
               rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.rotary_dim / c.head_dim},
               dtype=c.param_dtype, tie_word_embeddings=False)
    cfg.update(fields)
    return cfg


FORMS = {
    "qwen3-next": (dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                        norm_topk_prob=True), True, "model."),
    "qwen3.5": (dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text"),
                False, "model."),
    "qwen3.5-multimodal": (None, False, "model.language_model."),
}


def _write(path, c, params, form, extra=()):
    fields, fused, prefix = FORMS[form]
    tensors = _hf_tensors(c, params, fused=fused, prefix=prefix)
    tensors.update(dict(extra))
    save_safetensors(tensors, path / "model.safetensors")
    if fields is None:
        cfg = dict(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                   text_config=_text_config(c, model_type="qwen3_5_moe_text"),
                   vision_config={"depth": 1}, image_token_id=5, dtype=c.param_dtype)
    else:
        cfg = _text_config(c, **fields)
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


@pytest.mark.parametrize("form", list(FORMS))
def test_checkpoints_load_as_stored_and_say_what_they_skip(tmp_path, f32_params, form, capsys):
    params = {k: np.asarray(f32_params[k]) for k in param_shapes(F32)}
    mtp = {"mtp.fc.weight": np.ones((4, 4), np.float32)}
    extra = dict(mtp, **({"model.visual.patch.weight": np.ones(3, np.float32)}
                         if form == "qwen3.5-multimodal" else {}))
    _write(tmp_path, F32, params, form, extra)
    ckpt = load_checkpoint(str(tmp_path), progress=True)
    err = capsys.readouterr().err
    assert "skipped 1 tensor(s) under 'mtp.'" in err
    assert set(ckpt.skipped) == set(("mtp.", "model.visual.") if "multi" in form else ("mtp.",))
    assert ckpt.config.mixers == F32.mixers and ckpt.config.rotary_dim == F32.rotary_dim
    for name, value in ckpt.params.items():
        np.testing.assert_array_equal(value, params[name], err_msg=name)
    for name in ckpt.experts:
        np.testing.assert_array_equal(ckpt.experts[name], params[name], err_msg=name)


def test_unknown_tensors_are_still_refused(tmp_path, f32_params):
    params = {k: np.asarray(f32_params[k]) for k in param_shapes(F32)}
    _write(tmp_path, F32, params, "qwen3.5", {"model.visual.x": np.ones(2, np.float32)})
    with pytest.raises(CheckpointError, match="model.visual.x"):
        load_checkpoint(str(tmp_path), progress=False)


REFUSED = [
    ("qwen3-next", {"attn_output_gate": False}, "attn_output_gate=False"),
    ("qwen3-next", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("qwen3-next", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3-next", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen3-next", {"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
     "layer_types"),
    ("qwen3-next", {"full_attention_interval": 0, "layer_types": None},
     "full_attention_interval=0"),
    ("qwen3-next", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3.5", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("qwen3.5", {"decoder_sparse_step": 1}, "decoder_sparse_step"),  # not a Qwen3.5 field
    ("qwen3.5", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                     "partial_rotary_factor": 0.03}}, "partial_rotary_factor"),
    ("qwen3.5", {"linear_num_value_heads": 3}, "linear_v_heads=3"),
]


@pytest.mark.parametrize("form,fields,match", REFUSED, ids=[m for _, _, m in REFUSED])
def test_fields_the_model_does_not_implement_are_refused_by_name(form, fields, match):
    cfg = _text_config(F32, **FORMS[form][0])
    cfg.update(fields)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(CheckpointError, match=match):
        config_from_hf(cfg)


def test_multimodal_config_reads_its_text_config():
    base = dict(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                text_config=_text_config(F32, model_type="qwen3_5_moe_text"), dtype="float32")
    c = config_from_hf(base)
    assert isinstance(c, hybrid.HybridConfig) and c.n_experts == F32.n_experts
    with pytest.raises(CheckpointError, match="disagree"):
        config_from_hf(dict(base, dtype="bfloat16",
                            text_config=dict(base["text_config"], dtype="float32")))
    with pytest.raises(CheckpointError, match="model_type"):
        config_from_hf(dict(base, model_type="qwen3_moe"))
    with pytest.raises(CheckpointError, match="mrope"):
        config_from_hf(dict(base, text_config=dict(base["text_config"], mrope="x")))


def test_bad_hybrid_configs_name_the_field():
    with pytest.raises(ValueError, match="mixers has 3 entries"):
        F32.replace(mixers=F32.mixers[:3])
    with pytest.raises(ValueError, match="mixers\\[0\\]='sliding'"):
        F32.replace(mixers=("sliding",) + F32.mixers[1:])
    with pytest.raises(ValueError, match="rotary_dim=3"):
        F32.replace(rotary_dim=3)
    with pytest.raises(ValueError, match="sliding window"):
        F32.replace(sliding_window=8)
