"""The Flax model against the float64 NumPy reference, the KV cache, the expert-source seam."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from strata_jax import models
from strata_jax.models import decoder as M
from strata_jax.layers import moe

from strata_jax.layers import attention

from strata_jax.models import PRESETS, get_preset
from strata_jax.kernels import Kernels
from strata_jax.formats import ExpertFormat
from strata_jax.experts import (ExpertSource, ExpertWeights, ResidentExperts, pack_expert_blobs,
                                pack_expert_blobs_np, unpack_expert_blobs, unpack_expert_blobs_np)
from strata_jax.reference import reference_attention, reference_forward
from strata_jax.synthetic import init_synthetic, split_experts
from strata_jax.testing import PoisonUnrouted, assert_close


def small(name, **kw):
    full = get_preset(name)
    kw.setdefault("n_experts", 16 if full.n_experts > 16 else None)
    kw.setdefault("param_dtype", "float32")
    return full.scaled(**kw)


_MODELS = {}


def built(config, seed=0):
    """(model, params) cached per config so each test module compiles a config once."""
    key = (config, seed)
    if key not in _MODELS:
        params = init_synthetic(config, seed)
        _MODELS[key] = (models.build_model(config, params), params)
    return _MODELS[key]


def tokens_for(config, n, seed=1):
    return np.random.default_rng(seed).integers(0, config.vocab_size, n).astype(np.int32)


def test_constant_prompt_matches_reference():
    c = small("qwen3-30b-a3b")
    model, params = built(c)
    toks = np.full(12, 7, np.int32)
    logits, _, counts = M.forward(model, toks, models.init_cache(c, 32))
    ref, ref_counts = reference_forward(c, params, toks)
    assert_close(logits, ref, np.float32)
    np.testing.assert_array_equal(np.asarray(counts), ref_counts)


# The default run: three presets (Qwen3's routing, DeepSeek's group-limited sigmoid, Qwen3-Next's
# gated shared expert); the slow run every preset (Mixtral's and OLMoE's routing too).
_ROUTINGS = ("qwen3-30b-a3b", "deepseek-v3", "qwen3-next-80b-a3b")


@pytest.mark.parametrize("name", [n if n in _ROUTINGS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(PRESETS)])
def test_random_prompt_matches_reference(name):
    c = small(name)
    model, params = built(c)
    toks = tokens_for(c, 24)
    logits, cache, counts = M.forward(model, toks, models.init_cache(c, 32))
    assert logits.dtype == jnp.float32 and logits.shape == (24, c.vocab_size)
    assert counts.dtype == jnp.int32 and counts.shape == (len(c.moe_layers), c.n_experts)
    ref, ref_counts = reference_forward(c, params, toks)
    assert_close(logits, ref, np.float32, err_msg=name)
    np.testing.assert_array_equal(np.asarray(counts), ref_counts)
    assert np.asarray(counts).sum(1).tolist() == [24 * c.top_k] * len(c.moe_layers)


def test_tied_embeddings_match_reference():
    c = dataclasses.replace(small("olmoe-1b-7b"), tie_embeddings=True)
    model, params = built(c)
    assert "lm_head" not in params
    toks = tokens_for(c, 10)
    logits, _, _ = M.forward(model, toks, models.init_cache(c, 16))
    assert_close(logits, reference_forward(c, params, toks)[0], np.float32)


def test_bfloat16_matches_reference():
    # Few experts and top-k = E/2 with 8 tokens: routing near-ties that bf16 could flip are rare;
    # the reference runs on the same bf16-rounded weights.
    c = small("qwen3-30b-a3b", param_dtype="bfloat16", n_experts=8, top_k=4)
    model, params = built(c, seed=3)
    toks = tokens_for(c, 8)
    logits, cache, _ = M.forward(model, toks, models.init_cache(c, 16))
    assert cache.keys[0].dtype == jnp.bfloat16
    assert_close(logits, reference_forward(c, params, toks)[0], ml_dtypes.bfloat16)


# Chunked prompts against the float64 reference in the default run: test_attention.
@pytest.mark.parametrize("name", [pytest.param("qwen3-30b-a3b", marks=pytest.mark.slow),
                                  pytest.param("deepseek-v3", marks=pytest.mark.slow)])
def test_chunked_prefill_equals_one_shot(name):
    # Within float32 tolerance, not bitwise: the first chunk attends to its own keys (S = T) while
    # later chunks reduce over the whole cache capacity with a mask, a different reduction order.
    c = small(name)
    model, _ = built(c)
    toks = tokens_for(c, 30)
    one_logits, one_cache, one_counts = M.forward(model, toks, models.init_cache(c, 32))
    cache = models.init_cache(c, 32)
    parts, counts = [], []
    for lo, hi in ((0, 7), (7, 19), (19, 30)):
        logits, cache, cnt = M.forward(model, toks[lo:hi], cache, lo)
        parts.append(np.asarray(logits))
        counts.append(np.asarray(cnt))
    assert_close(np.concatenate(parts), one_logits, np.float32)
    np.testing.assert_array_equal(sum(counts), np.asarray(one_counts))
    for a, b in zip(cache.keys + cache.values, one_cache.keys + one_cache.values):
        assert_close(a, b, np.float32)


def test_source_seam_unrouted_rows_never_read():
    c = small("qwen3-next-80b-a3b", n_experts=64, top_k=2)
    model, _ = built(c)
    toks = tokens_for(c, 5)  # 10 assignments over 64 experts: most are unrouted
    cache = models.init_cache(c, 8)
    resident = M.forward(model, toks, cache, 0)
    source = PoisonUnrouted()
    assert isinstance(source, ExpertSource)
    poisoned = M.forward(model, toks, cache, 0, expert_source=source)
    assert (np.asarray(resident[2]) == 0).sum() > 64  # the test really has unrouted experts
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 resident, poisoned)  # exact equality, never a tolerance
    assert [call[0] for call in source.calls] == list(c.moe_layers)
    assert all(call[1:] == ((c.n_experts,), jnp.int32) for call in source.calls)


class BlobSource:
    """Serves experts from packed blobs, as a host store would."""

    def __init__(self, blobs, config):
        self.blobs, self.config = blobs, config

    def expert_weights(self, layer, counts, resident):
        assert resident is None
        return unpack_expert_blobs(jnp.asarray(self.blobs[layer]), self.config.hidden_size,
                                   self.config.expert_intermediate)


def test_model_without_resident_experts_uses_source():
    c = small("deepseek-v3")
    model, params = built(c)
    dense, experts = split_experts(c, params)
    lean = models.build_model(c, dense, resident_experts=False)
    lean_names = models.param_shapes(c, resident_experts=False)
    assert not any(n in lean_names for l in c.moe_layers for n in M.expert_param_names(c, l))
    toks = tokens_for(c, 9)
    cache = models.init_cache(c, 16)
    with pytest.raises(ValueError, match="no resident expert weights"):
        M.forward(lean, toks, cache, 0)
    blobs = {l: pack_expert_blobs_np(w) for l, w in experts.items()}
    streamed = M.forward(lean, toks, cache, 0, expert_source=BlobSource(blobs, c))
    resident = M.forward(model, toks, cache, 0, expert_source=ResidentExperts())
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 resident, streamed)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unpermute_inverts_permute_and_weights_in_float32(dtype):
    # Token copies sorted by expert (padding's sentinel id E among them) come back in token order
    # through the inverse permutation, and the weighted sum over k runs in float32: the exact
    # float32 NumPy value, rounded once to the output dtype.
    t, k, h, e = 37, 4, 24, 6
    rng = np.random.default_rng(0)
    ids = rng.integers(0, e + 1, (t, k)).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((t, h)), dtype)
    w = rng.random((t, k)).astype(np.float32)
    x_sorted, order = moe.permute(x, jnp.asarray(ids))
    order = np.asarray(order)
    np.testing.assert_array_equal(np.sort(order), np.arange(t * k))  # a permutation
    np.testing.assert_array_equal(ids.reshape(-1)[order], np.sort(ids.reshape(-1), kind="stable"))
    np.testing.assert_array_equal(np.asarray(x_sorted), np.asarray(x)[order // k])
    y_sorted = x_sorted * jnp.asarray(np.arange(1, t * k + 1)[:, None], dtype)  # rows differ
    got = np.asarray(moe.unpermute(y_sorted, jnp.asarray(order), jnp.asarray(w)))
    assert np.all(np.isfinite(got.astype(np.float32)))
    y = np.zeros((t * k, h), np.float32)
    y[order] = np.asarray(y_sorted).astype(np.float32)
    want = np.einsum("tkh,tk->th", y.reshape(t, k, h).astype(np.float64), w.astype(np.float64))
    assert got.dtype == np.dtype(dtype)
    assert_close(got, want, dtype)


def test_blob_roundtrip():
    rng = np.random.default_rng(0)
    e, h, i = 3, 4, 5
    w = ExpertWeights(rng.standard_normal((e, h, i)).astype(np.float32),
                      rng.standard_normal((e, h, i)).astype(np.float32),
                      rng.standard_normal((e, i, h)).astype(np.float32))
    blobs = pack_expert_blobs_np(w)
    assert blobs.shape == (e, 3 * h * i) and blobs.dtype == np.float32
    np.testing.assert_array_equal(blobs[1, : h * i], w.gate[1].ravel())  # layout: gate first
    np.testing.assert_array_equal(blobs[2, 2 * h * i:], w.down[2].ravel())
    jblobs = pack_expert_blobs(jax.tree.map(jnp.asarray, w))
    np.testing.assert_array_equal(np.asarray(jblobs), blobs)
    for a, b in zip(jax.jit(unpack_expert_blobs, static_argnums=(1, 2))(jblobs, h, i), w):
        np.testing.assert_array_equal(np.asarray(a), b)
    for a, b in zip(unpack_expert_blobs_np(blobs, h, i), w):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="expected"):
        unpack_expert_blobs_np(blobs, h, i + 1)


@pytest.mark.slow  # the einsum path is a reference for comparisons, not a default
def test_einsum_attention_matches_xla():
    c = small("mixtral-8x7b")
    model, params = built(c)
    toks = tokens_for(c, 16)
    cache = models.init_cache(c, 32)
    first, cache1, _ = M.forward(model, toks[:8], cache, 0)
    second, _, _ = M.forward(model, toks[8:], cache1, 8)
    # The same weights with the einsum path: the kernels are part of the model's static graph,
    # so forward's cached jit traces it anew.
    einsum = models.build_model(c, params, kernels=Kernels(attention="einsum"))
    first_e, cache1_e, _ = M.forward(einsum, toks[:8], cache, 0)
    second_e, _, _ = M.forward(einsum, toks[8:], cache1_e, 8)
    assert_close(first_e, first, np.float32)
    assert_close(second_e, second, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("start,block", [(0, 16), (200, 64), (457, 512), (440, 96), (300, 500)])
def test_blocked_attention_matches_reference(dtype, start, block):
    # Blocks of 96 and 500 do not divide the 512 keys: the last block overlaps the one before.
    # 50 queries at positions start..start+49 against a 512-position cache (keys past the last
    # query hold garbage that must never count), 8 heads over 2 KV heads.
    rng = np.random.default_rng(start + block)
    t, n, kvh, d, s = 50, 8, 2, 16, 512
    q = rng.standard_normal((t, n, d)).astype(dtype)
    k = rng.standard_normal((s, kvh, d)).astype(dtype)
    v = rng.standard_normal((s, kvh, d)).astype(dtype)
    k[start + t:] = 1e4  # garbage past the last query: would dominate any softmax it entered
    positions = np.arange(start, start + t, dtype=np.int32)
    got = jax.jit(attention.blocked_attention, static_argnums=4)(q, k, v, positions, block)
    assert got.dtype == np.dtype(dtype)
    assert_close(got, reference_attention(q, k, v, positions), dtype)


def test_attention_path_is_chosen_by_dtype_size_platform_and_request():
    path = attention.attention_path
    # CPU: a later chunk's XLA scores up to 2 GiB, blocked past it; float64 always einsum.
    assert path(jnp.bfloat16, 128, 32, 1024, 8192, first=False, platform="cpu") == "xla"
    assert path(jnp.bfloat16, 128, 32, 8192, 40960, first=False, platform="cpu") == "blocked"
    assert path(jnp.bfloat16, 128, 32, 8192, 40960, first=True, platform="cpu") == "xla"
    assert path(jnp.float64, 128, 32, 8192, 40960, first=False, platform="cpu") == "einsum"
    # GPU: cuDNN for bf16/fp16 with head_dim <= 256 (qwen3-next's), a multiple of 8; float32
    # stays exact.
    for dt in (jnp.bfloat16, jnp.float16):
        for first in (True, False):
            assert path(dt, 128, 32, 8192, 40960, first=first, platform="gpu") == "cudnn"
            assert path(dt, 256, 16, 64, 128, first=first, platform="gpu") == "cudnn"
        assert path(dt, 64, 16, 8192, 40960, first=False, platform="gpu") == "cudnn"
    assert path(jnp.bfloat16, 512, 8, 64, 128, first=False, platform="gpu") == "xla"
    assert path(jnp.bfloat16, 100, 8, 64, 128, first=False, platform="gpu") == "xla"
    assert path(jnp.float32, 128, 32, 8192, 40960, first=False, platform="gpu") == "blocked"
    # A requested path (Kernels.attention).
    assert path(jnp.bfloat16, 16, 2, 4, 16, first=False, impl="blocked") == "blocked"
    assert path(jnp.bfloat16, 16, 2, 4, 16, first=True, impl="blocked") == "xla"
    # cuDNN forced where it cannot run: the exact XLA path.
    assert path(jnp.bfloat16, 128, 32, 64, 128, first=False, platform="cpu", impl="cudnn") == "xla"
    assert path(jnp.float32, 16, 2, 4, 16, first=False, impl="split") == "split"
    with pytest.raises(ValueError, match="attention path 'flash'"):
        path(jnp.float32, 16, 2, 4, 16, first=False, impl="flash")
    with pytest.raises(ValueError, match=r"Kernels\(attention='flash'\): expected one of"):
        Kernels(attention="flash")
    with pytest.raises(ValueError, match=r"Kernels\(grouped_matmul='dense'\): expected one of"):
        Kernels(grouped_matmul="dense")
    assert attention.attention_key_block(32, 8192, 40960) == 256  # 256 MiB of scores per block
    # A cache that no power of two divides keeps its block (it used to shrink to 4 keys here).
    assert attention.attention_key_block(32, 2048, 20500) == 1024
    assert attention.attention_key_block(4, 16, 96) == 96  # never more than the cache


@pytest.mark.slow  # the blocked path against the reference: test_blocked_attention_matches_*
def test_blocked_attention_in_chunked_prefill():
    # Follow-up chunks attend blocked (forced): the same as the default path within float32.
    c = small("qwen3-30b-a3b")
    _, params = built(c)
    toks = tokens_for(c, 40)
    cache = models.init_cache(c, 64)
    outs = []
    for impl in ("xla", "blocked"):
        model = models.build_model(c, params, kernels=Kernels(attention=impl))
        first, cache1, _ = M.forward(model, toks[:16], cache, 0)
        second, cache2, _ = M.forward(model, toks[16:], cache1, 16)
        outs.append((second, cache2))
    assert_close(outs[1][0], outs[0][0], np.float32)
    for a, b in zip(outs[1][1].keys, outs[0][1].keys):
        assert_close(a, b, np.float32)


@pytest.mark.parametrize("name", [n if n in ("qwen3-30b-a3b", "qwen3-next-80b-a3b")
                                  else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(PRESETS)])
def test_eval_shape_full_size(name):
    c = get_preset(name)
    shapes = models.param_shapes(c)
    l = c.moe_layers[0]
    assert shapes[f"layers.{l}.mlp.gate"].shape == (c.n_experts, c.hidden_size,
                                                     c.expert_intermediate)
    assert shapes[f"layers.{l}.mlp.down"].shape == (c.n_experts, c.expert_intermediate,
                                                     c.hidden_size)
    assert shapes[f"layers.{l}.mlp.router"].shape == (c.hidden_size, c.n_experts)
    planes = {p.name for p in ExpertFormat.of(c).planes}  # gate, up, down (and biases)
    expert_bytes = sum(s.size * s.dtype.itemsize for k, s in shapes.items()
                       if k.rsplit(".", 1)[-1] in planes and ".shared" not in k
                       and int(k.split(".")[1]) in c.moe_layers)
    assert expert_bytes == c.expert_bytes_total
    graphdef, state = nnx.split(M.abstract_model(c))  # ShapeDtypeStruct leaves: nothing allocated

    def run(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache, 0)

    logits, cache, counts = jax.eval_shape(
        run, state, jax.ShapeDtypeStruct((8,), jnp.int32), M.cache_shapes(c, 16))
    assert logits.shape == (8, c.vocab_size) and logits.dtype == jnp.float32
    assert counts.shape == (len(c.moe_layers), c.n_experts)
    assert len(cache.keys) == c.n_layers and cache.keys[0].shape == (16, c.n_kv_heads, c.head_dim)


@pytest.mark.parametrize("tokens, start, pattern", [
    ([1, 2, 512], 0, "token id 512 outside the vocabulary"),
    ([1, -3, 2], 0, "token id -3 outside"),
    ([], 0, "empty prompt"),
    ([[1, 2]], 0, "1-D"),
    ([1.5, 2.0], 0, "integer"),
    ([1, 2, 3], 30, "past the KV cache"),
    ([1, 2], -1, "start position"),
])
def test_bad_inputs_raise_before_device_work(tokens, start, pattern):
    c = small("qwen3-30b-a3b")
    model, _ = built(c)
    with pytest.raises(ValueError, match=pattern):
        M.forward(model, tokens, models.init_cache(c, 32), start)


def test_prompt_past_max_context():
    c = small("qwen3-30b-a3b", max_seq_len=16)
    with pytest.raises(ValueError, match="capacity 32"):
        models.init_cache(c, 32)
    with pytest.raises(ValueError, match="past max context.*max_seq_len=16"):
        M.validate_inputs(c, np.zeros(20, np.int32), cache_capacity=64, start=0)


def test_build_model_errors():
    c = small("qwen3-30b-a3b")
    params = init_synthetic(c, 0)
    missing = dict(params)
    del missing["layers.1.attn.k_proj"]
    with pytest.raises(KeyError, match="layers.1.attn.k_proj"):
        models.build_model(c, missing)
    bad = dict(params, **{"layers.0.mlp.router": np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match=r"layers.0.mlp.router.*\(3, 3\).*\(64, 16\)"):
        models.build_model(c, bad)


@pytest.mark.gpu
def test_forward_8k_tokens_on_gpu():
    # Hopper-friendly shapes (K % 64, N % 128) so the Mosaic GPU grouped matmul runs.
    c = get_preset("qwen3-30b-a3b").scaled(hidden_size=256, expert_intermediate=256, n_experts=128,
                                           n_layers=2, max_seq_len=8192)
    model = models.build_model(c, init_synthetic(c, 0))
    toks = tokens_for(c, 8192)
    logits, _, counts = M.forward(model, toks, models.init_cache(c, 8192))
    logits = np.asarray(logits)
    assert np.isfinite(logits).all()
    assert np.asarray(counts).sum(1).tolist() == [8192 * c.top_k] * len(c.moe_layers)



def test_build_model_with_separate_experts_keeps_shared_expert_weights():
    # The shared expert's leaves (layers.N.mlp.shared.gate/up/down) share names with the routed
    # experts'; they must come from `params`, never from the `experts` mapping: a missing one is
    # reported as missing, not filled with a routed expert's array of another shape.
    from strata_jax.synthetic import init_synthetic, split_experts

    c = get_preset("qwen3-next-80b-a3b").scaled(n_layers=2, n_experts=8, top_k=2,
                                                  param_dtype="float32")
    params = init_synthetic(c, seed=4)
    dense, experts = split_experts(c, params)
    _, built = nnx.split(models.build_model(c, dense, experts=experts))
    _, reference = nnx.split(models.build_model(c, params))
    for (pa, va), (pb, vb) in zip(nnx.to_flat_state(built), nnx.to_flat_state(reference)):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(M._get(va)), np.asarray(M._get(vb)))
    del dense["layers.0.mlp.shared.down"]
    with pytest.raises(KeyError, match="missing parameter 'layers.0.mlp.shared.down'"):
        models.build_model(c, dense, experts=experts)


# ---- padding (the engine's compile buckets) and layer-major order ------------------------------


# DeepSeek: a dense layer and group-limited sigmoid routing; Qwen3-Next: a gated shared expert.
@pytest.mark.parametrize("name", ["deepseek-v3",
                                  pytest.param("qwen3-next-80b-a3b", marks=pytest.mark.slow)])
def test_padding_changes_no_real_output(name):
    # 13 real tokens padded to 16: whatever the padding holds, the real rows' logits, the real KV
    # positions and the routing counts are the same bits, and match the unpadded chunk within
    # numerics (a different M may reduce in another order).
    c = small(name)
    model, _ = built(c)
    toks = tokens_for(c, 13)
    run = jax.jit(lambda t, k, n: model(t, k, 0, None, n_valid=n))
    outs = []
    for fill in (0, 7, c.vocab_size - 1):
        padded = np.concatenate([toks, np.full(3, fill, np.int32)])
        outs.append(run(jnp.asarray(padded), models.init_cache(c, 32), jnp.int32(13)))
    for logits, cache, counts in outs[1:]:
        np.testing.assert_array_equal(np.asarray(logits)[:13], np.asarray(outs[0][0])[:13])
        np.testing.assert_array_equal(np.asarray(counts), np.asarray(outs[0][2]))
        for a, b in zip(cache.keys + cache.values, outs[0][1].keys + outs[0][1].values):
            np.testing.assert_array_equal(np.asarray(a)[:13], np.asarray(b)[:13])
    ref_logits, ref_cache, ref_counts = M.forward(model, toks, models.init_cache(c, 32))
    logits, cache, counts = outs[0]
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts))  # padding uncounted
    assert_close(np.asarray(logits)[:13], ref_logits, np.float32)
    for a, b in zip(cache.keys + cache.values, ref_cache.keys + ref_cache.values):
        assert_close(np.asarray(a)[:13], np.asarray(b)[:13], np.float32)
    last = jax.jit(lambda t, k, n: model(t, k, 0, None, n_valid=n, last_logits=True))(
        jnp.asarray(np.concatenate([toks, np.zeros(3, np.int32)])), models.init_cache(c, 32),
        jnp.int32(13))[0]
    assert last.shape == (c.vocab_size,)
    np.testing.assert_array_equal(np.asarray(last), np.asarray(logits)[12])


def test_padding_reads_no_unrouted_expert():
    # A source that poisons every expert no real token routes to: padding must not route to one.
    c = small("qwen3-next-80b-a3b", n_experts=64, top_k=2)
    model, _ = built(c)
    toks = np.concatenate([tokens_for(c, 5), np.zeros(11, np.int32)])
    f = jax.jit(lambda t, k, src: model(t, k, 0, src, n_valid=jnp.int32(5)), static_argnums=2)
    resident = f(jnp.asarray(toks), models.init_cache(c, 16), None)
    poisoned = f(jnp.asarray(toks), models.init_cache(c, 16), PoisonUnrouted())
    assert np.asarray(resident[2]).sum() == 5 * c.top_k * len(c.moe_layers)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 resident, poisoned)


@pytest.mark.slow  # the engine's layer-major against chunk-major: test_engine
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_layer_major_equals_chunked(name):
    # Every layer over the whole prompt in sub-chunks of 8 against three chunks of 8 run layer by
    # layer inside each chunk: the same per-sub-chunk math in another order. Measured on CPU:
    # identical bits; asserted within float32 numerics. One source call per MoE layer, with the
    # counts summed over the sub-chunks.
    c = small(name)
    model, _ = built(c)
    toks = tokens_for(c, 21)
    padded = np.concatenate([toks, np.zeros(3, np.int32)])
    cache = models.init_cache(c, 32)
    parts, counts = [], []
    for j in range(3):
        piece = padded[8 * j:8 * (j + 1)]
        n = min(8, 21 - 8 * j)
        fn = jax.jit(lambda t, k, s, v, first=(j == 0): model(t, k, 0 if first else s, None,
                                                            n_valid=v))
        logits, cache, cnt = fn(jnp.asarray(piece), cache, jnp.int32(8 * j), jnp.int32(n))
        parts.append(np.asarray(logits)[:n])
        counts.append(np.asarray(cnt))
    source = ResidentCounting()
    lm_logits, lm_cache, lm_counts = jax.jit(
        lambda t, k: model.layer_major(t, k, 0, source, 8, n_valid=jnp.int32(21)))(
        jnp.asarray(padded), models.init_cache(c, 32))
    assert source.layers == list(c.moe_layers)  # one fetch per layer per prompt
    np.testing.assert_array_equal(np.asarray(lm_counts), sum(counts))
    assert_close(np.asarray(lm_logits)[:21], np.concatenate(parts), np.float32)
    for a, b in zip(lm_cache.keys + lm_cache.values, cache.keys + cache.values):
        assert_close(np.asarray(a)[:21], np.asarray(b)[:21], np.float32)
    with pytest.raises(ValueError, match="not a whole number of sub-chunks"):
        model.layer_major(jnp.asarray(toks), models.init_cache(c, 32), 0, None, 8)


class ResidentCounting(ResidentExperts):
    """The resident source, recording which layers asked for weights (at trace time)."""

    def __init__(self):
        self.layers = []

    def expert_weights(self, layer, counts, resident):
        self.layers.append(layer)
        return super().expert_weights(layer, counts, resident)

    __hash__ = object.__hash__
    __eq__ = object.__eq__
